"""The router's edge (server.router.edge): what a client sends is refused before any index read
or write and before any leg reaches an instance — checked here on the real router app with fake
instances (pure routing logic); the same probes against the real cluster are in
tests/integration/test_router_edge.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from sdk.contract import CHAT_COMPLETIONS_PATH, SESSIONS_PATH
from server.common.tenants import tenant_id
from server.router import edge
from server.router.app import build_app
from server.router.edge import EdgeState
from tests.unit.server.router.fakes import Fakes, call, make_router
from tests.unit.waiting import until

KA, KB = "key-a", "key-b"
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def keyed(fakes: Fakes, **kw):
    return make_router(fakes, api_keys=[KA, KB], **kw)


def test_without_a_key_nothing_is_read_written_or_sent():
    fakes = Fakes()
    router = keyed(fakes)
    before = asyncio.run(router.index.snapshot(None))
    for headers in ({}, {"authorization": "Bearer nope"}, {"authorization": "Basic a2V5LWE="}):
        r = call(
            router,
            "POST",
            CHAT_COMPLETIONS_PATH,
            json={**CHAT, "session_id": "s" * 100},
            headers=headers,
        )
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"] == "Bearer"
    for path in (SESSIONS_PATH, "/v1/kvbranch/stats", "/v1/models", "/v1/kvbranch/health"):
        assert call(router, "GET" if "sessions" not in path else "POST", path).status_code == 401
    assert fakes.seen == []
    assert asyncio.run(router.index.snapshot(None)) == before
    assert asyncio.run(router.index.begin_turn((tenant_id(KA), "s" * 100, "main"))).turn == 1


def test_with_a_key_the_turn_goes_through_and_is_scoped_to_its_tenant():
    fakes = Fakes()
    fakes.answer["http://p.test:1"] = lambda r: httpx.Response(
        200, json={"kv_transfer_params": {"do_remote_prefill": True}}
    )
    fakes.answer["http://d.test:2"] = lambda r: httpx.Response(200, json={"choices": []})
    router = keyed(fakes)
    r = call(
        router,
        "POST",
        CHAT_COMPLETIONS_PATH,
        json={**CHAT, "session_id": "s1"},
        headers={"authorization": f"Bearer {KB}"},
    )
    assert r.status_code == 200, r.text
    assert [s[0] for s in fakes.seen] == ["http://p.test:1", "http://d.test:2"]
    # the index counted the turn under tenant B, not under anybody else
    assert asyncio.run(router.index.begin_turn((tenant_id(KB), "s1", "main"))).turn == 2


def test_health_and_metrics_need_no_key():
    router = keyed(Fakes())
    assert call(router, "GET", "/health").status_code == 200
    assert call(router, "GET", "/metrics").status_code == 200


BAD_TURNS = [
    ({"session_id": "\ud800"}, {}, "session_id"),
    ({"session_id": "x" * 2_000_000}, {}, "session_id"),
    ({"vllm_xargs": {"kvbranch_branch": "\ud800"}}, {}, "vllm_xargs.kvbranch_branch"),
    ({"vllm_xargs": {"kvbranch_branch": "../x"}}, {}, "vllm_xargs.kvbranch_branch"),
    ({}, {"x-session-id": "a b"}, "X-Session-ID"),
    ({"stream": 1}, {}, "stream"),
    ({"min_tokens": 5, "max_tokens": 2}, {}, "min_tokens"),
    ({"max_tokens": "2"}, {}, "max_tokens"),
    ({"n": 0}, {}, "n"),
]


@pytest.mark.parametrize(("fields", "headers", "param"), BAD_TURNS)
def test_a_bad_turn_is_a_400_naming_the_field_and_reaches_no_instance(fields, headers, param):
    fakes = Fakes()
    router = make_router(fakes)
    before = asyncio.run(router.index.snapshot(None))
    body = json.dumps({**CHAT, **fields}).encode()  # lone surrogates as JSON escapes
    r = call(
        router,
        "POST",
        CHAT_COMPLETIONS_PATH,
        content=body,
        headers={"content-type": "application/json", **headers},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert fakes.seen == []
    assert asyncio.run(router.index.snapshot(None)) == before


@pytest.mark.parametrize(
    "raw_headers",
    [
        [(b"x-session-id", b"\xe9t\xe9")],
        [(b"authorization", b"Bearer \xe9")],
        [(b"authorization", b"Bearer a"), (b"authorization", b"Bearer b")],
    ],
)
def test_a_header_that_is_not_ascii_or_is_repeated_is_a_400(raw_headers):
    fakes = Fakes()
    router = make_router(fakes)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            request = c.build_request("POST", CHAT_COMPLETIONS_PATH, json=CHAT)
            request.headers = httpx.Headers([*request.headers.raw, *raw_headers])
            return await c.send(request)

    r = asyncio.run(go())
    assert r.status_code == 400, r.text
    assert fakes.seen == []


def test_deeply_nested_json_is_a_400():
    fakes = Fakes()
    r = call(
        make_router(fakes),
        "POST",
        CHAT_COMPLETIONS_PATH,
        content=b"[" * 1000 + b"]" * 1000,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
    assert fakes.seen == []


@pytest.mark.parametrize(
    "body", [{"session_id": "\ud800"}, {"session_id": "a/b"}, {"session_id": ["x"]}]
)
def test_a_session_route_with_a_bad_id_is_a_400(body):
    fakes = Fakes()
    r = call(
        make_router(fakes),
        "POST",
        SESSIONS_PATH,
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id"
    assert fakes.seen == []


def test_a_tenant_past_its_share_gets_429_and_others_go_on():
    release = asyncio.Event()
    fakes = Fakes()
    router = keyed(fakes, tenant_inflight=2)

    async def go() -> list[int]:
        async def slow(request: httpx.Request) -> httpx.Response:
            await release.wait()
            return httpx.Response(200, json={"object": "list", "data": []})

        router.client = httpx.AsyncClient(transport=httpx.MockTransport(slow))
        app = build_app(router)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:

            def get(key: str):
                return c.get("/v1/models", headers={"authorization": f"Bearer {key}"})

            held = [asyncio.create_task(get(KA)) for _ in range(2)]
            await until(lambda: router.edge.inflight.get(tenant_id(KA), 0) == 2)
            over = await get(KA)
            other = asyncio.create_task(get(KB))  # tenant B has its own share
            await until(lambda: router.edge.inflight.get(tenant_id(KB), 0) == 1)
            release.set()
            done = await asyncio.gather(*held, other)
            assert over.headers["retry-after"]
            return [over.status_code, *(r.status_code for r in done)]

    assert asyncio.run(go()) == [429, 200, 200, 200]
    assert router.edge.inflight == {} and router.edge.total == 0


def test_the_edge_state_is_bounded_by_the_requests_in_flight():
    """After any number of tenants came and went, the edge keeps nothing of them."""
    from prometheus_client import CollectorRegistry

    from server.common.tenants import KeyTable

    state = EdgeState(KeyTable([]), CollectorRegistry())
    router = make_router(Fakes())
    router.edge = state
    for n in range(50):
        call(router, "GET", "/v1/models", headers={"authorization": f"Bearer k{n}"})
    assert state.inflight == {} and state.total == 0


# Request bodies are bounded before they are read.


@pytest.mark.parametrize("path", ["/v1/chat/completions", SESSIONS_PATH])
def test_a_chunked_body_over_the_bound_is_refused_before_it_is_read(monkeypatch, path):
    monkeypatch.setattr(edge, "MAX_BODY_BYTES", 4096)
    pulled = 0

    async def body():
        nonlocal pulled
        for _ in range(200):  # 100 KiB, no Content-Length
            pulled += 1
            yield b"x" * 512

    fakes = Fakes()
    r = call(make_router(fakes), "POST", path, content=body())
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
    assert pulled <= 10, f"the router read {pulled * 512} bytes of a refused body"
    assert not fakes.seen


def test_a_declared_length_over_the_bound_is_refused(monkeypatch):
    monkeypatch.setattr(edge, "MAX_BODY_BYTES", 4096)
    r = call(
        make_router(Fakes()), "POST", "/v1/chat/completions", content=b"{" + b" " * 5000 + b"}"
    )
    assert r.status_code == 413
    r = call(
        make_router(Fakes()),
        "POST",
        "/v1/chat/completions",
        content=b"{}",
        headers={"content-length": "nope"},
    )
    assert r.status_code == 400


def test_a_body_under_the_bound_still_flows(monkeypatch):
    monkeypatch.setattr(edge, "MAX_BODY_BYTES", 4096)
    fakes = Fakes()
    r = call(make_router(fakes), "POST", SESSIONS_PATH, json={"session_id": "s1"})
    assert r.status_code == 201
    assert {json.loads(c)["session_id"] for _, _, _, c in fakes.seen} == {"s1"}


def test_a_client_that_stops_reading_is_cut_off_and_its_upstream_released():
    from prometheus_client import CollectorRegistry

    from server.common.tenants import KeyTable
    from server.router.edge import Edge

    state = EdgeState(KeyTable([]), CollectorRegistry(), send_timeout_s=0.2)
    released = []

    async def streaming_app(scope, receive, send):  # a relay: writes until told to stop
        try:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            while True:
                await send({"type": "http.response.body", "body": b"x", "more_body": True})
        finally:
            released.append(True)  # the relay's upstream close

    async def never_read(message):
        if message["type"] == "http.response.body":
            await asyncio.Event().wait()  # the client's window stays full

    async def receive():
        return {"type": "http.request", "body": b"", "more_body": False}

    scope = {"type": "http", "path": "/v1/chat/completions", "headers": [], "method": "POST"}
    asyncio.run(asyncio.wait_for(Edge(streaming_app, state)(scope, receive, never_read), 30))
    assert released == [True]
    assert state.slow_clients._value.get() == 1
    assert state.total == 0 and state.inflight == {}
