"""Issue 22 against the real server: hostile JSON is a 400 that says what is wrong and keeps
the keep-alive connection usable; an Anthropic conversation is one derived session, not one per
turn (so it cannot spend a tenant's session quota); vLLM's stored responses are their API
key's only.

The keep-alive checks send both requests on ONE ``http.client`` connection and check the
socket is the same: an exception raised in an ASGI layer after the answer makes uvicorn close
the connection, and the second request then fails (``RemoteDisconnected``).
"""

from __future__ import annotations

import http.client
import json
from urllib.parse import urlsplit

import httpx

from tests.integration.keyed.server import HOSTILE_KEYS, MAX_SESSIONS

KEY_A, KEY_B = HOSTILE_KEYS  # the session's keyed server (tests/integration/keyed/server.py)


def _connection(server) -> http.client.HTTPConnection:
    url = urlsplit(server.url)
    return http.client.HTTPConnection(url.hostname, url.port, timeout=600)


def _post(conn, path: str, raw: bytes, headers: dict[str, str]) -> tuple[int, dict]:
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json", **headers})
    response = conn.getresponse()
    data = response.read()
    return response.status, (json.loads(data) if data else {})


def _good_chat(server) -> bytes:
    body = {
        "model": server.model,
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 2,
        "temperature": 0,
    }
    return json.dumps(body).encode()


def _hostile_bodies(server) -> list[tuple[str, bytes, str]]:
    model = json.dumps(server.model).encode()
    chat = b'{"model":' + model + b',"max_tokens":2,"messages":[{"role":"user","content":"hi"}]'
    deep = b"[" * 5000 + b"]" * 5000
    return [
        ("/v1/chat/completions", chat + b',"prompt_cache_key":"\\ud800"}', "surrogate"),
        ("/v1/chat/completions", chat + b',"cache_salt":"salt\\udfff"}', "surrogate"),
        (
            "/v1/messages",
            b'{"model":' + model + b',"max_tokens":2,"messages":[{"role":"user","content":'
            b'[{"type":"text","text":"a\\ud800","cache_control":{"type":"ephemeral"}}]}]}',
            "surrogate",
        ),
        ("/v1/chat/completions", chat + b',"metadata":' + deep + b"}", "nested too deeply"),
        (
            "/v1/chat/completions",
            chat + b',"metadata":' + b"[" * 150 + b"]" * 150 + b"}",
            "nested too deeply",
        ),
        ("/v1/kvbranch/sessions", b'{"session_id":"\\ud800"}', "surrogate"),
        (
            "/v1/chat/completions",
            chat + b',"vllm_xargs":{"session_id":"abc\\n"}}',
            "letters, digits",  # check_id: a trailing newline is not an id
        ),
    ]


def test_hostile_json_is_400_and_the_connection_stays_usable(kvbranch_server):
    server = kvbranch_server
    conn = _connection(server)
    try:
        for path, raw, words in _hostile_bodies(server):
            status, body = _post(conn, path, raw, server.headers())
            assert status == 400, (path, raw[:80], body)
            assert words in body["error"]["message"], body
            sock = conn.sock
            status, body = _post(conn, "/v1/chat/completions", _good_chat(server), server.headers())
            assert status == 200, body
            assert conn.sock is sock, "the server closed the keep-alive connection"
    finally:
        conn.close()


def test_a_trailing_newline_session_id_creates_nothing(kvbranch_server):
    with httpx.Client(base_url=kvbranch_server.url, timeout=600) as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": kvbranch_server.model,
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 1,
                "vllm_xargs": {"session_id": "trailing-nl\n"},
            },
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "vllm_xargs.session_id"
        stats = c.get("/v1/kvbranch/stats")
    assert stats.status_code == 200, stats.text
    assert "trailing-nl\n" not in [s["session_id"] for s in stats.json()["sessions"]]


# --- a keyed server: the quota and the stored responses --------------------------------------
def _client(server, key: str) -> httpx.Client:
    return httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=600
    )


def test_an_anthropic_conversation_does_not_spend_the_session_quota(keyed_server):
    """21 turns, the breakpoint on the newest block each turn (Anthropic's SDK examples):
    before, 21 `cc-` sessions, and the next explicit create was a 429."""
    server = keyed_server
    messages: list[dict] = []
    with _client(server, KEY_A) as c:
        for turn in range(MAX_SESSIONS + 1):
            for m in messages:  # only the newest block carries the breakpoint
                for block in m["content"] if isinstance(m["content"], list) else []:
                    block.pop("cache_control", None)
            messages.append(
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "text",
                            "text": f"Turn {turn}: one word please.",
                            "cache_control": {"type": "ephemeral"},
                        }
                    ],
                }
            )
            r = c.post(
                "/v1/messages",
                json={
                    "model": server.model,
                    "max_tokens": 2,
                    "temperature": 0,
                    "system": "You are terse.",
                    "messages": messages,
                },
            )
            assert r.status_code == 200, (turn, r.text)
            reply = "".join(b.get("text", "") for b in r.json()["content"]) or "ok"
            messages.append({"role": "assistant", "content": reply})
        stats = c.get("/v1/kvbranch/stats")
        assert stats.status_code == 200, stats.text
        derived = [s["session_id"] for s in stats.json()["sessions"]]
        assert len([s for s in derived if s.startswith("cc-")]) == 1, derived
        r = c.post("/v1/kvbranch/sessions", json={"session_id": "after-the-conversation"})
        assert r.status_code == 201, r.text


def test_stored_responses_are_their_tenants(keyed_server):
    server = keyed_server
    body = {"model": server.model, "input": "Say hi.", "max_output_tokens": 4, "store": True}
    with _client(server, KEY_A) as a, _client(server, KEY_B) as b:
        r = a.post("/v1/responses", json=body)
        assert r.status_code == 200, r.text
        rid = r.json()["id"]
        assert a.get(f"/v1/responses/{rid}").status_code == 200
        theirs = b.get(f"/v1/responses/{rid}")
        unknown = b.get("/v1/responses/resp_0123456789abcdef0123456789abcdef")
        assert theirs.status_code == 404 == unknown.status_code, theirs.text
        assert theirs.json()["error"]["message"] == f"Response with id '{rid}' not found."
        assert b.post(f"/v1/responses/{rid}/cancel").status_code == 404
        r = b.post("/v1/responses", json=dict(body, previous_response_id=rid))
        assert r.status_code == 404, r.text
        r = a.post("/v1/responses", json=dict(body, previous_response_id=rid))
        assert r.status_code == 200, r.text
        r = b.post("/v1/responses", json=dict(body, request_id=rid))  # cannot overwrite A's
        assert r.status_code == 409, r.text
        assert a.get(f"/v1/responses/{rid}").json()["id"] == rid
