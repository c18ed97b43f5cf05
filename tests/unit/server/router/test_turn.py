"""A completion turn through fake P and D instances: which instance gets what, the route header,
D's params filed for the next turn and taken out of the answer, the claim before a pull, the
fallbacks, the stream relay (usage chunk dropped unless asked for, P's split put in), and the
turn's key from the clients' cache hints (the instance's own session: server/dialects/)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from starlette.requests import Request

from sdk.contract import (
    BRANCH_HEADER,
    HOLD_CLAIM_PATH,
    MESSAGES_PATH,
    RESPONSE_FIELD,
    SESSION_HEADER,
    SESSION_XARG,
    TRANSFER_PARAMS_FIELD,
)
from server import dialects
from server.common.tenants import scope_of
from server.router.app import Router
from server.router.turn import turn_key
from tests.unit.server.dialects.bodies import conversation
from tests.unit.server.router.fakes import (
    D,
    Fakes,
    P,
    base_of,
    call,
    json_reply,
    make_router,
    peek,
    refused,
)

CHAT = "/v1/chat/completions"
FORKS = "/v1/kvbranch/sessions/s1/branches"
ROUTE = "X-KVBranch-Route"
CLAIM = {"handle": "h", "until": 1.0, "until_perf": 1.0, "mac": "m"}
D_PARAMS = {
    "do_remote_decode": True,
    "remote_block_ids": [[3, 4]],
    "remote_num_tokens": 200,
    "remote_host": "d",
}
P_PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_host": "p"}
P_SPLIT = {
    "prompt_tokens": 9,
    "device_hit_tokens": 0,
    "host_hit_tokens": 0,
    "remote_hit_tokens": 0,
    "recomputed_tokens": 9,
}


class _Chunks(httpx.AsyncByteStream):
    """A body that arrives in pieces, cut mid-event (as a real stream may be)."""

    def __init__(self, data: bytes, size: int = 7) -> None:
        self.pieces = [data[i : i + size] for i in range(0, len(data), size)]

    async def __aiter__(self):
        for piece in self.pieces:
            yield piece


def _sse(*chunks: object) -> httpx.AsyncByteStream:
    data = b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks)
    return _Chunks(data + b"data: [DONE]\n\n")


class PD(Fakes):
    """P answers a prefill leg with its transfer params; D answers (JSON or SSE) with its own
    params riding along (the usage chunk on a stream), and claims holds."""

    def __init__(self) -> None:
        super().__init__()
        self.claims: list[dict[str, Any]] = []
        self.claim_status = 200
        self.answer[P] = self._p
        self.answer[D] = self._d

    def bodies(self, base: str) -> list[dict[str, Any]]:
        return [json.loads(c) for b, _, path, c in self.seen if b == base and path == CHAT]

    def _p(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        if body.get("min_tokens", 0) > body.get("max_tokens", 16):  # as vLLM checks it
            return json_reply(
                400, {"error": {"message": "min_tokens must be less than or equal to max_tokens"}}
            )
        if body.get("max_tokens") == 1 and TRANSFER_PARAMS_FIELD in body:
            return json_reply(
                200,
                {
                    "choices": [{"text": "x"}],
                    TRANSFER_PARAMS_FIELD: P_PARAMS,
                    RESPONSE_FIELD: P_SPLIT,
                },
            )
        return json_reply(200, {"choices": [{"message": {"content": "from p"}}]})

    def _d(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == HOLD_CLAIM_PATH:
            self.claims.append(json.loads(request.content))
            if self.claim_status != 200:
                return json_reply(self.claim_status, {"error": {"message": "released"}})
            return json_reply(200, {"kvbranch_claim": CLAIM})
        body = json.loads(request.content)
        d_split = {"prompt_tokens": 9, "from": "d"}
        if body.get("stream"):
            usage = {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11}
            return httpx.Response(
                200,
                headers={"content-type": "text/event-stream"},
                stream=_sse(
                    {"choices": [{"delta": {"content": "hi"}}]},
                    {
                        "choices": [],
                        "usage": usage,
                        TRANSFER_PARAMS_FIELD: D_PARAMS,
                        RESPONSE_FIELD: d_split,
                    },
                ),
            )
        return json_reply(
            200,
            {
                "choices": [{"message": {"content": "from d"}}],
                "usage": {"prompt_tokens": 9},
                TRANSFER_PARAMS_FIELD: D_PARAMS,
                RESPONSE_FIELD: d_split,
            },
        )


def _turn(router, **extra: Any) -> httpx.Response:
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
        "session_id": "s1",
        **extra,
    }
    return call(router, "POST", CHAT, json=body)


KEY = (scope_of(None), "s1", "main")


def split_router(fakes: PD) -> Router:
    """Every turn through P, for the tests of claims and pulls: with the default policy the D
    holding a branch serves its next turn alone while it computes no more prompts than P."""
    return make_router(fakes, policy="always-split")


def test_a_turn_prefills_on_p_decodes_on_d_and_files_ds_params():
    fakes = PD()
    router = make_router(fakes)
    r = _turn(router, max_tokens=20)
    assert r.status_code == 200 and r.headers[ROUTE] == "pd"
    data = r.json()
    assert data["choices"][0]["message"]["content"] == "from d"
    assert TRANSFER_PARAMS_FIELD not in data and data[RESPONSE_FIELD] == P_SPLIT
    (p_body,) = fakes.bodies(P)
    assert p_body["max_tokens"] == 1 and p_body["stream"] is False and p_body["n"] == 1
    assert p_body[TRANSFER_PARAMS_FIELD] == {"do_remote_decode": True}
    (d_body,) = fakes.bodies(D)
    assert d_body["max_tokens"] == 20 and d_body[TRANSFER_PARAMS_FIELD] == P_PARAMS
    held = peek(router, KEY)
    assert held is not None and held.decode_url == D and held.num_tokens == 200
    # The turn's phases, timed: a standard Server-Timing header (route, P's leg, D's leg up to
    # its headers) and the router's histogram of P's leg
    spans = [m.strip().split(";dur=") for m in r.headers["Server-Timing"].split(",")]
    assert [name for name, _ in spans] == ["route", "prefill", "decode"]
    assert all(float(dur) >= 0 for _, dur in spans)
    metrics = call(router, "GET", "/metrics").content
    assert b"kvbranch_router_prefill_leg_seconds_count 1.0" in metrics


def test_the_next_turn_claims_ds_hold_and_p_pulls_it():
    fakes = PD()
    router = split_router(fakes)
    _turn(router)
    r = _turn(router)
    assert r.status_code == 200 and r.headers[ROUTE] == "pd+pull"
    assert fakes.claims == [{"handle": D_PARAMS}]
    pulled = fakes.bodies(P)[1][TRANSFER_PARAMS_FIELD]
    assert pulled == dict(
        D_PARAMS, do_remote_decode=True, do_remote_prefill=False, kvbranch_claim=CLAIM
    )


def test_the_d_holding_a_branch_serves_its_turn_alone_unless_it_computes_more_prompts():
    """A resumed turn goes to the D that holds its branch, alone (no P leg, no claim, no pull),
    unless that D is computing more prompts than the P the turn would take has requests; D
    holds the new turn for the next. D's decode legs are not prompts. Not with
    ``always-split``; a new branch always through P."""
    fakes = PD()
    router = make_router(fakes)
    _turn(router)  # a new branch: P then D
    decode, prefill = router.pool.decodes[0], router.pool.prefills[0]
    decode.inflight = 3  # three answers decoding on D, none computing a prompt
    r = _turn(router)
    assert r.status_code == 200 and r.headers[ROUTE] == "decode-local"
    assert fakes.claims == [] and len(fakes.bodies(P)) == 1
    d_body = fakes.bodies(D)[1]
    assert d_body[TRANSFER_PARAMS_FIELD] == {"do_remote_prefill": False}
    held = peek(router, KEY)
    assert held is not None and held.decode_url == D
    assert decode.prefilling == 0 and decode.inflight == 3  # the turn's count ended with it
    # D computing a prompt of its own while P computes none: the turn is split (P pulls D's hold)
    decode.prefilling = 1
    assert _turn(router).headers[ROUTE] == "pd+pull"
    # ... and local again once P is as busy
    prefill.inflight = 1
    assert _turn(router).headers[ROUTE] == "decode-local"
    # always-split: every turn through P
    split = make_router(PD(), policy="always-split")
    _turn(split)
    split.pool.prefills[0].inflight = 1
    assert _turn(split).headers[ROUTE] == "pd+pull"


def test_no_prompt_stays_counted_after_its_turn():
    """``Instance.prefilling`` (what the decode-local rule reads) is back to zero once the
    turns are done, streamed or not, split or local: a count left behind would send every
    later turn of every session through P."""
    fakes = PD()
    router = make_router(fakes)
    _turn(router, stream=True)
    r = _turn(router, stream=True)
    assert r.status_code == 200 and r.headers[ROUTE] == "decode-local"
    assert [i.prefilling for i in router.pool.all] == [0, 0]
    assert [i.inflight for i in router.pool.all] == [0, 0]


def test_a_d_that_fails_a_turn_it_serves_alone_hands_it_to_p():
    """The D holding the branch is unreachable or answers 5xx before anything reached the
    client: the turn is not lost, P serves it."""
    for failure in ("unreachable", "500"):
        fakes = PD()
        router = make_router(fakes)
        _turn(router)
        d_answer = fakes.answer[D]
        if failure == "unreachable":
            fakes.answer[D] = refused
        else:
            fakes.answer[D] = lambda r, d=d_answer: (
                json_reply(500, {"error": {"message": "boom"}}) if r.url.path == CHAT else d(r)
            )
        r = _turn(router)
        assert r.status_code == 200, failure
        assert r.headers[ROUTE] == "prefill-only", failure
        assert r.json()["choices"][0]["message"]["content"] == "from p"


def test_a_forks_first_turn_is_offered_its_parents_hold():
    """A fork's new branch is offered its parent's hold, for what is left of it: its first turn
    pulls the parent's history from the D holding it (or is served there alone) instead of
    recomputing it on P. The parent keeps its own hold; a fork of a branch with no live hold
    gets none; a fork the instances refused shares nothing."""
    fakes = PD()
    router = split_router(fakes)
    _turn(router)  # main: held on D
    parent = peek(router, KEY)
    assert parent is not None
    r = call(router, "POST", FORKS, json={"parent": "main", "branch_id": "alt"})
    assert r.status_code < 300
    alt = (scope_of(None), "s1", "alt")
    shared = peek(router, alt)
    assert shared is not None and (shared.decode_url, shared.turn) == (D, 0)
    assert shared.params == parent.params and shared.expires_in_s <= parent.expires_in_s
    assert peek(router, KEY) is not None  # the parent's own hold stays
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "session_id": "s1"}
    r = call(router, "POST", CHAT, json=body, headers={BRANCH_HEADER: "alt"})
    assert r.status_code == 200 and r.headers[ROUTE] == "pd+pull"
    assert fakes.claims == [{"handle": D_PARAMS}]
    # a fork of a branch with no hold, and a fork the instances refused: nothing offered
    call(router, "POST", FORKS, json={"parent": "nothing-held", "branch_id": "b2"})
    assert peek(router, (scope_of(None), "s1", "b2")) is None
    fakes.answer[D] = lambda r: json_reply(404, {"error": {"message": "no branch 'main'"}})
    call(router, "POST", FORKS, json={"parent": "main", "branch_id": "b3"})
    assert peek(router, (scope_of(None), "s1", "b3")) is None


def test_a_hold_d_released_is_not_pulled():
    fakes = PD()
    router = split_router(fakes)
    _turn(router)
    fakes.claim_status = 410
    r = _turn(router)
    assert r.status_code == 200 and r.headers[ROUTE] == "pd"
    assert fakes.bodies(P)[1][TRANSFER_PARAMS_FIELD] == {"do_remote_decode": True}
    assert b"kvbranch_router_claims_refused_total 1.0" in call(router, "GET", "/metrics").content


def test_a_claim_that_is_not_a_claim_is_not_pulled_with():
    fakes = PD()
    router = split_router(fakes)
    _turn(router)
    bad = fakes.answer[D]

    def no_mac(request: httpx.Request) -> httpx.Response:
        if request.url.path == HOLD_CLAIM_PATH:
            return json_reply(200, {"kvbranch_claim": {"handle": "h", "until": 1.0}})
        return bad(request)

    fakes.answer[D] = no_mac
    r = _turn(router)
    assert r.status_code == 200 and r.headers[ROUTE] == "pd"
    assert fakes.bodies(P)[1][TRANSFER_PARAMS_FIELD] == {"do_remote_decode": True}


@pytest.mark.parametrize("want_usage", [False, True])
def test_a_stream_files_ds_params_and_shows_only_what_the_client_asked_for(want_usage):
    fakes = PD()
    router = make_router(fakes)
    extra: dict[str, Any] = {"stream": True}
    if want_usage:
        extra["stream_options"] = {"include_usage": True}
    r = _turn(router, **extra)
    assert r.status_code == 200 and r.headers[ROUTE] == "pd"
    assert TRANSFER_PARAMS_FIELD.encode() not in r.content
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]" and b'"hi"' in events[0]
    usage = [json.loads(e[6:]) for e in events if b'"usage"' in e]
    if want_usage:
        (chunk,) = usage
        assert chunk[RESPONSE_FIELD] == P_SPLIT and chunk["usage"]["completion_tokens"] == 2
    else:
        assert usage == []
    assert fakes.bodies(D)[0]["stream_options"] == {"include_usage": True}
    assert peek(router, KEY) is not None


def test_p_down_means_d_computes_the_prompt_and_holds_it():
    fakes = PD()

    def handler(request: httpx.Request) -> httpx.Response:
        if base_of(request) == P:
            raise httpx.ConnectError("refused", request=request)
        return fakes(request)

    router = make_router(handler)
    r = _turn(router)
    assert r.status_code == 200 and r.headers[ROUTE] == "decode-only"
    assert fakes.bodies(D)[0][TRANSFER_PARAMS_FIELD] == {"do_remote_prefill": False}
    assert peek(router, KEY) is not None


def test_d_failing_mid_turn_means_p_serves_it():
    fakes = PD()
    fakes.answer[D] = lambda r: json_reply(500, {"error": {"message": "engine died"}})
    r = _turn(make_router(fakes))
    assert r.status_code == 200 and r.headers[ROUTE] == "prefill-only"
    assert r.json()["choices"][0]["message"]["content"] == "from p"
    assert TRANSFER_PARAMS_FIELD not in fakes.bodies(P)[1]


def test_the_clients_own_error_on_p_comes_back_as_is():
    fakes = PD()
    fakes.answer[P] = lambda r: json_reply(400, {"error": {"message": "bad temperature"}})
    r = _turn(make_router(fakes))
    assert r.status_code == 400 and r.json()["error"]["message"] == "bad temperature"
    assert not fakes.bodies(D)


def test_transfer_params_from_a_client_are_refused():
    fakes = PD()
    r = _turn(make_router(fakes), kv_transfer_params={"do_remote_decode": True})
    assert r.status_code == 400 and "kv_transfer_params" in r.json()["error"]["message"]
    r = _turn(make_router(fakes), vllm_xargs={"kv_transfer_params": "x"})  # smuggled
    assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.kv_transfer_params"
    assert not fakes.seen


def test_no_instance_up_is_a_503_with_retry_after():
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    r = _turn(make_router(down))
    assert r.status_code == 503 and r.headers["retry-after"] == "5"


# --- an unreachable instance: the same leg on another one; a failing one: ejected -------------
P2, D2 = "http://p2.test:3", "http://d2.test:4"


def _unreachable(fakes: PD, *bases: str):
    """Health answers, completions cannot connect (a proxy in front of a dead engine)."""

    def handler(request: httpx.Request) -> httpx.Response:
        if base_of(request) in bases and request.url.path == CHAT:
            raise httpx.ConnectError("refused", request=request)
        return fakes(request)

    return handler


def test_an_unreachable_prefill_leg_goes_to_another_prefill():
    fakes = PD()
    fakes.answer[P2] = fakes.answer[P]
    router = make_router(_unreachable(fakes, P), prefills=[P, P2])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}
    r = call(router, "POST", CHAT, json=body)  # no session: the least busy P, the first one
    assert r.status_code == 200 and r.headers[ROUTE] == "pd"
    assert len(fakes.bodies(P2)) == 1 and fakes.bodies(P2)[0]["max_tokens"] == 1
    assert not router.pool.prefills[0].alive
    metrics = call(router, "GET", "/metrics").content
    assert b'kvbranch_router_retries_total{role="prefill"} 1.0' in metrics


def test_a_prefill_that_answered_5xx_is_not_retried_elsewhere():
    fakes = PD()
    fakes.answer[P] = lambda r: json_reply(500, {"error": {"message": "engine died"}})
    fakes.answer[P2] = lambda r: pytest.fail("a request P may have run was sent again")
    router = make_router(fakes, prefills=[P, P2])
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    r = call(router, "POST", CHAT, json=body)
    assert r.status_code == 200 and r.headers[ROUTE] == "decode-only"


def test_a_stream_goes_to_another_decode_as_the_client_asked_for_it():
    fakes = PD()
    fakes.answer[D2] = fakes.answer[D]

    def handler(request: httpx.Request) -> httpx.Response:
        if base_of(request) == P:
            raise httpx.ConnectError("refused", request=request)
        return _unreachable(fakes, D)(request)

    router = make_router(handler, decodes=[D, D2])
    r = _turn(router, stream=True)
    assert r.status_code == 200 and r.headers[ROUTE] == "decode-only"
    assert b'"usage"' not in r.content  # the retry did not inherit the router's own usage ask
    assert len(fakes.bodies(D2)) == 1
    held = peek(router, KEY)
    assert held is not None and held.decode_url == D2


def test_a_prefill_failing_every_turn_is_left_out_then_tried_again(monkeypatch):
    from server.router import pool as pool_mod

    fakes = PD()
    fakes.answer[P] = lambda r: json_reply(500, {"error": {"message": "engine died"}})
    router = split_router(fakes)
    for _ in range(pool_mod.EJECT_AFTER_FAILURES):
        assert _turn(router).headers[ROUTE] == "decode-only"
    assert len([s for s in fakes.seen if s[0] == P]) == pool_mod.EJECT_AFTER_FAILURES
    r = _turn(router)
    assert r.status_code == 200 and r.headers[ROUTE] == "decode-only"
    assert len([s for s in fakes.seen if s[0] == P]) == pool_mod.EJECT_AFTER_FAILURES, "P tried"
    router.pool.prefills[0].ejected_until = 0.0  # the ejection is over; P works again
    router.pool.prefills[0].checked_at = 0.0
    fakes.answer[P] = PD()._p
    assert _turn(router).headers[ROUTE] == "pd+pull"  # D held the decode-only turns


def test_min_tokens_does_not_turn_the_prefill_leg_into_a_400():
    """vLLM refuses min_tokens > max_tokens; the prefill leg runs with max_tokens=1 (found by
    reading vllm-router, which clamps it too)."""
    fakes = PD()
    r = _turn(make_router(fakes), max_tokens=20, min_tokens=5)
    assert r.status_code == 200 and r.headers[ROUTE] == "pd", r.text
    assert fakes.bodies(P)[0]["min_tokens"] == 1
    assert fakes.bodies(D)[0]["min_tokens"] == 5 and fakes.bodies(D)[0]["max_tokens"] == 20


def test_a_streamed_turn_ds_own_4xx_comes_back_as_is():
    fakes = PD()
    d = fakes.answer[D]
    fakes.answer[D] = lambda r: (
        json_reply(400, {"error": {"message": "bad logit_bias"}}) if r.url.path == CHAT else d(r)
    )
    r = _turn(make_router(fakes), stream=True)
    assert r.status_code == 400 and r.json()["error"]["message"] == "bad logit_bias"
    assert r.headers[ROUTE] == "pd"


# --- the turn's key from the clients' cache hints (server/dialects/) ---------------------------
def _hinted_turn(router, headers: dict[str, str] | None = None, **extra: Any) -> httpx.Response:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}
    return call(router, "POST", CHAT, json=body, headers=headers or {})


@pytest.mark.parametrize("cache_key", ["agent-42", "alice@example.com/agent 1"])
def test_a_prompt_cache_key_turn_is_held_and_pulled_under_the_instances_session(cache_key):
    """No session_id: the router keys the turn by the session the instance derives from
    prompt_cache_key (the key itself when it is an id, else pck-<digest>), so D's hold is
    filed and the next turn pulls it."""
    fakes = PD()
    router = split_router(fakes)
    instance_body = {"prompt_cache_key": cache_key}
    dialects.apply(instance_body, CHAT)  # what the instance does with the same body
    session = instance_body["session_id"]
    assert session == cache_key or session.startswith("pck-")
    r = _hinted_turn(router, prompt_cache_key=cache_key)
    assert r.status_code == 200 and r.headers[ROUTE] == "pd"
    assert peek(router, (scope_of(None), session, "main")) is not None
    r = _hinted_turn(router, prompt_cache_key=cache_key)
    assert r.headers[ROUTE] == "pd+pull" and fakes.claims == [{"handle": D_PARAMS}]
    # the body goes on as the client sent it: the instance derives the session itself
    assert all(b["prompt_cache_key"] == cache_key for b in fakes.bodies(P) + fakes.bodies(D))
    assert all("session_id" not in b for b in fakes.bodies(P) + fakes.bodies(D))


def test_a_prompt_cache_key_is_scoped_to_the_key_and_an_explicit_session_wins():
    fakes = PD()
    router = make_router(fakes)
    auth = {"Authorization": "Bearer sk-a"}
    _hinted_turn(router, auth, prompt_cache_key="agent-42")
    assert peek(router, (scope_of("Bearer sk-a"), "agent-42", "main")) is not None
    assert peek(router, (scope_of(None), "agent-42", "main")) is None
    _hinted_turn(router, prompt_cache_key="agent-42", session_id="s1")
    assert peek(router, KEY) is not None
    _hinted_turn(router, {SESSION_HEADER: "h1"}, prompt_cache_key="k2")
    assert peek(router, (scope_of(None), "h1", "main")) is not None
    assert peek(router, (scope_of(None), "k2", "main")) is None
    # a bad hint (the instance answers it with a 400): no derived key, nothing held
    fakes.answer[P] = lambda r: json_reply(400, {"error": {"message": "bad hint"}})
    r = _hinted_turn(router, prompt_cache_key="k3", prompt_cache_retention="forever")
    assert r.status_code == 400 and peek(router, (scope_of(None), "k3", "main")) is None


def _request(path: str, headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": path, "headers": raw})


def test_an_anthropic_messages_turn_is_keyed_by_its_breakpoint_session():
    """The key of a /v1/messages turn with cache_control breakpoints is the instance's cc-
    session, the same for every turn of the conversation (the router does not route
    /v1/messages yet: this is the key it will use)."""
    keys = set()
    for request in conversation(3):
        key = turn_key(request, _request(MESSAGES_PATH, {BRANCH_HEADER: "b2"}))
        dialects.apply(request, MESSAGES_PATH)  # the instance's session for the same body
        assert key == (scope_of(None), request["vllm_xargs"][SESSION_XARG], "b2")
        keys.add(key)
    (key,) = keys
    assert key[1].startswith("cc-")
    auth = {"Authorization": "Bearer sk-a"}
    assert turn_key(conversation(1)[0], _request(MESSAGES_PATH, auth)) == (
        scope_of("Bearer sk-a"),
        key[1],
        "main",
    )
    # an explicit session wins; a body session_id is not one on /v1/messages
    first = conversation(1)[0]
    assert turn_key(first, _request(MESSAGES_PATH, {SESSION_HEADER: "conv-1"}))[1] == "conv-1"
    assert turn_key(dict(first, session_id="x"), _request(MESSAGES_PATH, {}))[1] == key[1]
    no_breakpoint = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    assert turn_key(no_breakpoint, _request(MESSAGES_PATH, {})) is None


class _Broken(httpx.AsyncByteStream):
    """A stream whose instance goes away after ``data`` (no [DONE]); ``error``: the connection
    breaks instead of closing cleanly."""

    def __init__(self, data: bytes, error: bool) -> None:
        self.data = data
        self.error = error

    async def __aiter__(self):
        yield self.data
        if self.error:
            raise httpx.RemoteProtocolError("peer closed connection without sending complete body")


@pytest.mark.parametrize("error", [False, True])
def test_a_stream_cut_short_ends_with_an_error_event_not_a_clean_end(error):
    """D's engine died mid-answer (the soak saw it): the client must not take the cut answer
    for a short complete one."""
    fakes = PD()
    first = b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'

    def d(request: httpx.Request) -> httpx.Response:
        if request.url.path == HOLD_CLAIM_PATH:
            return fakes._d(request)
        return httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_Broken(first, error)
        )

    fakes.answer[D] = d
    r = _turn(make_router(fakes), stream=True)
    events = [e for e in r.content.split(b"\n\n") if e]
    assert events[0] == first.strip()
    last = json.loads(events[-1][len(b"data: ") :])
    assert last["error"]["code"] == 502 and "incomplete" in last["error"]["message"]
    assert b"data: [DONE]" not in r.content


def test_a_complete_stream_gets_no_error_event():
    r = _turn(make_router(PD()), stream=True)
    assert b'"error"' not in r.content and r.content.rstrip().endswith(b"data: [DONE]")
