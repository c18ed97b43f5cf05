"""Issue 13 item 7: tenancy turns on however vLLM is given its keys — after ``--`` (passed to
vLLM unchanged) or through ``VLLM_API_KEY`` — not only through the launcher's ``--api-key``."""

from __future__ import annotations

import httpx
import pytest

from tests.integration.helpers import live_sessions
from tests.server_process import ServerProcess

KEY_A, KEY_B = "pass-a-key", "pass-b-key"
ARGS = ["--kv-cache-gib", "0.25", "--host-store-gib", "0.1", "--max-model-len", "2048"]


def _client(server, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=600)


@pytest.fixture(scope="module")
def passthrough_server():
    with ServerProcess(ARGS + ["--", "--api-key", KEY_A, KEY_B], name="keys-passthrough") as s:
        yield s


@pytest.fixture(scope="module")
def env_key_server():
    server = ServerProcess(ARGS, name="keys-env", env={"VLLM_API_KEY": KEY_A})
    server.api_key = KEY_A
    with server:
        yield server


def test_keys_after_double_dash_make_tenants(passthrough_server):
    s = passthrough_server
    with _client(s, KEY_A) as a, _client(s, KEY_B) as b:
        assert a.post("/v1/kvbranch/sessions", json={"session_id": "pt-one"}).status_code == 201
        assert b.get("/v1/kvbranch/sessions/pt-one").status_code == 404
        body = {
            "model": s.model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "session_id": "pt-two",
        }
        assert a.post("/v1/chat/completions", json=body).status_code == 200
        assert b.get("/v1/kvbranch/sessions/pt-two").status_code == 404
        assert a.get("/v1/kvbranch/sessions/pt-two").status_code == 200
    with _client(s, KEY_A) as a:
        before = dict(a.get("/v1/kvbranch/stats").json(), live_sessions=live_sessions(s))
    with _client(s, None) as anonymous:
        assert anonymous.post("/invocations", json=body).status_code == 401
    _nothing_happened(s, before, "pt-two", owners=(KEY_B,))


def _nothing_happened(server, before: dict, session: str, owners: tuple[str, ...]) -> None:
    """Behind a refusal: no engine request (the connector counts every one, whatever its
    route), no new session, and none named ``session`` under any of ``owners``' keys."""
    with _client(server, KEY_A) as a:
        after = a.get("/v1/kvbranch/stats").json()
    assert after["requests"] == before["requests"]
    assert live_sessions(server) == before["live_sessions"]
    for key in owners:
        with _client(server, key) as c:
            assert c.get(f"/v1/kvbranch/sessions/{session}").status_code == 404


def test_vllm_api_key_env_makes_a_tenant(env_key_server):
    s = env_key_server
    body = {
        "model": s.model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "session_id": "env-one",
    }
    with _client(s, KEY_A) as a:
        before = dict(a.get("/v1/kvbranch/stats").json(), live_sessions=live_sessions(s))
    with _client(s, None) as anonymous:
        assert anonymous.post("/v1/chat/completions", json=body).status_code == 401
        # outside vLLM's guarded prefixes the kvbranch guard refuses it too
        assert anonymous.post("/invocations", json=body).status_code == 401
    _nothing_happened(s, before, "env-one", owners=(KEY_A,))
    with _client(s, KEY_A) as a:
        assert a.post("/invocations", json=body).status_code == 200
        assert a.get("/v1/kvbranch/sessions/env-one").status_code == 200
