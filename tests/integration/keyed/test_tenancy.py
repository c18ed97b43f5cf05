"""Tenant isolation with several API keys: sessions belong to the key that made them, and the
prefix cache (device and host store) is salted per tenant."""

from __future__ import annotations

import json

import httpx

from tests.integration.helpers import live_sessions, system_prompt
from tests.integration.keyed.server import MAX_BRANCHES, MAX_SESSIONS, TENANCY_KEYS

# KEY_C: only the quota test uses it (quotas are per tenant). The server is the session's
# keyed server (tests/integration/keyed/server.py).
KEY_A, KEY_B, KEY_C = TENANCY_KEYS


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
    with (
        _client(keyed_server, KEY_A) as a,
        _client(keyed_server, KEY_B) as b,
        _client(keyed_server, None) as anonymous,
    ):
        assert a.post("/v1/kvbranch/sessions", json={"session_id": "t-one"}).status_code == 201
        assert b.get("/v1/kvbranch/sessions/t-one").status_code == 404
        assert b.delete("/v1/kvbranch/sessions/t-one").status_code == 404
        assert (
            b.post("/v1/kvbranch/sessions/t-one/branches/main/pin", json={"ttl_s": 10}).status_code
            == 404
        )
        # B naming A's session in a chat request is served, and does not touch A's session:
        # sessions are keyed by (key, id), so B's request uses B's own "t-one"
        _chat(b, keyed_server, [{"role": "user", "content": "Hello"}], session="t-one")
        assert a.get("/v1/kvbranch/sessions/t-one").json()["branches"][0]["requests"] == 0
        assert b.get("/v1/kvbranch/sessions/t-one").json()["branches"][0]["requests"] == 1
        assert [s["session_id"] for s in b.get("/v1/kvbranch/stats").json()["sessions"]] == [
            "t-one"
        ]
        assert b.delete("/v1/kvbranch/sessions/t-one").status_code == 200
        assert anonymous.get("/v1/kvbranch/stats").status_code == 401
        assert anonymous.post("/v1/chat/completions", json={}).status_code == 401


def test_prefix_cache_is_salted_per_tenant(keyed_server):
    messages = [
        {"role": "system", "content": system_prompt(words=200, seed=77)},
        {"role": "user", "content": "Hi"},
    ]
    with _client(keyed_server, KEY_A) as a, _client(keyed_server, KEY_B) as b:
        _chat(a, keyed_server, messages)
        again = _chat(a, keyed_server, messages)["kvbranch"]
        other = _chat(b, keyed_server, messages)["kvbranch"]
    assert again["device_hit_tokens"] + again["host_hit_tokens"] >= 128
    # A's prompt is 4+ blocks: a leak would hand B at least one whole block. B may reuse a few
    # tokens of its OWN earlier requests' stored tail (the chat template's opening, token-exact
    # reuse), never a whole block, and A's tail sits behind A's salted blocks.
    assert other["device_hit_tokens"] == 0
    assert other["host_hit_tokens"] < 128


# --- issue 13, Tenants -------------------------------------------------------------------------
def _tenant_id(key: str) -> str:
    """The owner id the server derives from a key (kept stable so tests can forge one)."""
    import hashlib

    return "t_" + hashlib.sha256(b"kvbranch-tenant\0" + key.encode()).hexdigest()[:32]


def _reused(c) -> int:
    """Prompt tokens served from a cache (device or host store) so far, all tenants: the
    connector sees every engine request, whatever route it came from."""
    hits = c.get("/v1/kvbranch/stats").json()["hits_tokens"]
    return hits["device"] + hits["host"]


def _generating_requests(server, text: str, token_ids: list[int]) -> dict[str, dict]:
    """One body per generating route of vLLM 0.32 that this model serves."""
    m = server.model
    user = [{"role": "user", "content": text}]
    return {
        "/v1/chat/completions": {"model": m, "messages": user, "max_tokens": 1, "temperature": 0},
        "/v1/completions": {"model": m, "prompt": text, "max_tokens": 1, "temperature": 0},
        "/v1/chat/completions/batch": {
            "model": m,
            "messages": [user],
            "max_tokens": 1,
            "temperature": 0,
        },
        "/v1/responses": {"model": m, "input": text, "max_output_tokens": 1, "temperature": 0},
        "/v1/messages": {"model": m, "messages": user, "max_tokens": 1, "temperature": 0},
        "/inference/v1/generate": {
            "model": m,
            "token_ids": token_ids,
            "sampling_params": {"max_tokens": 1, "temperature": 0},
        },
        "/invocations": {"model": m, "messages": user, "max_tokens": 1, "temperature": 0},
    }


def _token_ids(c, server, text: str) -> list[int]:
    r = c.post("/tokenize", json={"model": server.model, "prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


def test_client_cache_salt_is_combined_with_the_tenant(keyed_server):
    """Issue 13 item 5: the same client salt under two keys must not share the cache."""
    messages = [
        {"role": "system", "content": system_prompt(words=300, seed=78)},
        {"role": "user", "content": "Hi"},
    ]
    body = {
        "model": keyed_server.model,
        "messages": messages,
        "max_tokens": 1,
        "temperature": 0,
        "cache_salt": "shared-salt",
    }
    with _client(keyed_server, KEY_A) as a, _client(keyed_server, KEY_B) as b:
        for c in (a, a):
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
        assert r.json()["kvbranch"]["device_hit_tokens"] >= 128  # A reuses its own prefix
        r = b.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        split = r.json()["kvbranch"]
    assert split["device_hit_tokens"] == 0 and split["host_hit_tokens"] == 0, split


def test_every_generating_route_is_salted_per_tenant(keyed_server):
    """Issue 13 item 6: A's prompt is cached for A on every route, never for B."""
    with _client(keyed_server, KEY_A) as a, _client(keyed_server, KEY_B) as b:
        for seed, path in enumerate(_generating_requests(keyed_server, "", [1]), start=300):
            text = system_prompt(words=300, seed=seed) + " Answer briefly."
            body = _generating_requests(keyed_server, text, _token_ids(a, keyed_server, text))
            body = body[path]
            r = a.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            before = _reused(a)
            assert a.post(path, json=body).status_code == 200
            assert _reused(a) - before >= 128, f"{path}: A's second request hit nothing"
            before = _reused(a)
            r = b.post(path, json=body)
            assert r.status_code == 200, (path, r.text)
            # A leak hands B whole blocks of A's 300-word prompt; B may reuse part of a block of
            # its OWN earlier tail (the template's opening, token-exact reuse), never a block.
            assert _reused(a) - before < 128, f"{path}: B reused A's cached prompt"


def test_unauthenticated_generating_routes_are_refused(keyed_server):
    """vLLM checks keys only under /v1, /v2, /inference, /cohere: /invocations generates
    outside them, so without the guard anyone could generate (and make sessions) there."""
    with _client(keyed_server, None) as anonymous, _client(keyed_server, KEY_A) as a:
        before = a.get("/v1/kvbranch/stats").json()
        sessions_before = live_sessions(keyed_server)
        body = {
            "model": keyed_server.model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 1,
            "session_id": "anon-1",
        }
        r = anonymous.post("/invocations", json=body)
        assert r.status_code == 401, r.text
        r = anonymous.post("/invocations", json=body, headers={"Authorization": "Bearer not-a-key"})
        assert r.status_code == 401, r.text
        # and nothing happened behind the 401: no engine request (the connector counts every
        # one, whatever its route) and no session, under any key or none
        after = a.get("/v1/kvbranch/stats").json()
        assert after["requests"] == before["requests"]
        assert live_sessions(keyed_server) == sessions_before
        for key in (KEY_A, KEY_B, KEY_C):
            with _client(keyed_server, key) as c:
                assert c.get("/v1/kvbranch/sessions/anon-1").status_code == 404


def test_every_route_makes_sessions_its_key_can_reach(keyed_server):
    """A session named on any generating route belongs to the caller's key."""
    with _client(keyed_server, KEY_A) as a, _client(keyed_server, KEY_B) as b:
        text = "Say hello."
        bodies = _generating_requests(keyed_server, text, _token_ids(a, keyed_server, text))
        for i, (path, body) in enumerate(bodies.items()):
            sid = f"route-{i}"
            headers = {"X-Session-ID": sid}
            r = a.post(path, json=body, headers=headers)
            assert r.status_code == 200, (path, r.text)
            r = a.get(f"/v1/kvbranch/sessions/{sid}")
            assert r.status_code == 200, f"{path}: A cannot reach the session it made: {r.text}"
            assert b.get(f"/v1/kvbranch/sessions/{sid}").status_code == 404


def test_bad_session_ids_are_refused_on_every_route(keyed_server):
    with _client(keyed_server, KEY_A) as a:
        bodies = _generating_requests(keyed_server, "Hi", [1, 2, 3])
        for path, body in bodies.items():
            r = a.post(path, json=body, headers={"X-Session-ID": "../x"})
            assert r.status_code == 400, (path, r.status_code, r.text)
        r = a.post("/v1/responses", json=dict(bodies["/v1/responses"], session_id="a/b"))
        assert r.status_code == 400, r.text


def test_internal_fields_are_stripped_on_every_route(keyed_server):
    """A client cannot set kvbranch's owner, tag or prefetch flag on any route: B forging
    A's owner id must not touch A's session; a forged prefetch flag must not hide a turn."""
    forged = {"kvbranch_owner": _tenant_id(KEY_A), "kvbranch_tag": "forged", "kvbranch_prefetch": 1}
    with _client(keyed_server, KEY_A) as a, _client(keyed_server, KEY_B) as b:
        assert a.post("/v1/kvbranch/sessions", json={"session_id": "victim"}).status_code == 201
        text = "Hello there."
        bodies = _generating_requests(keyed_server, text, _token_ids(b, keyed_server, text))
        for path, body in bodies.items():
            body = json.loads(json.dumps(body))
            if path == "/inference/v1/generate":
                body["sampling_params"]["extra_args"] = dict(forged)
            else:
                body["vllm_xargs"] = dict(forged)
            r = b.post(path, json=body, headers={"X-Session-ID": "victim"})
            assert r.status_code == 200, (path, r.text)
            info = a.get("/v1/kvbranch/sessions/victim").json()
            assert info["branches"][0]["requests"] == 0, f"{path}: B wrote into A's session"
            mine = b.get("/v1/kvbranch/sessions/victim")
            assert mine.status_code == 200, f"{path}: B's turn was hidden: {mine.text}"
            assert b.delete("/v1/kvbranch/sessions/victim").status_code == 200


def test_session_ids_are_per_tenant(keyed_server):
    """Issue 13 item 8: another tenant's id behaves exactly like an id nobody made."""
    with _client(keyed_server, KEY_A) as a, _client(keyed_server, KEY_B) as b:
        assert a.post("/v1/kvbranch/sessions", json={"session_id": "dup-1"}).status_code == 201
        # creating A's id as B: the same answer as a fresh id
        r = b.post("/v1/kvbranch/sessions", json={"session_id": "dup-1"})
        assert r.status_code == 201, r.text
        assert b.post("/v1/kvbranch/sessions", json={"session_id": "fresh-1"}).status_code == 201
        # both exist, each private
        assert a.get("/v1/kvbranch/sessions/dup-1").status_code == 200
        assert b.get("/v1/kvbranch/sessions/dup-1").status_code == 200
        assert b.delete("/v1/kvbranch/sessions/dup-1").status_code == 200
        assert a.get("/v1/kvbranch/sessions/dup-1").status_code == 200
        # reading or forking A's id as B: the same answer as an id nobody made
        assert a.post("/v1/kvbranch/sessions", json={"session_id": "a-only"}).status_code == 201
        for verb, suffix, body in [
            ("get", "", None),
            ("post", "/branches", {}),
            ("get", "/branches", None),
            ("get", "/branches/main", None),
            ("post", "/branches/main/pin", {"ttl_s": 5}),
        ]:
            theirs = b.request(verb.upper(), f"/v1/kvbranch/sessions/a-only{suffix}", json=body)
            nobody = b.request(verb.upper(), f"/v1/kvbranch/sessions/no-such{suffix}", json=body)
            assert theirs.status_code == nobody.status_code == 404, (suffix, theirs.text)
            assert theirs.text.replace("a-only", "X") == nobody.text.replace("no-such", "X")


def test_per_tenant_quotas(keyed_server):
    """Issue 13 item 8: sessions per key (429) and branches per session (409), with a message
    naming the limit; another key is not affected."""
    with _client(keyed_server, KEY_C) as c, _client(keyed_server, KEY_A) as a:
        for i in range(MAX_SESSIONS):
            assert c.post("/v1/kvbranch/sessions", json={"session_id": f"q-{i}"}).status_code == 201
        r = c.post("/v1/kvbranch/sessions", json={"session_id": "q-over"})
        assert r.status_code == 429, r.text
        assert "--max-sessions-per-tenant" in r.json()["error"]["message"]
        assert a.post("/v1/kvbranch/sessions", json={"session_id": "q-over"}).status_code == 201
        for i in range(MAX_BRANCHES - 1):
            r = c.post("/v1/kvbranch/sessions/q-0/branches", json={"branch_id": f"b{i}"})
            assert r.status_code == 201, r.text
        r = c.post("/v1/kvbranch/sessions/q-0/branches", json={"branch_id": "b-over"})
        assert r.status_code == 409, r.text
        assert "--max-branches-per-session" in r.json()["error"]["message"]
        assert c.delete("/v1/kvbranch/sessions/q-1").status_code == 200
        assert c.post("/v1/kvbranch/sessions", json={"session_id": "q-over"}).status_code == 201
