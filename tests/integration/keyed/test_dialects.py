"""Cache hints in the clients' own dialects, against the real server with the real, unmodified
client packages (openai, langchain-openai, anthropic): OpenAI's ``prompt_cache_key`` and
retention hints, a plain ``X-Session-ID`` header, and Anthropic's ``cache_control``
breakpoints become kvbranch sessions and pins. Turn 2 reuses turn 1's KV (the server's own
token accounting), greedy outputs equal plain vLLM's without hints, and tenants stay apart.

``kvbranch_server`` has a 9-block pin budget (see tests/conftest.py), so the prompts here stay
small enough (4-6 blocks) to be pinned.
"""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from langchain_openai import ChatOpenAI

from tests.integration.helpers import (
    BLOCK,
    client,
    reset_device_cache,
    system_prompt,
)
from tests.integration.keyed.server import DIALECT_KEYS

STEPS = [
    "Step 0. Tool result: weather in Paris is 18C, light rain. What next?",
    "Step 1. Tool result: flight AF1234 departs 09:40 from gate K32. What next?",
]


def openai_client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1", api_key=server.api_key or "EMPTY", max_retries=0, timeout=600
    )


def anthropic_client(server, **kw) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.url,
        api_key=server.api_key or "EMPTY",
        default_headers=server.headers(),
        max_retries=0,
        timeout=600,
        **kw,
    )


def branch(server, session: str, branch_id: str = "main") -> dict:
    with client(server) as c:
        r = c.get(f"/v1/kvbranch/sessions/{session}/branches/{branch_id}")
    assert r.status_code == 200, r.text
    return r.json()


def split_of(response) -> dict:
    split = (response.model_extra or {}).get("kvbranch")
    assert split is not None, "the response carries kvbranch's prompt-source split"
    return split


# --- OpenAI ----------------------------------------------------------------------------------
def test_openai_prompt_cache_key_and_retention_reuse_turn_one(kvbranch_server, plain_server):
    """The unmodified openai client: prompt_cache_key → session, '24h' → a 24 h pin lease;
    turn 2 (device cache dropped) loads turn 1's KV from the pinned host-store copy."""
    ours, plain = openai_client(kvbranch_server), openai_client(plain_server)
    messages = [{"role": "system", "content": system_prompt(words=200, seed=101)}]
    texts, plain_texts, responses = [], [], []
    reset_device_cache(kvbranch_server)
    for step in STEPS:
        messages.append({"role": "user", "content": step})
        kwargs = {
            "model": kvbranch_server.model,
            "messages": messages,
            "temperature": 0,
            "max_tokens": 16,
        }
        response = ours.chat.completions.create(
            **kwargs, prompt_cache_key="oa-agent-1", prompt_cache_retention="24h"
        )
        reference = plain.chat.completions.create(**kwargs)
        responses.append(response)
        texts.append(response.choices[0].message.content)
        plain_texts.append(reference.choices[0].message.content)
        messages.append({"role": "assistant", "content": texts[-1]})
        reset_device_cache(kvbranch_server)
    assert texts == plain_texts
    assert all(split_of(r)["session_id"] == "oa-agent-1" for r in responses)
    turn2 = responses[1]
    cached = turn2.usage.prompt_tokens_details.cached_tokens
    print(f"[dialects] openai turn 2: prompt {turn2.usage.prompt_tokens}, cached {cached}")
    assert cached >= 2 * BLOCK  # vLLM's own number
    assert cached == split_of(turn2)["host_hit_tokens"]  # all of it from the host store
    info = branch(kvbranch_server, "oa-agent-1")
    assert info["requests"] == 2 and info["pinned"]
    assert info["pin_expires_in_s"] > 23 * 3600


def test_openai_completions_and_responses_take_the_key(kvbranch_server):
    ours = openai_client(kvbranch_server)
    prompt = system_prompt(words=150, seed=102) + "\nAnswer:"
    first = ours.completions.create(
        model=kvbranch_server.model,
        prompt=prompt,
        max_tokens=4,
        temperature=0,
        extra_body={"prompt_cache_key": "oa-completions-1", "prompt_cache_retention": "in_memory"},
    )
    assert split_of(first)["session_id"] == "oa-completions-1"
    second = ours.completions.create(
        model=kvbranch_server.model,
        prompt=prompt + " yes",
        max_tokens=4,
        temperature=0,
        extra_body={"prompt_cache_key": "oa-completions-1"},
    )
    assert second.usage.prompt_tokens_details.cached_tokens >= BLOCK
    info = branch(kvbranch_server, "oa-completions-1")
    assert info["requests"] == 2
    assert info["pin_expires_in_s"] is None or info["pin_expires_in_s"] < 3600  # default lease

    # a key that is not an id (an e-mail, a path) gets a digest session
    ours.responses.create(
        model=kvbranch_server.model,
        input="Say hello.",
        max_output_tokens=4,
        temperature=0,
        prompt_cache_key="alice@example.com/run 7",
        prompt_cache_retention="30m",
    )
    with client(kvbranch_server) as c:
        sessions = c.get("/v1/kvbranch/stats").json()["sessions"]
    derived = [s for s in sessions if s["session_id"].startswith("pck-")]
    assert derived and any(
        b["requests"] >= 1 and b["pinned"] and b["pin_expires_in_s"] > 1500
        for s in derived
        for b in s["branches"]
    )


def test_openai_client_header_session(kvbranch_server):
    ours = openai.OpenAI(
        base_url=f"{kvbranch_server.url}/v1",
        api_key=kvbranch_server.api_key or "EMPTY",
        max_retries=0,
        default_headers={"X-Session-ID": "oa-header-1"},
    )
    messages = [
        {"role": "system", "content": system_prompt(words=200, seed=103)},
        {"role": "user", "content": STEPS[0]},
    ]
    first = ours.chat.completions.create(
        model=kvbranch_server.model, messages=messages, temperature=0, max_tokens=8
    )
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": STEPS[1]},
    ]
    reset_device_cache(kvbranch_server)
    second = ours.chat.completions.create(
        model=kvbranch_server.model, messages=messages, temperature=0, max_tokens=8
    )
    assert split_of(second)["session_id"] == "oa-header-1"
    assert split_of(second)["host_hit_tokens"] >= 2 * BLOCK
    assert branch(kvbranch_server, "oa-header-1")["requests"] == 2


@pytest.mark.parametrize("how", ["model_kwargs", "default_headers"])
def test_langchain_chat_openai_gets_session_reuse(kvbranch_server, plain_server, how):
    session = f"lc-{how.replace('_', '-')}"
    hints = (
        {"model_kwargs": {"prompt_cache_key": session}}
        if how == "model_kwargs"
        else {"default_headers": {"X-Session-ID": session}}
    )

    def model(server, **extra) -> ChatOpenAI:
        return ChatOpenAI(
            base_url=f"{server.url}/v1",
            api_key=server.api_key or "EMPTY",
            model=server.model,
            temperature=0,
            max_tokens=16,
            max_retries=0,
            use_responses_api=False,
            **extra,
        )

    ours, plain = model(kvbranch_server, **hints), model(plain_server)
    seed = 104 if how == "model_kwargs" else 105
    messages = [("system", system_prompt(words=200, seed=seed)), ("human", STEPS[0])]
    first, reference = ours.invoke(messages), plain.invoke(messages)
    assert first.content == reference.content
    messages += [("ai", first.content), ("human", STEPS[1])]
    reset_device_cache(kvbranch_server)
    second, reference = ours.invoke(messages), plain.invoke(messages)
    assert second.content == reference.content
    # ChatOpenAI maps vLLM's cached_tokens to cache_read
    assert second.usage_metadata["input_token_details"]["cache_read"] >= 2 * BLOCK
    assert branch(kvbranch_server, session)["requests"] == 2


def test_openai_bad_hints_are_a_clear_400(kvbranch_server):
    ours = openai_client(kvbranch_server)
    bad_hints = [
        ("prompt_cache_retention", {"prompt_cache_retention": "forever"}),
        ("prompt_cache_key", {"extra_body": {"prompt_cache_key": 12}}),
    ]
    for match, hint in bad_hints:
        with pytest.raises(openai.BadRequestError, match=match):
            ours.chat.completions.create(
                model=kvbranch_server.model,
                temperature=0,
                max_tokens=2,
                messages=[{"role": "user", "content": "hi"}],
                **hint,
            )


# --- Anthropic Messages ------------------------------------------------------------------------
# anthropic 2.14's messages.create has no temperature parameter: greedy goes in the body.
GREEDY = {"temperature": 0}


def _usage_total(usage) -> int:
    return (
        usage.input_tokens
        + (usage.cache_read_input_tokens or 0)
        + (usage.cache_creation_input_tokens or 0)
    )


def test_anthropic_system_breakpoint_pins_and_reports_cache_usage(kvbranch_server, plain_server):
    """A breakpoint on the system prompt (ttl 1h): a session derived from that prefix, pinned
    for 1 h; turn 1 reports the prefix as written, turn 2 (another question, device cache
    dropped) reads it back; outputs equal plain vLLM's."""
    ours, plain = anthropic_client(kvbranch_server), anthropic_client(plain_server)
    system = [
        {
            "type": "text",
            "text": system_prompt(words=200, seed=106),
            "cache_control": {"type": "ephemeral", "ttl": "1h"},
        }
    ]
    reset_device_cache(kvbranch_server)
    results = []
    for question in ("Which city is mentioned first?", "Name one tool."):
        kwargs = {
            "model": kvbranch_server.model,
            "max_tokens": 12,
            "extra_body": GREEDY,
            "system": system,
            "messages": [{"role": "user", "content": question}],
        }
        message, reference = ours.messages.create(**kwargs), plain.messages.create(**kwargs)
        assert message.content[0].text == reference.content[0].text
        results.append(message)
        reset_device_cache(kvbranch_server)
    first, second = results
    session = split_of(first)["session_id"]
    assert session.startswith("cc-") and split_of(second)["session_id"] == session
    u1, u2 = first.usage, second.usage
    print(f"[dialects] anthropic system breakpoint: turn 1 {u1.to_dict()}; turn 2 {u2.to_dict()}")
    assert _usage_total(u1) == split_of(first)["prompt_tokens"]
    assert _usage_total(u2) == split_of(second)["prompt_tokens"]
    # (at most a partial block: the opening words all test system prompts share can come back
    # as a stored tail of another test's prompt)
    assert u1.cache_read_input_tokens < BLOCK
    assert u1.cache_creation_input_tokens >= 2 * BLOCK  # the system prefix, in full blocks
    assert u1.cache_creation.ephemeral_1h_input_tokens == u1.cache_creation_input_tokens
    # the question after the breakpoint is input, not written cache
    assert u1.input_tokens > 0
    assert u2.cache_read_input_tokens >= u1.cache_creation_input_tokens
    assert u2.cache_read_input_tokens == split_of(second)["host_hit_tokens"]
    assert u2.cache_creation_input_tokens < BLOCK
    info = branch(kvbranch_server, session)
    assert info["requests"] == 2 and info["pinned"] and info["pin_expires_in_s"] > 3000


def test_anthropic_loop_with_session_header_and_stream(kvbranch_server, plain_server):
    """The agent-loop pattern: a breakpoint on the last message every turn, one conversation
    named by X-Session-ID; the second turn streams and its final usage reads turn 1's KV."""
    ours = anthropic_client(kvbranch_server)
    plain = anthropic_client(plain_server)
    system = system_prompt(words=200, seed=107)
    history: list[dict] = []

    def turn(step: str) -> list[dict]:
        history.append(
            {
                "role": "user",
                "content": [{"type": "text", "text": step, "cache_control": {"type": "ephemeral"}}],
            }
        )
        return [dict(m) for m in history]

    kwargs = {
        "model": kvbranch_server.model,
        "max_tokens": 12,
        "extra_body": GREEDY,
        "system": system,
    }
    first = ours.messages.create(
        **kwargs, messages=turn(STEPS[0]), extra_headers={"X-Session-ID": "anth-loop-1"}
    )
    assert (
        first.content[0].text
        == plain.messages.create(**kwargs, messages=list(history)).content[0].text
    )
    assert split_of(first)["session_id"] == "anth-loop-1"
    history[-1]["content"][0].pop("cache_control")  # only the last message carries it
    history.append({"role": "assistant", "content": first.content[0].text})
    reset_device_cache(kvbranch_server)
    with ours.messages.stream(
        **kwargs, messages=turn(STEPS[1]), extra_headers={"X-Session-ID": "anth-loop-1"}
    ) as stream:
        final = stream.get_final_message()
    assert (
        final.content[0].text
        == plain.messages.create(**kwargs, messages=list(history)).content[0].text
    )
    usage = final.usage
    print(f"[dialects] anthropic loop, streamed turn 2: {usage.to_dict()}")
    # message_start's numbers (the ttl split) and message_delta's agree
    assert usage.cache_creation.ephemeral_5m_input_tokens == usage.cache_creation_input_tokens
    assert usage.cache_read_input_tokens >= 2 * BLOCK
    assert usage.cache_creation_input_tokens is not None
    info = branch(kvbranch_server, "anth-loop-1")
    assert info["requests"] == 2 and info["pinned"] and 0 < info["pin_expires_in_s"] <= 300


def test_anthropic_bad_cache_control_is_a_clear_400(kvbranch_server):
    ours = anthropic_client(kvbranch_server)
    with pytest.raises(anthropic.BadRequestError, match="ttl"):
        ours.messages.create(
            model=kvbranch_server.model,
            max_tokens=2,
            system=[
                {
                    "type": "text",
                    "text": "Be brief.",
                    "cache_control": {"type": "ephemeral", "ttl": "2h"},
                }
            ],
            messages=[{"role": "user", "content": "hi"}],
        )


# --- tenants -------------------------------------------------------------------------------------
KEY_A, KEY_B = DIALECT_KEYS  # the session's keyed server (tests/integration/keyed/server.py)


def test_hints_are_scoped_to_the_tenant(keyed_server):
    """The same prompt_cache_key (and the same breakpoint prefix) under two keys: two
    sessions, each visible only to its own key."""

    def openai_as(key):
        return openai.OpenAI(base_url=f"{keyed_server.url}/v1", api_key=key, max_retries=0)

    for key, text in ((KEY_A, "Hello"), (KEY_B, "Hello"), (KEY_A, "Again")):
        openai_as(key).chat.completions.create(
            model=keyed_server.model,
            messages=[{"role": "user", "content": text}],
            temperature=0,
            max_tokens=2,
            prompt_cache_key="shared-key",
        )
    anthropic_a = anthropic.Anthropic(
        base_url=keyed_server.url,
        api_key="unused",
        default_headers={"Authorization": f"Bearer {KEY_A}"},
        max_retries=0,
    )
    cc = {"type": "ephemeral"}
    anthropic_a.messages.create(
        model=keyed_server.model,
        max_tokens=2,
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Hi", "cache_control": cc}]}
        ],
    )

    def sessions(key) -> dict:
        with httpx.Client(
            base_url=keyed_server.url, timeout=60, headers={"Authorization": f"Bearer {key}"}
        ) as c:
            return {s["session_id"]: s for s in c.get("/v1/kvbranch/stats").json()["sessions"]}

    a, b = sessions(KEY_A), sessions(KEY_B)
    assert a["shared-key"]["branches"][0]["requests"] == 2
    assert b["shared-key"]["branches"][0]["requests"] == 1
    assert any(s.startswith("cc-") for s in a) and not any(s.startswith("cc-") for s in b)
    with httpx.Client(
        base_url=keyed_server.url, timeout=60, headers={"Authorization": f"Bearer {KEY_B}"}
    ) as c:
        assert c.delete("/v1/kvbranch/sessions/shared-key").status_code == 200
    assert sessions(KEY_A)["shared-key"]["branches"][0]["requests"] == 2
