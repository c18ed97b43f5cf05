"""Anthropic's cache_control breakpoints (server/dialects/anthropic.py) through the registry:
the derived cc- session (one per conversation), the pin lease, the prefix a breakpoint counts,
bad breakpoints named, and the usage rewrite. Pure logic; the real client against the real
server is in tests/integration/keyed/test_dialects.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from sdk.contract import PIN_TTL_XARG, check_id
from server import dialects
from server.dialects.anthropic import AnthropicUsage, anthropic_usage
from tests.unit.server.dialects.bodies import MESSAGES, anthropic, conversation


def test_no_breakpoint_no_hints():
    payload = anthropic()
    hints = dialects.apply(payload, MESSAGES)
    assert hints.session_id is None and hints.pin_ttl_s is None and hints.usage is None
    assert "vllm_xargs" not in payload


def test_breakpoint_gives_a_session_in_xargs_and_a_pin():
    payload = anthropic()
    payload["messages"][0]["content"][0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    hints = dialects.apply(payload, MESSAGES)
    assert "session_id" not in payload  # /v1/messages has no such field: vllm_xargs carries it
    assert payload["vllm_xargs"]["session_id"] == hints.session_id
    assert hints.session_id.startswith("cc-")
    check_id(hints.session_id)
    assert payload["vllm_xargs"][PIN_TTL_XARG] == 3600.0
    assert hints.usage is not None and hints.usage.prefix_request is None  # whole prompt


def test_the_session_follows_the_prefix_up_to_the_last_breakpoint():
    def with_system_breakpoint(question: str, ttl: str | None = None) -> str:
        payload = anthropic()
        control = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
        payload["system"][0]["cache_control"] = control
        payload["messages"][0]["content"][0]["text"] = question
        return dialects.apply(payload, MESSAGES).session_id

    # the same system prefix: the same session, whatever comes after it or its ttl
    assert (
        with_system_breakpoint("a")
        == with_system_breakpoint("b")
        == with_system_breakpoint("a", "1h")
    )
    other = anthropic(
        system=[{"type": "text", "text": "Other.", "cache_control": {"type": "ephemeral"}}]
    )
    assert dialects.apply(other, MESSAGES).session_id != with_system_breakpoint("a")
    salted = anthropic(cache_salt="s1")
    salted["system"][0]["cache_control"] = {"type": "ephemeral"}
    assert dialects.apply(salted, MESSAGES).session_id != with_system_breakpoint("a")


def test_an_earlier_breakpoint_keeps_the_prefix_to_count():
    payload = anthropic()
    payload["system"][0]["cache_control"] = {"type": "ephemeral"}
    hints = dialects.apply(payload, MESSAGES)
    assert hints.pin_ttl_s == 300.0
    assert hints.usage.prefix_request == {"system": payload["system"], "messages": []}
    payload = anthropic(
        tools=[
            {"name": "a", "input_schema": {}},
            {"name": "b", "input_schema": {}, "cache_control": {"type": "ephemeral"}},
            {"name": "c", "input_schema": {}},
        ]
    )
    assert dialects.apply(payload, MESSAGES).usage.prefix_request == {
        "tools": payload["tools"][:2],
        "messages": [],
    }
    payload = anthropic(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "1", "cache_control": {"type": "ephemeral"}},
                    {"type": "text", "text": "2"},
                ],
            },
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "3"},
        ]
    )
    cut = dialects.apply(payload, MESSAGES).usage.prefix_request
    assert cut["messages"] == [{"role": "user", "content": [payload["messages"][0]["content"][0]]}]


def test_request_level_cache_control_marks_the_whole_prompt():
    payload = anthropic(cache_control={"type": "ephemeral"})
    hints = dialects.apply(payload, MESSAGES)
    assert hints.pin_ttl_s == 300.0 and hints.usage.prefix_request is None


def test_an_explicit_session_header_wins_for_messages():
    payload = anthropic(cache_control={"type": "ephemeral", "ttl": "1h"})
    hints = dialects.apply(payload, MESSAGES, "conv-1")
    assert hints.session_id is None
    assert "session_id" not in payload["vllm_xargs"]
    assert payload["vllm_xargs"][PIN_TTL_XARG] == 3600.0


@pytest.mark.parametrize(
    "control, param",
    [
        ({"type": "persistent"}, "messages[0].content[0].cache_control"),
        ("ephemeral", "messages[0].content[0].cache_control"),
        ({"type": "ephemeral", "ttl": "2h"}, "messages[0].content[0].cache_control.ttl"),
    ],
)
def test_bad_cache_control_is_named(control, param):
    payload = anthropic()
    payload["messages"][0]["content"][0]["cache_control"] = control
    found = dialects.problem(payload, MESSAGES)
    assert found is not None and found[0] == param
    bad_top = dialects.problem(anthropic(cache_control={"type": "ephemeral", "ttl": 5}), MESSAGES)
    assert bad_top is not None and bad_top[0] == "cache_control.ttl"


# --- Anthropic usage -------------------------------------------------------------------------
def vllm_usage(prompt: int, read: int, created: int, output: int = 5) -> dict:
    return {
        "input_tokens": prompt - read - created,
        "output_tokens": output,
        "cache_read_input_tokens": read,
        "cache_creation_input_tokens": created,
    }


def split(prompt: int, device: int, host: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "device_hit_tokens": device,
        "host_hit_tokens": host,
        "remote_hit_tokens": 0,
        "recomputed_tokens": prompt - device - host,
    }


def total(usage: dict) -> int:
    return (
        usage["input_tokens"]
        + usage["cache_read_input_tokens"]
        + usage["cache_creation_input_tokens"]
    )


def test_usage_whole_prompt_breakpoint():
    # turn 1: nothing cached; the breakpoint is on the last block, so all of it is written
    # and nothing is plain input (as with Anthropic), whatever vLLM's mid-run count says
    out = anthropic_usage(
        vllm_usage(300, 0, 256), prefix_tokens=None, split=split(300, 0, 0), ttl_s=300.0
    )
    assert (
        out["cache_read_input_tokens"],
        out["cache_creation_input_tokens"],
        out["input_tokens"],
    ) == (0, 300, 0)
    assert out["cache_creation"] == {
        "ephemeral_5m_input_tokens": 300,
        "ephemeral_1h_input_tokens": 0,
    }
    # turn 2: read from device + host store
    out = anthropic_usage(
        vllm_usage(420, 256, 128), prefix_tokens=None, split=split(420, 128, 128), ttl_s=3600.0
    )
    assert (out["cache_read_input_tokens"], out["cache_creation_input_tokens"]) == (256, 164)
    assert out["cache_creation"]["ephemeral_1h_input_tokens"] == 164
    assert total(out) == 420 and out["output_tokens"] == 5


def test_usage_earlier_breakpoint_writes_only_its_prefix():
    out = anthropic_usage(vllm_usage(1000, 0, 896), prefix_tokens=300, split=None, ttl_s=300.0)
    assert out["cache_creation_input_tokens"] == 300
    assert out["input_tokens"] == 700 and total(out) == 1000
    # the prefix already read: nothing written at it
    out = anthropic_usage(vllm_usage(1000, 512, 384), prefix_tokens=300, split=None, ttl_s=300.0)
    assert out["cache_creation_input_tokens"] == 0 and out["cache_read_input_tokens"] == 512
    # only full blocks are written: the prefix is cut to them
    out = anthropic_usage(
        vllm_usage(1000, 0, 896), prefix_tokens=300, split=None, ttl_s=300.0, block_size=128
    )
    assert out["cache_creation_input_tokens"] == 256 and out["input_tokens"] == 744


def test_usage_without_vllm_cache_fields_uses_the_split():
    out = anthropic_usage(
        {"input_tokens": 300, "output_tokens": 1},
        prefix_tokens=None,
        split=split(300, 128, 0),
        ttl_s=300.0,
    )
    assert out["cache_read_input_tokens"] == 128
    assert out["cache_creation_input_tokens"] == 172 and out["input_tokens"] == 0


def test_stream_start_and_delta_agree_when_vllm_counts_change():
    """vLLM's created_cache_tokens differs between a stream's first and last usage; the
    rewritten numbers depend on the request and its split only."""
    usage = AnthropicUsage(ttl_s=300.0)
    start = {"type": "message_start", "message": {"usage": vllm_usage(678, 636, 42, 1)}}
    delta = {"type": "message_delta", "usage": vllm_usage(678, 636, 4, 12)}
    both = split(678, 0, 636)
    asyncio.run(usage.rewrite(start, both, None))
    asyncio.run(usage.rewrite(delta, both, None))
    first, last = start["message"]["usage"], delta["usage"]
    for key in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        assert first[key] == last[key]
    assert first["cache_creation"] == last["cache_creation"]


def test_rewrite_json_and_sse_events():
    usage = AnthropicUsage(ttl_s=300.0)
    body = {"type": "message", "usage": vllm_usage(300, 0, 256)}
    assert asyncio.run(usage.rewrite(body, split(300, 0, 0), None))
    assert body["usage"]["cache_creation_input_tokens"] == 300
    start = {"type": "message_start", "message": {"usage": vllm_usage(300, 128, 128)}}
    event = b"event: message_start\ndata: " + json.dumps(start).encode()
    out = asyncio.run(usage.rewrite_event(event, split(300, 128, 0), None))
    head, data = out.split(b"\n", 1)
    assert head == b"event: message_start"
    message = json.loads(data[len(b"data: ") :])["message"]
    assert message["usage"]["cache_read_input_tokens"] == 128
    assert "cache_creation" in message["usage"]
    ping = b'event: ping\ndata: {"type": "ping"}'
    assert asyncio.run(usage.rewrite_event(ping, None, None)) == ping


def test_a_conversation_is_one_session_across_its_turns():
    """21 turns with the breakpoint on the newest block: one derived session (before: 21,
    which used up a 20-session tenant quota)."""
    sessions = {dialects.apply(r, MESSAGES).session_id for r in conversation(21)}
    assert len(sessions) == 1
    (session,) = sessions
    assert session.startswith("cc-")
    check_id(session)
    # another conversation (another first message) is another session
    other = {
        dialects.apply(r, MESSAGES).session_id for r in conversation(3, "Plan a trip to Rome.")
    }
    assert len(other) == 1 and other != sessions
    # the system prompt and the model are part of the head too
    changed = conversation(2)[1]
    changed["system"] = [{"type": "text", "text": "You are verbose."}]
    assert dialects.apply(changed, MESSAGES).session_id not in sessions
    assert dialects.apply(dict(conversation(2)[1], model="m2"), MESSAGES).session_id not in sessions
    salted = dict(conversation(2)[1], cache_salt="s")
    assert dialects.apply(salted, MESSAGES).session_id not in sessions


def test_the_head_also_holds_with_a_system_breakpoint_and_a_moving_one():
    turns = conversation(4)
    for r in turns:
        r["system"][0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    assert len({dialects.apply(r, MESSAGES).session_id for r in turns}) == 1
    # the request-level cache_control marks the end: the same head, the same session
    plain = conversation(3)[2]
    top = json.loads(json.dumps(plain))
    top["messages"][-1]["content"][-1].pop("cache_control")
    top["cache_control"] = {"type": "ephemeral"}
    assert dialects.apply(top, MESSAGES).session_id == dialects.apply(plain, MESSAGES).session_id


def test_the_usage_prefix_still_follows_the_last_breakpoint():
    """Only the session name moved to the head: what a breakpoint counts is unchanged."""
    request = conversation(3)[2]
    request["messages"][-1]["content"].append({"type": "text", "text": "tail"})
    hints = dialects.apply(request, MESSAGES)
    assert hints.usage.prefix_request["messages"] == request["messages"][:-1] + [
        {"role": "user", "content": request["messages"][-1]["content"][:1]}
    ]
    assert hints.session_id == dialects.apply(conversation(3)[2], MESSAGES).session_id


def test_a_breakpoint_digest_never_raises_on_a_lone_surrogate():
    request = conversation(1, "broken \ud800 text")[0]
    request["cache_salt"] = "salt\udc00"
    session = dialects.apply(request, MESSAGES).session_id
    assert session is not None
    check_id(session)
    assert session != dialects.apply(conversation(1, "broken  text")[0], MESSAGES).session_id


@pytest.mark.parametrize("ttl", [[1], {}, {"a": 1}, 5])
def test_an_unhashable_ttl_is_a_named_400_not_a_type_error(ttl):
    for where, payload in (
        ("cache_control.ttl", anthropic(cache_control={"type": "ephemeral", "ttl": ttl})),
        ("system[0].cache_control.ttl", anthropic()),
    ):
        payload["system"][0]["cache_control"] = {"type": "ephemeral", "ttl": ttl}
        found = dialects.problem(payload, MESSAGES)
        assert found is not None and found[0] in (where, "system[0].cache_control.ttl")
        assert dialects.apply(payload, MESSAGES).session_id is None
