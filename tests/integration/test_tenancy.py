"""Tenant isolation with several API keys: sessions belong to the key that made them, and the
prefix cache (device and host store) is salted per tenant."""

from __future__ import annotations

import httpx
import pytest

from server.process import ServerProcess
from tests.integration.helpers import system_prompt

KEY_A, KEY_B = "tenant-a-key", "tenant-b-key"


@pytest.fixture(scope="module")
def keyed_server():
    args = ["--kv-cache-gib", "0.25", "--host-store-gib", "0.1", "--max-model-len", "2048",
            "--api-key", KEY_A, "--api-key", KEY_B]
    with ServerProcess(args, name="tenancy") as server:
        yield server


def _client(server, key):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=server.url, headers=headers, timeout=600)


def _chat(c, server, messages, session=None):
    body = {"model": server.model, "messages": messages, "temperature": 0, "max_tokens": 2}
    if session:
        body["session_id"] = session
    r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_sessions_are_private_to_their_key(keyed_server):
    with _client(keyed_server, KEY_A) as a, _client(keyed_server, KEY_B) as b, \
            _client(keyed_server, None) as anonymous:
        assert a.post("/v1/kvbranch/sessions", json={"session_id": "t-one"}).status_code == 201
        assert b.get("/v1/kvbranch/sessions/t-one").status_code == 404
        assert b.delete("/v1/kvbranch/sessions/t-one").status_code == 404
        assert b.post("/v1/kvbranch/sessions/t-one/branches/main/pin",
                      json={"ttl_s": 10}).status_code == 404
        # B naming A's session in a chat request is served, but does not touch A's session
        _chat(b, keyed_server, [{"role": "user", "content": "Hello"}], session="t-one")
        assert a.get("/v1/kvbranch/sessions/t-one").json()["branches"][0]["requests"] == 0
        assert [s["session_id"] for s in b.get("/v1/kvbranch/stats").json()["sessions"]] == []
        assert anonymous.get("/v1/kvbranch/stats").status_code == 401
        assert anonymous.post("/v1/chat/completions", json={}).status_code == 401


def test_prefix_cache_is_salted_per_tenant(keyed_server):
    messages = [{"role": "system", "content": system_prompt(words=200, seed=77)},
                {"role": "user", "content": "Hi"}]
    with _client(keyed_server, KEY_A) as a, _client(keyed_server, KEY_B) as b:
        _chat(a, keyed_server, messages)
        again = _chat(a, keyed_server, messages)["kvbranch"]
        other = _chat(b, keyed_server, messages)["kvbranch"]
    assert again["device_hit_tokens"] + again["host_hit_tokens"] >= 128
    assert other["device_hit_tokens"] == 0 and other["host_hit_tokens"] == 0
