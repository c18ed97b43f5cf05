"""The plugin's side of the cache-hint dialects (server/dialects/): the guard answers a bad
hint with a 400 naming the field, the middleware's rewrite keeps the pin xarg server-set, the
engine adapter counts a breakpoint prefix through vLLM, and the pin lease and derived sessions
reach the connector's session registry. The dialects' own logic is tested in
tests/unit/server/dialects/; the real clients against the real server in
tests/integration/keyed/test_dialects.py."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

from sdk.contract import INTERNAL_XARGS, PIN_TTL_XARG
from server import dialects
from server.dialects.anthropic import AnthropicUsage
from server.plugin.engine_tokens import VllmEngine
from server.plugin.guard import KVBranchGuard
from server.plugin.middleware import rewrite_request
from tests.unit.server.connector.fakes import BS, make_planner
from tests.unit.server.dialects.bodies import CHAT, MESSAGES, anthropic, chat, conversation
from tests.unit.server.plugin.asgi import run_asgi


def test_a_client_cannot_set_the_pin_xarg_itself():
    assert PIN_TTL_XARG in INTERNAL_XARGS
    payload = chat(vllm_xargs={PIN_TTL_XARG: 86400})
    payload = rewrite_request(payload, tag="t", branch_header=None, owner=None)
    dialects.apply(payload, CHAT)
    assert PIN_TTL_XARG not in payload["vllm_xargs"]


def test_prefix_count_failure_falls_back_to_the_whole_prompt():
    class Handler:
        async def count_tokens(self, request):
            raise RuntimeError("template needs a message")

    class State:
        anthropic_serving_messages = Handler()

    usage = AnthropicUsage(ttl_s=300.0, prefix_request={"messages": []}, model="m")
    assert asyncio.run(usage.prefix_tokens(VllmEngine(State()))) is None


def test_the_engine_counts_a_prefix_through_vllms_count_tokens_and_knows_the_block_size():
    """The plugin's Engine (engine_tokens.py): vLLM's own count_tokens request, once per
    response; the cache's block size cuts an earlier breakpoint's prefix to full blocks."""
    from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest

    seen = []

    class Handler:
        async def count_tokens(self, request):
            seen.append(request)
            return SimpleNamespace(input_tokens=300)

    state = SimpleNamespace(
        anthropic_serving_messages=Handler(),
        vllm_config=SimpleNamespace(cache_config=SimpleNamespace(block_size=128)),
    )
    engine = VllmEngine(state)
    assert engine.block_size == 128 and VllmEngine(None).block_size is None
    prefix = {"system": [{"type": "text", "text": "You are terse."}], "messages": []}
    usage = AnthropicUsage(ttl_s=300.0, prefix_request=prefix, model="m")
    body = {"type": "message", "usage": {"input_tokens": 1000, "output_tokens": 1}}
    assert asyncio.run(usage.rewrite(body, None, engine))
    assert body["usage"]["cache_creation_input_tokens"] == 256  # 300 cut to 2 full blocks
    assert body["usage"]["input_tokens"] == 744
    asyncio.run(usage.rewrite({"usage": {"input_tokens": 1000}}, None, engine))
    (request,) = seen  # counted once per response
    assert isinstance(request, AnthropicCountTokensRequest) and request.model == "m"
    # only the routes whose counting the engine knows
    assert asyncio.run(engine.count_tokens("/v1/chat/completions", {})) is None


# --- the guard answers bad hints with a 400 naming the field ---------------------------------
def _through_guard(path: str, payload: dict) -> tuple[int, dict | None]:
    reached = {}

    async def app(scope, receive, send):
        reached["yes"] = True
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}", "more_body": False})

    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"content-type", b"application/json")],
    }
    sent = run_asgi(KVBranchGuard(app), scope, json.dumps(payload).encode())
    status = sent.status
    return status, (None if reached else json.loads(sent.body))


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


def test_a_conversation_fills_one_registry_slot_not_one_per_turn():
    """The quota symptom, end to end in the connector: 21 turns' derived sessions reach the
    planner as one session, so a tenant quota of 20 is not spent by one conversation."""
    planner, _, registry = make_planner(num_slots=64)
    registry.max_sessions_per_tenant = 20
    for turn, request in enumerate(conversation(21)):
        hints = dialects.apply(request, MESSAGES)
        req = make_request(f"r{turn}", BS + 1, session_id=hints.session_id, extra=None)
        planner.on_new_request(req)
        planner.request_finished(req)
    assert len(registry.sessions) == 1
    registry.create_session("explicit")  # the next explicit create still fits the quota
