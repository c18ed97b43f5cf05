"""The router's edge: request bodies are bounded before they are read."""

from __future__ import annotations

import json

import pytest

from sdk.contract import SESSIONS_PATH
from server.router import edge
from tests.unit.server.router.fakes import Fakes, call, make_router


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
