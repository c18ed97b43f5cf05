"""The router's own logic with fake instances (httpx's MockTransport): request bodies bounded
before they are read, the cluster index bounded (timer sweep, size cap), and session fan-out
that reports partial failure and converges on retry. Real P/D instances behind the real router
are in tests/integration/test_pd.py and test_router_lifecycle.py."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Callable

import httpx
import pytest
from starlette.testclient import TestClient

import server.router.app as app_mod
from server.contract import HEALTH_PATH, SESSIONS_PATH, session_path
from server.router.app import Router, build_app
from server.router.index import ClusterIndex

P, D = "http://p.test:1", "http://d.test:2"
Handler = Callable[[httpx.Request], httpx.Response]


def _json(status: int, data: object) -> httpx.Response:
    return httpx.Response(status, json=data)


def _err(status: int, message: str) -> httpx.Response:
    return _json(status, {"error": {"message": message, "code": status}})


def _refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


class Fakes:
    """Two fake instances; ``answer[url]`` decides what a session route gets."""

    def __init__(self) -> None:
        self.answer: dict[str, Handler] = {P: lambda r: _json(201, {"from": "p"}),
                                           D: lambda r: _json(201, {"from": "d"})}
        self.seen: list[tuple[str, str, str, bytes]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if request.url.path == HEALTH_PATH:
            return _json(200, {"instance_id": base})
        self.seen.append((base, request.method, request.url.path, request.content))
        return self.answer[base](request)


def _router(fakes: Fakes, ttl: float = 60.0) -> Router:
    router = Router([P], [D], hold_ttl_s=ttl)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(fakes))
    return router


def _call(router: Router, method: str, path: str, **kw) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return await c.request(method, path, **kw)
    return asyncio.run(go())


# --- bodies bounded before they are read ---------------------------------------------------
@pytest.mark.parametrize("path", ["/v1/chat/completions", SESSIONS_PATH])
def test_a_chunked_body_over_the_bound_is_refused_before_it_is_read(monkeypatch, path):
    monkeypatch.setattr(app_mod, "MAX_BODY_BYTES", 4096)
    pulled = 0

    async def body():
        nonlocal pulled
        for _ in range(200):  # 100 KiB, no Content-Length
            pulled += 1
            yield b"x" * 512

    fakes = Fakes()
    r = _call(_router(fakes), "POST", path, content=body())
    assert r.status_code == 413 and "4096" in r.json()["error"]["message"]
    assert pulled <= 10, f"the router read {pulled * 512} bytes of a refused body"
    assert not fakes.seen


def test_a_declared_length_over_the_bound_is_refused(monkeypatch):
    monkeypatch.setattr(app_mod, "MAX_BODY_BYTES", 4096)
    r = _call(_router(Fakes()), "POST", "/v1/chat/completions", content=b"{" + b" " * 5000 + b"}")
    assert r.status_code == 413
    r = _call(_router(Fakes()), "POST", "/v1/chat/completions", content=b"{}",
              headers={"content-length": "nope"})
    assert r.status_code == 400


def test_a_body_under_the_bound_still_flows(monkeypatch):
    monkeypatch.setattr(app_mod, "MAX_BODY_BYTES", 4096)
    fakes = Fakes()
    r = _call(_router(fakes), "POST", SESSIONS_PATH, json={"session_id": "s1"})
    assert r.status_code == 201
    assert {json.loads(c)["session_id"] for _, _, _, c in fakes.seen} == {"s1"}


# --- the cluster index: capped, swept on a timer ----------------------------------------------
def test_index_cap_evicts_the_oldest_entry():
    index = ClusterIndex(ttl_s=60, max_entries=3)
    for i in range(3):
        index.put(("t", f"s{i}", "main"), D, "x", {"remote_num_tokens": i})
    index.put(("t", "s0", "main"), D, "x", {"remote_num_tokens": 9})  # s0 is now the youngest
    index.put(("t", "s3", "main"), D, "x", {"remote_num_tokens": 3})
    assert len(index) == 3
    assert index.peek(("t", "s1", "main")) is None  # the oldest went
    assert index.peek(("t", "s0", "main")).num_tokens == 9
    assert index.counters()["evicted"] == 1
    with pytest.raises(ValueError):
        ClusterIndex(ttl_s=1, max_entries=0)


def test_index_sweep_counts_what_it_dropped():
    index = ClusterIndex(ttl_s=0.01)
    index.put(("t", "a", "main"), D, "x", {})
    index.put(("t", "b", "main"), D, "x", {})
    time.sleep(0.03)
    assert index.sweep() == 2 and len(index) == 0 and index.counters()["expired"] == 2


def test_the_app_sweeps_the_index_on_a_timer_without_any_read():
    router = _router(Fakes(), ttl=0.05)
    with TestClient(build_app(router)):
        router.index.put(("t", "s", "main"), D, "x", {"remote_num_tokens": 5})
        deadline = time.monotonic() + 5
        while router.index.counters()["entries"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert router.index.counters()["entries"] == 0, "expired entry never swept"


# --- session fan-out -----------------------------------------------------------------------
def test_a_create_reaches_every_instance_with_one_id():
    fakes = Fakes()
    r = _call(_router(fakes), "POST", SESSIONS_PATH, json={})
    assert r.status_code == 201
    ids = {json.loads(c)["session_id"] for _, _, _, c in fakes.seen}
    assert len(ids) == 1 and {b for b, *_ in fakes.seen} == {P, D}


@pytest.mark.parametrize("decode", [_refused, lambda r: _err(500, "engine died"),
                                    lambda r: _err(409, "too many sessions (8)")])
def test_a_partial_failure_is_a_502_naming_the_instance(decode):
    fakes = Fakes()
    fakes.answer[D] = decode
    r = _call(_router(fakes), "POST", SESSIONS_PATH, json={})
    assert r.status_code == 502, r.text
    data = r.json()
    by_role = {i["role"]: i for i in data["instances"]}
    assert by_role["prefill"]["ok"] and by_role["prefill"]["status"] == 201
    assert not by_role["decode"]["ok"] and by_role["decode"]["url"] == D
    assert by_role["decode"]["status"] in (None, 500, 409) and by_role["decode"]["error"]
    assert D in data["error"]["message"]
    # the id the router chose comes back, so the client's retry converges on it
    sent = {json.loads(c)["session_id"] for _, _, _, c in fakes.seen}
    assert data["session_id"] in sent


def test_a_retried_create_converges_where_one_instance_already_has_it():
    fakes = Fakes()
    fakes.answer[P] = lambda r: _err(409, "session 's1' already exists")
    r = _call(_router(fakes), "POST", SESSIONS_PATH, json={"session_id": "s1"})
    assert r.status_code == 201 and r.json() == {"from": "d"}
    fakes.answer[D] = fakes.answer[P]  # everywhere already: the plain 409 one instance gives
    r = _call(_router(fakes), "POST", SESSIONS_PATH, json={"session_id": "s1"})
    assert r.status_code == 409


def test_a_retried_fork_converges_too():
    fakes = Fakes()
    fakes.answer[D] = lambda r: _err(409, "branch 'b' already exists in session 's1'")
    r = _call(_router(fakes), "POST", "/v1/kvbranch/sessions/s1/branches",
              json={"parent": "main", "branch_id": "b"})
    assert r.status_code == 201 and r.json() == {"from": "p"}


def test_a_retried_delete_converges_and_drops_the_index_entries():
    fakes = Fakes()
    fakes.answer[P] = lambda r: _err(404, "no session 's1'")
    fakes.answer[D] = lambda r: _json(200, {"deleted": True})
    router = _router(fakes)
    key = (app_mod.tenant_of(None), "s1", "main")
    router.index.put(key, D, "x", {"remote_num_tokens": 3})
    r = _call(router, "DELETE", session_path("s1"))
    assert r.status_code == 200 and r.json() == {"deleted": True}
    assert router.index.peek(key) is None
    fakes.answer[D] = fakes.answer[P]
    assert _call(router, "DELETE", session_path("s1")).status_code == 404


def test_the_clients_own_error_passes_through_as_is():
    fakes = Fakes()
    fakes.answer[P] = fakes.answer[D] = lambda r: _err(400, "pin_ttl_s must be positive")
    r = _call(_router(fakes), "POST", SESSIONS_PATH, json={"pin_ttl_s": -1})
    assert r.status_code == 400 and "pin_ttl_s" in r.json()["error"]["message"]


def test_a_read_falls_over_to_a_prefill_that_answers():
    fakes = Fakes()
    router = Router([P, "http://p2.test:3"], [D], hold_ttl_s=60)
    fakes.answer["http://p2.test:3"] = lambda r: _json(200, {"session_id": "s1"})

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p.test" and request.url.path != HEALTH_PATH:
            raise httpx.ConnectError("refused", request=request)
        return fakes(request)

    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    r = _call(router, "GET", session_path("s1"))
    assert r.status_code == 200 and r.json() == {"session_id": "s1"}
