"""server.plugin.responses_scope: with API keys, vLLM's stored responses are their tenant's
only (GET, cancel, previous_response_id); without keys nothing changes."""

from __future__ import annotations

import json

import pytest

from server.common.env import ENV_API_KEYS
from server.plugin.responses_scope import ResponseOwners, ResponsesScope
from tests.unit.server.plugin.asgi import run_asgi

KEY_A, KEY_B = "key-a", "key-b"


@pytest.fixture
def keys(monkeypatch):
    monkeypatch.setenv(ENV_API_KEYS, f"{KEY_A},{KEY_B}")
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


@pytest.fixture
def no_keys(monkeypatch):
    monkeypatch.delenv(ENV_API_KEYS, raising=False)
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


class FakeVLLM:
    """Stores what each POST /v1/responses asked for under its request_id (as vLLM does)."""

    def __init__(self) -> None:
        self.store: dict[str, dict] = {}
        self.bodies: list[dict] = []
        self.calls: list[tuple[str, str, bytes | None]] = []  # method, path, key

    async def __call__(self, scope, receive, send):
        message = await receive()
        body = json.loads(message["body"]) if message["body"] else {}
        headers = dict(scope["headers"])
        if b"content-length" in headers:
            assert int(headers[b"content-length"]) == len(message["body"])
        self.calls.append((scope["method"], scope["path"], headers.get(b"authorization")))
        self.bodies.append(body)
        if scope["path"] == "/v1/responses":
            rid = body.get("request_id", "resp_vllm_made")
            self.store[rid] = body
            out = {"id": rid, "object": "response"}
        elif scope["path"].startswith("/v1/responses/"):
            rid = scope["path"].split("/")[3]
            out = {"id": rid, "stored": rid in self.store}
        else:
            out = {}
        data = json.dumps(out).encode()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": data})


def call(layer, method: str, path: str, key: str | None, body: dict | None = None):
    raw = json.dumps(body).encode() if body is not None else b""
    headers = [(b"content-length", str(len(raw)).encode())]
    if key:
        headers.append((b"authorization", f"Bearer {key}".encode()))
    scope = {"type": "http", "method": method, "path": path, "headers": headers}
    sent = run_asgi(layer, scope, raw)
    return sent.status, json.loads(sent.body)


def create(layer, key, **body):
    return call(layer, "POST", "/v1/responses", key, {"model": "m", "input": "hi", **body})


def test_another_tenant_gets_404_as_for_an_unknown_id(keys):
    vllm = FakeVLLM()
    layer = ResponsesScope(vllm)
    status, made = create(layer, KEY_A)
    assert status == 200
    rid = made["id"]
    assert rid.startswith("resp_") and rid in vllm.store  # the layer picked the id
    assert call(layer, "GET", f"/v1/responses/{rid}", KEY_A) == (200, {"id": rid, "stored": True})
    status, error = call(layer, "GET", f"/v1/responses/{rid}", KEY_B)
    unknown = call(layer, "GET", "/v1/responses/resp_nobody", KEY_B)
    assert status == 404 and unknown[0] == 404
    assert error == {
        "error": {
            "message": f"Response with id '{rid}' not found.",
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }
    assert call(layer, "POST", f"/v1/responses/{rid}/cancel", KEY_B)[0] == 404
    assert call(layer, "POST", f"/v1/responses/{rid}/cancel", KEY_A)[0] == 200
    # previous_response_id continues only the tenant's own responses
    status, error = create(layer, KEY_B, previous_response_id=rid)
    assert status == 404 and error["error"]["message"] == f"Response with id '{rid}' not found."
    assert create(layer, KEY_A, previous_response_id=rid)[0] == 200
    # none of B's tries reached vLLM
    assert not [c for c in vllm.calls if c[2] == f"Bearer {KEY_B}".encode()]


def test_a_client_chosen_request_id_is_kept_but_not_taken_from_another_tenant(keys):
    vllm = FakeVLLM()
    layer = ResponsesScope(vllm)
    assert create(layer, KEY_A, request_id="resp_mine")[1]["id"] == "resp_mine"
    assert create(layer, KEY_A, request_id="resp_mine")[0] == 200  # the same tenant: its own
    status, error = create(layer, KEY_B, request_id="resp_mine")
    assert status == 409 and error["error"]["param"] == "request_id"
    assert vllm.store["resp_mine"]["model"] == "m" and len(vllm.calls) == 2
    assert call(layer, "GET", "/v1/responses/resp_mine", KEY_B)[0] == 404


def test_without_keys_nothing_changes(no_keys):
    vllm = FakeVLLM()
    layer = ResponsesScope(vllm)
    status, made = create(layer, None)
    assert status == 200 and made["id"] == "resp_vllm_made"  # vLLM picked it: body untouched
    assert "request_id" not in vllm.bodies[0]
    assert call(layer, "GET", "/v1/responses/resp_vllm_made", None)[1]["stored"] is True
    assert call(layer, "GET", "/v1/responses/anything", None)[0] == 200  # vLLM answers
    assert len(layer.owners) == 0


def test_other_paths_pass_through(keys):
    vllm = FakeVLLM()
    layer = ResponsesScope(vllm)
    status, _ = call(layer, "POST", "/v1/responsesX", KEY_A, {})
    assert status == 200 and len(layer.owners) == 0


def test_owners_are_bounded_lru():
    owners = ResponseOwners(cap=3)
    for i in range(3):
        assert owners.claim(f"r{i}", "a")
    assert owners.get("r0") == "a"  # used: now the newest
    owners.claim("r3", "b")
    assert len(owners) == 3 and owners.get("r1") is None  # the least recently used went
    assert owners.get("r0") == "a" and not owners.claim("r3", "a")


def test_a_forgotten_id_is_nobodys(keys):
    vllm = FakeVLLM()
    layer = ResponsesScope(vllm, cap=1)
    first = create(layer, KEY_A)[1]["id"]
    create(layer, KEY_A)
    assert call(layer, "GET", f"/v1/responses/{first}", KEY_A)[0] == 404  # fail closed


def test_the_plugin_installs_it_innermost():
    from fastapi import FastAPI

    from server.plugin import KVBranchPlugin
    from server.plugin.guard import KVBranchGuard
    from server.plugin.middleware import KVBranchMiddleware

    app = FastAPI()
    KVBranchPlugin().attach_router(app)
    order = [m.cls for m in app.user_middleware]  # outermost first
    assert order.index(KVBranchGuard) < order.index(KVBranchMiddleware)
    assert order.index(KVBranchMiddleware) < order.index(ResponsesScope)


def test_through_the_guard_and_the_middleware(keys):
    """The whole stack as installed: the id the layer sets reaches vLLM in the body the
    middleware rewrote (one read of the body, the content-length right)."""
    from server.plugin.guard import KVBranchGuard
    from server.plugin.middleware import KVBranchMiddleware

    vllm = FakeVLLM()
    stack = KVBranchGuard(KVBranchMiddleware(ResponsesScope(vllm)))
    status, made = create(stack, KEY_A)
    assert status == 200 and made["id"].startswith("resp_")
    assert vllm.bodies[0]["request_id"] == made["id"]
    assert "kvbranch_owner" in vllm.bodies[0]["vllm_xargs"]  # the middleware's rewrite is kept
    assert call(stack, "GET", f"/v1/responses/{made['id']}", KEY_B)[0] == 404
    assert call(stack, "GET", f"/v1/responses/{made['id']}", KEY_A)[0] == 200
