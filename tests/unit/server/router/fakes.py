"""Fake instances for the router's unit tests (httpx's MockTransport): pure routing logic only.
Real P/D instances behind the real router are in tests/integration/test_pd.py and
test_router_lifecycle.py."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx

from sdk.contract import HEALTH_PATH
from server.index import Hold
from server.router.app import Router, build_app

P, D = "http://p.test:1", "http://d.test:2"
Handler = Callable[[httpx.Request], httpx.Response]


def json_reply(status: int, data: object) -> httpx.Response:
    return httpx.Response(status, json=data)


def err(status: int, message: str) -> httpx.Response:
    return json_reply(status, {"error": {"message": message, "code": status}})


def refused(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=request)


def base_of(request: httpx.Request) -> str:
    return f"{request.url.scheme}://{request.url.host}:{request.url.port}"


class Fakes:
    """Two fake instances; ``answer[url]`` decides what a request (other than health) gets."""

    def __init__(self) -> None:
        self.answer: dict[str, Handler] = {
            P: lambda r: json_reply(201, {"from": "p"}),
            D: lambda r: json_reply(201, {"from": "d"}),
        }
        self.seen: list[tuple[str, str, str, bytes]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = base_of(request)
        if request.url.path == HEALTH_PATH:
            return json_reply(200, {"instance_id": base})
        self.seen.append((base, request.method, request.url.path, request.content))
        return self.answer[base](request)


def make_router(fakes: Handler, ttl: float = 60.0, **kw: Any) -> Router:
    router = Router(kw.pop("prefills", [P]), kw.pop("decodes", [D]), hold_ttl_s=ttl, **kw)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(fakes))
    return router


def call(router: Router, method: str, path: str, **kw: Any) -> httpx.Response:
    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as c:
            return await c.request(method, path, **kw)

    return asyncio.run(go())


def put(router: Router, key: tuple[str, str, str], url: str, iid: str | None, params: dict) -> None:
    """File a hold in the router's index as a D's answer would (the next turn's number)."""

    async def go() -> None:
        turn = (await router.index.begin_turn(key)).turn
        await router.index.put_hold(key, Hold(url, iid, params, turn=turn))

    asyncio.run(go())


def peek(router: Router, key: tuple[str, str, str]) -> Hold | None:
    return asyncio.run(router.index.peek_hold(key))
