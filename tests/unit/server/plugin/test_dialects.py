"""Cache-hint dialects (server/plugin/dialects.py): request → session / pin, Anthropic usage.
Pure logic; the real clients against the real server are in tests/integration/test_dialects.py."""

from __future__ import annotations

import asyncio
import json

import pytest

from sdk.contract import (
    INTERNAL_XARGS,
    MAX_TTL_S,
    PIN_TTL_XARG,
    check_id,
)
from server.plugin import dialects
from server.plugin.guard import KVBranchGuard
from server.plugin.middleware import rewrite_request
from tests.unit.server.connector.fakes import BS, make_planner

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


def chat(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def anthropic(**extra) -> dict:
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
    }
    body.update(extra)
    return body


# --- OpenAI ----------------------------------------------------------------------------------
@pytest.mark.parametrize("path", dialects.OPENAI_PATHS)
def test_prompt_cache_key_becomes_the_session(path):
    payload = chat(prompt_cache_key="user-42")
    hints = dialects.apply(payload, path)
    assert payload["session_id"] == "user-42" == hints.session_id
    assert PIN_TTL_XARG not in payload.get("vllm_xargs", {})


def test_a_key_that_is_not_an_id_gets_a_stable_digest_session():
    a, b = (
        chat(prompt_cache_key="alice@example.com/agent 1"),
        chat(prompt_cache_key="alice@example.com/agent 1"),
    )
    dialects.apply(a, CHAT)
    dialects.apply(b, CHAT)
    assert a["session_id"] == b["session_id"]
    assert a["session_id"].startswith("pck-")
    check_id(a["session_id"])
    other = chat(prompt_cache_key="alice@example.com/agent 2")
    dialects.apply(other, CHAT)
    assert other["session_id"] != a["session_id"]


@pytest.mark.parametrize("where", ["body", "header", "xargs"])
def test_an_explicit_session_wins_over_the_key(where):
    payload = chat(prompt_cache_key="k1")
    header = None
    if where == "body":
        payload["session_id"] = "mine"
    elif where == "header":
        header = "mine"
    else:
        payload["vllm_xargs"] = {"session_id": "mine"}
    hints = dialects.apply(payload, CHAT, header)
    assert hints.session_id is None
    assert payload.get("session_id") in (None, "mine")


@pytest.mark.parametrize(
    "value, seconds",
    [
        ("24h", 24 * 3600.0),
        ("30m", 1800.0),
        ("90s", 90.0),
        ("in_memory", None),
        ("in-memory", None),
        ("IN_MEMORY", None),
        (None, None),
    ],
)
def test_retention_becomes_the_pin_lease(value, seconds):
    payload = chat(prompt_cache_key="k", prompt_cache_retention=value)
    hints = dialects.apply(payload, CHAT)
    assert hints.pin_ttl_s == seconds
    assert payload.get("vllm_xargs", {}).get(PIN_TTL_XARG) == seconds


def test_cache_options_ttl_and_the_longer_of_two_hints():
    payload = chat(prompt_cache_options={"mode": "implicit", "ttl": "30m"})
    assert dialects.apply(payload, CHAT).pin_ttl_s == 1800.0
    payload = chat(prompt_cache_options={"ttl": "30m"}, prompt_cache_retention="24h")
    assert dialects.apply(payload, CHAT).pin_ttl_s == MAX_TTL_S


@pytest.mark.parametrize(
    "field, value, param",
    [
        ("prompt_cache_retention", "forever", "prompt_cache_retention"),
        ("prompt_cache_retention", "25h", "prompt_cache_retention"),
        ("prompt_cache_retention", "0m", "prompt_cache_retention"),
        ("prompt_cache_retention", 3600, "prompt_cache_retention"),
        ("prompt_cache_key", 42, "prompt_cache_key"),
        ("prompt_cache_key", "x" * 2000, "prompt_cache_key"),
        ("prompt_cache_options", "30m", "prompt_cache_options"),
        ("prompt_cache_options", {"ttl": "a week"}, "prompt_cache_options.ttl"),
        ("prompt_cache_options", {"mode": "sometimes"}, "prompt_cache_options.mode"),
    ],
)
def test_bad_openai_hints_are_named(field, value, param):
    found = dialects.problem(chat(**{field: value}), CHAT)
    assert found is not None and found[0] == param
    assert param in found[1]
    assert dialects.apply(chat(**{field: value}), CHAT).session_id is None


def test_other_routes_are_untouched():
    payload = chat(prompt_cache_key="k", prompt_cache_retention="forever")
    before = json.loads(json.dumps(payload))
    assert dialects.problem(payload, "/v1/chat/completions/batch") is None
    dialects.apply(payload, "/inference/v1/generate")
    assert payload == before


def test_a_client_cannot_set_the_pin_xarg_itself():
    assert PIN_TTL_XARG in INTERNAL_XARGS
    payload = chat(vllm_xargs={PIN_TTL_XARG: 86400})
    payload = rewrite_request(payload, tag="t", branch_header=None, owner=None)
    dialects.apply(payload, CHAT)
    assert PIN_TTL_XARG not in payload["vllm_xargs"]


# --- Anthropic -------------------------------------------------------------------------------
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
    out = dialects.anthropic_usage(
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
    out = dialects.anthropic_usage(
        vllm_usage(420, 256, 128), prefix_tokens=None, split=split(420, 128, 128), ttl_s=3600.0
    )
    assert (out["cache_read_input_tokens"], out["cache_creation_input_tokens"]) == (256, 164)
    assert out["cache_creation"]["ephemeral_1h_input_tokens"] == 164
    assert total(out) == 420 and out["output_tokens"] == 5


def test_usage_earlier_breakpoint_writes_only_its_prefix():
    out = dialects.anthropic_usage(
        vllm_usage(1000, 0, 896), prefix_tokens=300, split=None, ttl_s=300.0
    )
    assert out["cache_creation_input_tokens"] == 300
    assert out["input_tokens"] == 700 and total(out) == 1000
    # the prefix already read: nothing written at it
    out = dialects.anthropic_usage(
        vllm_usage(1000, 512, 384), prefix_tokens=300, split=None, ttl_s=300.0
    )
    assert out["cache_creation_input_tokens"] == 0 and out["cache_read_input_tokens"] == 512
    # only full blocks are written: the prefix is cut to them
    out = dialects.anthropic_usage(
        vllm_usage(1000, 0, 896), prefix_tokens=300, split=None, ttl_s=300.0, block_size=128
    )
    assert out["cache_creation_input_tokens"] == 256 and out["input_tokens"] == 744


def test_usage_without_vllm_cache_fields_uses_the_split():
    out = dialects.anthropic_usage(
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
    usage = dialects.AnthropicUsage(ttl_s=300.0)
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
    usage = dialects.AnthropicUsage(ttl_s=300.0)
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


def test_prefix_count_failure_falls_back_to_the_whole_prompt():
    class Handler:
        async def count_tokens(self, request):
            raise RuntimeError("template needs a message")

    class State:
        anthropic_serving_messages = Handler()

    usage = dialects.AnthropicUsage(ttl_s=300.0, prefix_request={"messages": []}, model="m")
    assert asyncio.run(usage.prefix_tokens(State())) is None


# --- the guard answers bad hints with a 400 naming the field ---------------------------------
def _through_guard(path: str, payload: dict) -> tuple[int, dict | None]:
    reached = {}

    async def app(scope, receive, send):
        reached["yes"] = True
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    sent: list[dict] = []
    body = json.dumps(payload).encode()

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", b"application/json")],
    }
    asyncio.run(KVBranchGuard(app)(scope, receive, send))
    status = sent[0]["status"]
    return status, (None if reached else json.loads(sent[1]["body"]))


def test_guard_refuses_bad_hints_with_400():
    status, error = _through_guard(CHAT, chat(prompt_cache_retention="forever"))
    assert status == 400 and error["error"]["param"] == "prompt_cache_retention"
    assert "in_memory" in error["error"]["message"]
    bad = anthropic()
    bad["system"][0]["cache_control"] = {"type": "ephemeral", "ttl": "10m"}
    status, error = _through_guard(MESSAGES, bad)
    assert status == 400 and error["error"]["param"] == "system[0].cache_control.ttl"
    status, error = _through_guard(CHAT, chat(prompt_cache_key="ok", prompt_cache_retention="24h"))
    assert status == 200 and error is None


# --- the pin lease reaches the session registry (planner → observe_request) ------------------


def make_request(
    rid: str, n_tokens: int, *, seed: str = "p", session_id=None, extra: dict | None = None
):
    from types import SimpleNamespace

    tokens = [hash((seed, i)) % 30_000 for i in range(n_tokens)]
    return SimpleNamespace(
        request_id=rid,
        all_token_ids=tokens,
        num_prompt_tokens=n_tokens,
        block_hashes=[repr(tokens[: (k + 1) * BS]).encode() for k in range(n_tokens // BS)],
        num_computed_tokens=0,
        session_id=session_id,
        cache_salt=None,
        sampling_params=SimpleNamespace(extra_args=extra),
    )


def test_pin_hint_sets_the_branch_lease_and_degrades_when_too_big():
    planner, _, registry = make_planner(budget_blocks=4)
    req = make_request("r1", 3 * BS + 1, session_id="pck-x", extra={PIN_TTL_XARG: 3600.0})
    req.num_computed_tokens = 3 * BS + 1
    planner.on_new_request(req)
    planner.request_finished(req)
    branch = registry.get_branch("pck-x", "main")
    assert branch.pinned and branch.pin_ttl_s == 3600.0 and len(branch.pinned_hashes) == 3
    # the lease stays with the branch: a later request without a hint renews it as 1 h
    again = make_request("r2", 3 * BS + 1, session_id="pck-x")
    again.num_computed_tokens = 3 * BS + 1
    planner.on_new_request(again)
    planner.request_finished(again)
    assert registry.get_branch("pck-x", "main").pin_ttl_s == 3600.0
    # a branch larger than the whole budget: the hint degrades, the request is served
    big = make_request(
        "r3", 6 * BS + 1, seed="big", session_id="pck-big", extra={PIN_TTL_XARG: 86400.0}
    )
    big.num_computed_tokens = 6 * BS + 1
    planner.on_new_request(big)
    planner.request_finished(big)
    assert registry.get_branch("pck-big", "main").degraded


def test_pin_hint_pins_a_session_without_auto_pin():
    planner, _, registry = make_planner()
    registry.create_session("quiet", auto_pin=False)
    req = make_request("r", 2 * BS + 1, session_id="quiet", extra={PIN_TTL_XARG: 1800.0})
    req.num_computed_tokens = 2 * BS + 1
    planner.on_new_request(req)
    planner.request_finished(req)
    assert registry.get_branch("quiet", "main").pin_ttl_s == 1800.0


# --- issue 22: a conversation is one session, hostile text is a 400 ----------------------------
def _turns(n: int, first: str = "Plan a trip to Paris.") -> list[dict]:
    """An Anthropic conversation of ``n`` turns, each request with its breakpoint on the newest
    block (as Anthropic's SDK examples do), the older ones' cache_control dropped."""
    requests = []
    messages: list[dict] = []
    for turn in range(n):
        text = first if turn == 0 else f"Turn {turn}: and then?"
        if turn:
            messages.append({"role": "assistant", "content": f"Answer {turn - 1}."})
        messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
        for m in messages:
            if isinstance(m["content"], list):
                m["content"] = [
                    {k: v for k, v in b.items() if k != "cache_control"} for b in m["content"]
                ]
        newest = json.loads(json.dumps(messages))
        newest[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        requests.append(anthropic(messages=newest))
    return requests


def test_a_conversation_is_one_session_across_its_turns():
    """21 turns with the breakpoint on the newest block: one derived session (before: 21,
    which used up a 20-session tenant quota)."""
    sessions = {dialects.apply(r, MESSAGES).session_id for r in _turns(21)}
    assert len(sessions) == 1
    (session,) = sessions
    assert session.startswith("cc-")
    check_id(session)
    # another conversation (another first message) is another session
    other = {dialects.apply(r, MESSAGES).session_id for r in _turns(3, "Plan a trip to Rome.")}
    assert len(other) == 1 and other != sessions
    # the system prompt and the model are part of the head too
    changed = _turns(2)[1]
    changed["system"] = [{"type": "text", "text": "You are verbose."}]
    assert dialects.apply(changed, MESSAGES).session_id not in sessions
    assert dialects.apply(dict(_turns(2)[1], model="m2"), MESSAGES).session_id not in sessions
    salted = dict(_turns(2)[1], cache_salt="s")
    assert dialects.apply(salted, MESSAGES).session_id not in sessions


def test_the_head_also_holds_with_a_system_breakpoint_and_a_moving_one():
    turns = _turns(4)
    for r in turns:
        r["system"][0]["cache_control"] = {"type": "ephemeral", "ttl": "1h"}
    assert len({dialects.apply(r, MESSAGES).session_id for r in turns}) == 1
    # the request-level cache_control marks the end: the same head, the same session
    plain = _turns(3)[2]
    top = json.loads(json.dumps(plain))
    top["messages"][-1]["content"][-1].pop("cache_control")
    top["cache_control"] = {"type": "ephemeral"}
    assert dialects.apply(top, MESSAGES).session_id == dialects.apply(plain, MESSAGES).session_id


def test_the_usage_prefix_still_follows_the_last_breakpoint():
    """Only the session name moved to the head: what a breakpoint counts is unchanged."""
    request = _turns(3)[2]
    request["messages"][-1]["content"].append({"type": "text", "text": "tail"})
    hints = dialects.apply(request, MESSAGES)
    assert hints.usage.prefix_request["messages"] == request["messages"][:-1] + [
        {"role": "user", "content": request["messages"][-1]["content"][:1]}
    ]
    assert hints.session_id == dialects.apply(_turns(3)[2], MESSAGES).session_id


def test_a_conversation_fills_one_registry_slot_not_one_per_turn():
    """The quota symptom, end to end in the connector: 21 turns' derived sessions reach the
    planner as one session, so a tenant quota of 20 is not spent by one conversation."""
    planner, _, registry = make_planner(num_slots=64)
    registry.max_sessions_per_tenant = 20
    for turn, request in enumerate(_turns(21)):
        hints = dialects.apply(request, MESSAGES)
        req = make_request(f"r{turn}", BS + 1, session_id=hints.session_id, extra=None)
        planner.on_new_request(req)
        planner.request_finished(req)
    assert len(registry.sessions) == 1
    registry.create_session("explicit")  # the next explicit create still fits the quota


@pytest.mark.parametrize("key", ["\ud800", "ok\udfffok", "a" + "\udc00" * 3])
def test_a_lone_surrogate_cache_key_is_a_named_400_not_a_crash(key):
    found = dialects.problem(chat(prompt_cache_key=key), CHAT)
    assert found is not None and found[0] == "prompt_cache_key"
    assert "surrogate" in found[1]
    found[1].encode("utf-8")  # the message itself is encodable
    assert dialects.apply(chat(prompt_cache_key=key), CHAT).session_id is None


def test_a_breakpoint_digest_never_raises_on_a_lone_surrogate():
    request = _turns(1, "broken \ud800 text")[0]
    request["cache_salt"] = "salt\udc00"
    session = dialects.apply(request, MESSAGES).session_id
    assert session is not None
    check_id(session)
    assert session != dialects.apply(_turns(1, "broken  text")[0], MESSAGES).session_id


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


def test_a_bug_in_the_hints_never_escapes(monkeypatch):
    def broken(*_a, **_k):
        raise KeyError("bug")

    monkeypatch.setattr(dialects, "breakpoints", broken)
    payload = anthropic(cache_control={"type": "ephemeral"})
    assert dialects.problem(payload, MESSAGES) is None
    assert dialects.apply(payload, MESSAGES).session_id is None
