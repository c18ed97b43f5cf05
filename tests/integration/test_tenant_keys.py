"""Issue 13 item 7: tenancy turns on however vLLM is given its keys — through ``VLLM_API_KEY``
here, not only through the launcher's ``--api-key``. (Keys after ``--``:
tests/integration/keyed/test_passthrough_keys.py, on the keyed package's server.)"""

from __future__ import annotations

from tests import prestart
from tests.integration.helpers import live_sessions, size_args
from tests.integration.tenant_checks import keyed_client, nothing_happened
from tests.server_process import ServerProcess

KEY_A = "env-a-key"


def _env_key_server() -> tuple[ServerProcess]:
    server = ServerProcess(size_args(0.25, 0.1, 2048), name="keys-env", env={"VLLM_API_KEY": KEY_A})
    server.api_key = KEY_A
    return (server,)


env_key_server = prestart.fixture("env_key_server", _env_key_server, scope="module")


def test_vllm_api_key_env_makes_a_tenant(env_key_server):
    s = env_key_server
    body = {
        "model": s.model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "session_id": "env-one",
    }
    with keyed_client(s, KEY_A) as a:
        before = dict(a.get("/v1/kvbranch/stats").json(), live_sessions=live_sessions(s))
    with keyed_client(s, None) as anonymous:
        assert anonymous.post("/v1/chat/completions", json=body).status_code == 401
        # outside vLLM's guarded prefixes the kvbranch guard refuses it too
        assert anonymous.post("/invocations", json=body).status_code == 401
    nothing_happened(s, KEY_A, before, "env-one", owners=(KEY_A,))
    with keyed_client(s, KEY_A) as a:
        assert a.post("/invocations", json=body).status_code == 200
        assert a.get("/v1/kvbranch/sessions/env-one").status_code == 200
