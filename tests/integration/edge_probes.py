"""The attacker's probes of a router's front door, one suite for every door: the routers in
front of the keyed P/D pair (test_router_edge) and the router in front of aggregated replicas
(test_replicas_edge) answer them alike, because a client cannot tell which one it reached.

Each probe sends its requests and checks the answers: a 4xx that names what is wrong. What a
refusal must leave as it was (engine requests, pulls, holds, Redis keys) differs by topology, so
the calling module wraps each probe in :class:`Unchanged` with its own reading of the cluster.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

import httpx

QUESTION = [{"role": "user", "content": "Name a planet."}]
LONG_PROMPT = " ".join(["word"] * 1500)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Unchanged:
    """A context whose block must leave ``read()`` as it was: what a refused request must not
    touch (read before and after, compared as a whole so the failure shows both)."""

    def __init__(self, read: Callable[[], Any], what: str) -> None:
        self.read = read
        self.what = what

    def __enter__(self) -> Unchanged:
        self.before = self.read()
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            after = self.read()
            assert after == self.before, f"{self.what}: {self.before} -> {after}"


def body(model: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": QUESTION, "temperature": 0, "max_tokens": 8, **extra}


def raw(model: str, fields: str) -> bytes:
    """A chat body with ``fields`` spliced in as raw JSON (lone surrogates as JSON escapes)."""
    head = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}]})
    return (head[:-1] + ', "max_tokens": 2, ' + fields + "}").encode()


def requests_without_a_key_are_401(url: str, model: str, count: int = 400) -> None:
    """``count`` chats with no key or a wrong one, ten with a 2 MB session id, the session and
    stats routes: each a 401 asking for a bearer key; the health check needs none."""
    with httpx.Client(base_url=url, timeout=60) as c:
        for n in range(count):
            r = c.post(
                "/v1/chat/completions",
                json=body(model, session_id=f"s{secrets.token_hex(8)}"),
                headers={} if n % 2 else {"Authorization": "Bearer not-a-key"},
            )
            assert r.status_code == 401, r.text
        huge = body(model, session_id="x" * 2_000_000)
        for _ in range(10):
            r = c.post("/v1/chat/completions", json=huge)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        for method, path in (("POST", "/v1/kvbranch/sessions"), ("GET", "/v1/kvbranch/stats")):
            assert c.request(method, path).status_code == 401
        assert c.get("/health").status_code == 200  # a load balancer's check needs no key


HOSTILE = [
    # (name, path, raw fields, extra headers, expected param; None: a header, named by "ASCII")
    ("session-surrogate", "/v1/chat/completions", '"session_id": "\\ud800"', {}, "session_id"),
    (
        "branch-surrogate",
        "/v1/chat/completions",
        '"session_id": "s1", "vllm_xargs": {"kvbranch_branch": "\\ud800"}',
        {},
        "vllm_xargs.kvbranch_branch",
    ),
    ("stream-not-bool", "/v1/chat/completions", '"stream": 1', {}, "stream"),
    ("session-not-id", "/v1/chat/completions", '"session_id": "../x"', {}, "session_id"),
    ("header-session-byte", "/v1/chat/completions", '"n": 1', {"X-Session-ID": b"\xe9"}, None),
    ("header-auth-byte", "/v1/chat/completions", '"n": 1', {"Authorization": b"Bearer \xe9"}, None),
]
HOSTILE_IDS = [h[0] for h in HOSTILE]


def hostile_request_is_400(
    url: str, model: str, key: str, path: str, fields: str, headers: dict, param: str | None
) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(
            path,
            content=raw(model, fields),
            headers={**bearer(key), "content-type": "application/json", **headers},
        )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    else:
        assert "ASCII" in error["message"], error


def session_route_with_a_lone_surrogate_is_400(url: str, key: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(
            "/v1/kvbranch/sessions",
            content=b'{"session_id": "\\ud800"}',
            headers={**bearer(key), "content-type": "application/json"},
        )
    assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text


def deeply_nested_json_is_400(url: str, key: str) -> None:
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post(
            "/v1/chat/completions",
            content=b"[" * 1000 + b"]" * 1000,
            headers={**bearer(key), "content-type": "application/json"},
        )
    assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"], r.text


def min_over_max_is_400(url: str, model: str, key: str) -> None:
    """min_tokens 5 > max_tokens 2 on a 1.5k-token prompt: refused before any instance
    prefills a token of it."""
    request = {
        "model": model,
        "messages": [{"role": "user", "content": LONG_PROMPT}],
        "max_tokens": 2,
        "min_tokens": 5,
        "session_id": "min-over-max",
    }
    with httpx.Client(base_url=url, timeout=120) as c:
        r = c.post("/v1/chat/completions", json=request, headers=bearer(key))
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens", r.text


#: A client's transfer params, where vLLM would act on them: the field itself (a P/D handle
#: naming a peer to pull from), ``null``, and smuggled in the extension args.
PEER_HANDLE = {
    "do_remote_prefill": True,
    "remote_engine_id": "attacker",
    "remote_host": "127.0.0.1",
    "remote_port": 1,
    "remote_block_ids": [0, 1, 2],
}
TRANSFER_PARAMS = [
    ("handle", {"kv_transfer_params": PEER_HANDLE}, "kv_transfer_params"),
    ("handle-stream", {"kv_transfer_params": PEER_HANDLE, "stream": True}, "kv_transfer_params"),
    ("null", {"kv_transfer_params": None}, "kv_transfer_params"),
    ("in-xargs", {"vllm_xargs": {"kv_transfer_params": "x"}}, "vllm_xargs.kv_transfer_params"),
]
TRANSFER_PARAMS_IDS = [t[0] for t in TRANSFER_PARAMS]


def client_transfer_params_are_400(
    url: str, model: str, key: str, fields: dict[str, Any], param: str
) -> None:
    """Never relayed: an instance acting on a client's params would pull from (or hold for) a
    peer the client names."""
    request = body(model, session_id="s" + secrets.token_hex(8), **fields)
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/chat/completions", json=request, headers=bearer(key))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and param in error["message"], error
