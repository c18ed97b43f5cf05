"""What only the cluster may send an instance, checked by the guard before vLLM sees the body:
transfer params (in the body field or smuggled in the extension args) and hold claims need the
router's proof; dev routes need a key when the server has keys."""

from __future__ import annotations

import json

import pytest

from sdk.contract import HOLD_CLAIM_PATH
from server.common.cluster_auth import ROUTER_PROOF_HEADER, sign
from server.plugin import cluster_gate
from server.plugin.guard import KVBranchGuard
from server.plugin.revive_rules import REVIVE_PATH
from tests.unit.server.plugin.asgi import run_asgi

CHAT = "/v1/chat/completions"
SECRET = b"k" * 32


@pytest.fixture(autouse=True)
def _secret(monkeypatch):
    monkeypatch.setattr(cluster_gate, "_secret", lambda: SECRET)


def _run(path, payload, headers=(), method="POST", keys=None):
    body = json.dumps(payload).encode() if not isinstance(payload, bytes) else payload
    reached = []

    async def app(scope, receive, send):
        reached.append(path)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})

    scope = {
        "type": "http",
        "method": method,
        "path": path,
        "headers": [(k.encode(), v.encode()) for k, v in headers],
    }
    if keys:
        from types import SimpleNamespace

        scope["app"] = SimpleNamespace(state=SimpleNamespace(args=SimpleNamespace(api_key=keys)))
    sent = run_asgi(KVBranchGuard(app), scope, body)
    status, text = sent.status, sent.body.decode()
    return status, text, bool(reached)


def _proof(path, payload):
    return (ROUTER_PROOF_HEADER, sign(SECRET, "POST", path, json.dumps(payload).encode()))


BODY = {"model": "m", "messages": [], "kv_transfer_params": {"do_remote_decode": True}}


def test_client_transfer_params_are_refused_with_a_403_naming_the_field():
    status, text, reached = _run(CHAT, BODY)
    assert status == 403 and not reached
    assert "kv_transfer_params" in text and "router" in text


def test_the_routers_signed_params_pass():
    status, _, reached = _run(CHAT, BODY, [_proof(CHAT, BODY)])
    assert status == 200 and reached


def test_a_proof_for_another_body_or_path_does_not_pass():
    other = dict(BODY, messages=[{"role": "user", "content": "x"}])
    assert _run(CHAT, BODY, [_proof(CHAT, other)])[0] == 403
    assert _run(CHAT, BODY, [_proof("/v1/completions", BODY)])[0] == 403


def test_params_smuggled_in_the_extension_args_are_refused_even_with_a_proof():
    body = {"model": "m", "messages": [], "vllm_xargs": {"kv_transfer_params": {"x": 1}}}
    status, text, reached = _run(CHAT, body, [_proof(CHAT, body)])
    assert status == 403 and not reached and "vllm_xargs.kv_transfer_params" in text
    nested = {"sampling_params": {"extra_args": {"kv_transfer_params": {}}}, "token_ids": [1]}
    assert _run("/inference/v1/generate", nested)[0] == 403


def test_null_params_are_none():
    assert _run(CHAT, dict(BODY, kv_transfer_params=None))[0] == 200


def test_a_hold_claim_needs_the_routers_proof():
    body = {"handle": {"kvbranch_mac": "x"}}
    assert _run(HOLD_CLAIM_PATH, body)[0] == 403
    assert _run(HOLD_CLAIM_PATH, body, [_proof(HOLD_CLAIM_PATH, body)])[0] == 200


def test_a_revive_needs_a_members_proof():
    body = {"session_id": "s1", "branch_id": "main"}
    status, text, reached = _run(REVIVE_PATH, body)
    assert status == 403 and not reached and "replicas" in text
    assert _run(REVIVE_PATH, body, [_proof(HOLD_CLAIM_PATH, body)])[0] == 403
    assert _run(REVIVE_PATH, body, [_proof(REVIVE_PATH, dict(body, session_id="s2"))])[0] == 403
    assert _run(REVIVE_PATH, body, [_proof(REVIVE_PATH, body)])[0] == 200


def test_dev_routes_need_a_key_when_the_server_has_keys():
    assert _run("/reset_prefix_cache", b"", keys=["KA"])[0] == 401
    assert _run("/server_info", b"", method="GET", keys=["KA"])[0] == 401
    ok = _run("/reset_prefix_cache", b"", [("authorization", "Bearer KA")], keys=["KA"])
    assert ok[0] == 200
    assert _run("/reset_prefix_cache", b"")[0] == 200  # no keys: as vLLM


def test_the_dev_path_list_matches_vllms_dev_routers():
    from fastapi import FastAPI
    from vllm.entrypoints.rl.factories import register_rl_api_routers
    from vllm.entrypoints.serve import register_vllm_dev_api_routers

    app = FastAPI()
    register_vllm_dev_api_routers(app)
    register_rl_api_routers(app)
    paths = {getattr(r, "path", "") for r in app.routes} - {"/docs", "/openapi.json", "/redoc"}
    paths = {p for p in paths if p and not p.startswith("/docs")}
    missing = [p for p in paths if not cluster_gate.is_dev_path(p)]
    assert not missing, missing
