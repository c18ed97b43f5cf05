"""The router as a door: it forwards only the session routes it knows (dot segments, encoded
or not, and the hold claim are 404 and reach no instance), refuses repeated identity headers,
signs the legs that carry transfer params (and only those), and releases an upstream stream
however the client leaves."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from sdk.contract import HOLD_CLAIM_PATH
from server.common.cluster_auth import ROUTER_PROOF_HEADER, verify
from server.router import relay
from server.router.admin import SESSION_ROUTES, known_route
from tests.unit.server.router.fakes import D, Fakes, P, call, json_reply, make_router

SECRET = b"r" * 32


@pytest.mark.parametrize(
    "path",
    [
        "/v1/kvbranch/../../metrics",
        "/v1/kvbranch/%2e%2e/%2e%2e/metrics",
        "/v1/kvbranch/..%2f..%2fmetrics",
        "/v1/kvbranch/../chat/completions",
        "/v1/kvbranch/sessions/../../metrics",
        "/v1/kvbranch/sessions/s1/branches/%2e%2e",
        "/v1/kvbranch/holds/claim",
        "/v1/kvbranch/holds/revive",
        "/v1/kvbranch/sessions/s1/anything",
        "/v1/kvbranch/sessions//branches",
    ],
)
@pytest.mark.parametrize("method", ["GET", "POST", "DELETE"])
def test_unknown_and_traversing_paths_are_404_and_reach_no_instance(path, method):
    fakes = Fakes()
    status, body = _raw(make_router(fakes, secret=SECRET), method, path)
    assert status == 404, body
    assert "no kvbranch route" in json.loads(body)["error"]["message"]
    assert fakes.seen == []


def _raw(router, method: str, raw_path: str) -> tuple[int, bytes]:
    """Drive the app with the path exactly as a raw HTTP client sends it (httpx would remove
    the dot segments before sending); ``path`` decoded as uvicorn decodes it."""
    from urllib.parse import unquote

    from server.router.app import build_app

    app = build_app(router)
    out: list[dict] = []

    async def go() -> None:
        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(message):
            out.append(message)

        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": unquote(raw_path),
            "raw_path": raw_path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"host", b"router"), (b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("router", 80),
        }
        await app(scope, receive, send)

    asyncio.run(go())
    return out[0]["status"], b"".join(m.get("body", b"") for m in out[1:])


def test_known_routes_are_the_plugins_routes():
    from server.plugin.routes import router as plugin_routes

    theirs = set()
    for route in plugin_routes.routes:
        shape = route.path.removeprefix("/v1/kvbranch/")
        shape = shape.replace("{session_id}", "{id}").replace("{branch_id}", "{id}")
        for method in route.methods:
            if shape not in ("health", "stats"):  # the router serves those itself
                theirs.add((method, shape))
    assert theirs == set(SESSION_ROUTES)
    assert known_route("GET", "sessions/a.b:c-1/branches/main")
    assert not known_route("GET", "sessions/a\n/branches/main")


def test_query_strings_are_not_forwarded():
    fakes = Fakes()
    fakes.answer[P] = lambda r: json_reply(200, {"query": str(r.url.query)})
    r = call(make_router(fakes, secret=SECRET), "GET", "/v1/kvbranch/sessions/s1?x=../../y")
    assert r.status_code == 200 and fakes.seen[0][2] == "/v1/kvbranch/sessions/s1"
    assert r.json()["query"] in ("", "b''")


@pytest.mark.parametrize("name", ["Authorization", "X-Session-ID", "X-KVBranch-Branch"])
def test_a_repeated_identity_header_is_a_400(name):
    fakes = Fakes()
    router = make_router(fakes, secret=SECRET)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    headers = [(name, "a"), (name, "b")]
    r = call(router, "POST", "/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 400 and name.lower() in r.json()["error"]["message"]
    r = call(router, "GET", "/v1/kvbranch/sessions/s1", headers=headers)
    assert r.status_code == 400
    assert fakes.seen == []


def test_legs_with_transfer_params_carry_the_routers_proof_and_others_do_not():
    seen: list[httpx.Request] = []
    p_params = {"do_remote_prefill": True, "remote_block_ids": [[1]]}

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        body = json.loads(request.content)
        if request.url.path == HOLD_CLAIM_PATH:
            return json_reply(200, {"kvbranch_claim": {"handle": "h"}})
        if body.get("max_tokens") == 1:
            return json_reply(200, {"kv_transfer_params": p_params, "choices": []})
        return json_reply(200, {"choices": [], "usage": {}})

    fakes = Fakes()
    fakes.answer[P] = fakes.answer[D] = answer
    router = make_router(fakes, secret=SECRET)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    r = call(router, "POST", "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert len(seen) == 2
    for request in seen:
        proof = request.headers.get(ROUTER_PROOF_HEADER)
        assert verify(SECRET, proof, "POST", request.url.path, request.content)
    # a session-less turn served by one instance (D down) carries no params and no proof
    fakes.answer[D] = lambda r: (_ for _ in ()).throw(httpx.ConnectError("down", request=r))
    seen.clear()
    r = call(router, "POST", "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    single = [q for q in seen if q.url.path == "/v1/chat/completions"][-1]
    assert ROUTER_PROOF_HEADER not in single.headers


def test_an_upstream_stream_is_closed_when_the_client_leaves_before_the_first_event():
    closed: list[str] = []

    class _Stream(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b"data: {}\n\n"

        async def aclose(self) -> None:
            closed.append("upstream")

    resp = httpx.Response(200, stream=_Stream())
    response = relay.relay_stream(
        resp, lambda p: None, None, True, lambda: closed.append("done"), {}
    )

    async def go() -> None:
        async def receive():
            return {"type": "http.disconnect"}

        async def send(message):
            raise OSError("client gone")

        with pytest.raises(Exception):  # noqa: B017 - Starlette's ClientDisconnect or OSError
            await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)

    asyncio.run(go())
    assert closed.count("done") == 1 and "upstream" in closed
