"""A replica's own port answers a hostile header as the router's edge does, before vLLM's key
check: the gate runs as vLLM's ``--middleware`` (added after vLLM's own, so outermost).

Real parts: vLLM's ``AuthenticationMiddleware`` and its order of ``add_middleware`` calls (the
endpoint plugins' layers first, then vLLM's, then ``--middleware``), on a FastAPI app over
httpx's ASGI transport."""

from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI
from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

from server.checks.headers import header_problem
from server.launcher.settings import HEADER_GATE
from server.plugin.header_gate import HeaderGate

KEY = "sk-test"


def app(gate: bool = True) -> FastAPI:
    api = FastAPI()

    @api.post("/v1/chat/completions")
    async def chat() -> dict:
        return {"ok": True}

    api.add_middleware(AuthenticationMiddleware, tokens=[KEY])  # vLLM's, after the plugins'
    if gate:
        api.add_middleware(HeaderGate)  # --middleware: last added, outermost
    return api


async def post(api: FastAPI, headers: list[tuple[bytes, bytes]]) -> httpx.Response:
    transport = httpx.ASGITransport(app=api)
    async with httpx.AsyncClient(transport=transport, base_url="http://replica") as client:
        request = client.build_request("POST", "/v1/chat/completions", json={})
        request.headers = httpx.Headers([*request.headers.raw, *headers])
        return await client.send(request)


def test_the_launcher_names_the_gate():
    assert HEADER_GATE == f"{HeaderGate.__module__}.{HeaderGate.__qualname__}"


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ([(b"authorization", b"Bearer \xe9")], "authorization"),
        ([(b"x-session-id", b"\xe9")], "x-session-id"),
        ([(b"authorization", f"Bearer {KEY}".encode())] * 2, "authorization"),
    ],
    ids=["key-not-ascii", "session-not-ascii", "key-twice"],
)
async def test_a_hostile_header_is_the_routers_400_before_vllms_key_check(headers, named):
    response = await post(app(), headers)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == named
    assert (named, error["message"]) == header_problem(headers)  # the router's own words


async def test_a_good_request_passes_and_vllms_key_check_still_applies():
    assert (await post(app(), [(b"authorization", f"Bearer {KEY}".encode())])).status_code == 200
    assert (await post(app(), [(b"authorization", b"Bearer wrong")])).status_code == 401


async def test_without_the_gate_vllm_answers_a_key_that_is_not_ascii_with_a_bare_401():
    """What the gate is for (the planted bug: no gate)."""
    response = await post(app(gate=False), [(b"authorization", b"Bearer \xe9")])
    assert response.status_code == 401
