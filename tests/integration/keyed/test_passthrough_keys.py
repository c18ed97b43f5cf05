"""Issue 13 item 7: tenancy turns on however vLLM is given its keys. Here: keys after ``--``
(passed to vLLM unchanged), on the package's keyed server, which gets every key that way
(:mod:`tests.integration.keyed.server`). ``VLLM_API_KEY``: tests/integration/test_tenant_keys.py."""

from __future__ import annotations

from tests.integration.helpers import live_sessions
from tests.integration.keyed.server import PASSTHROUGH_KEYS
from tests.integration.tenant_checks import keyed_client, nothing_happened

KEY_A, KEY_B = PASSTHROUGH_KEYS


def test_keys_after_double_dash_make_tenants(keyed_server):
    s = keyed_server
    with keyed_client(s, KEY_A) as a, keyed_client(s, KEY_B) as b:
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
    with keyed_client(s, KEY_A) as a:
        before = dict(a.get("/v1/kvbranch/stats").json(), live_sessions=live_sessions(s))
    with keyed_client(s, None) as anonymous:
        assert anonymous.post("/invocations", json=body).status_code == 401
    nothing_happened(s, KEY_A, before, "pt-two", owners=(KEY_B,))
