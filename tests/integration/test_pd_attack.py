"""The attacker's suite against a real P/D cluster with two API keys (issue 22): a tenant who can
reach P, D and the router on their ports and sends nothing but HTTP.

Every case ends in the plain server's answer, a 4xx that says what is wrong, or a recompute —
never a 5xx, never a hang — and the instance it hit still answers right afterwards:

* a tenant's own transfer params straight at P or D (the P leg's handle with the seal removed and
  an internal marker added, ``_remote_blocks_processed``, a non-ASCII seal, params smuggled in
  the extension args): 403 without the router's proof; and even with it (a buggy or
  compromised router), the connector checks every handle whatever it carries: declined, the
  request recomputes, D's engine stays up;
* hold claims straight at D: 403; through the router: 404;
* traversal through the router (dot segments, encoded or not): 404, nothing reaches an instance;
* vLLM's dev routes without a key: 401;
* repeated identity headers: 400; a slow client cannot hold the router's door open.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest

from sdk.contract import HOLD_CLAIM_PATH
from server.connector.pd.transfer_auth import CLAIM_FIELD, MAC_FIELD
from tests.integration.helpers import chat, client, pd_activity, system_prompt, text_of
from tests.integration.trust_cluster import KEY_B, ROUTER_HEADER_TIMEOUT_S, as_router

SYSTEM = system_prompt(words=120, seed=21)
KEY_B_HEADERS = {"Authorization": f"Bearer {KEY_B}"}
#: How long past the router's header deadline a slow client waits for the router to close its
#: connection: slack for a loaded machine, and far short of the default 30 s, so that a router
#: which ignores its ``--header-timeout-s`` fails the test.
CLOSE_SLACK_S = 10.0


@pytest.fixture(scope="module")
def pd(keyed_pd):
    return keyed_pd


def _messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


def _body(server, messages, max_tokens=16, **extra) -> dict:
    return {
        "model": server.model,
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        **extra,
    }


def _post(server, body, *, signed=False, headers=None, timeout=180.0) -> httpx.Response:
    with httpx.Client(
        base_url=server.url,
        timeout=timeout,
        headers={**server.headers(), **(headers or {})},
        auth=as_router() if signed else None,
    ) as c:
        return c.post("/v1/chat/completions", json=body)


def _p_handle(prefill, messages, headers=None) -> dict:
    """P's handle for ``messages`` (made as the router makes it)."""
    r = _post(
        prefill,
        _body(prefill, messages, 1, kv_transfer_params={"do_remote_decode": True}),
        signed=True,
        headers=headers,
    )
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params.get("do_remote_prefill") and params.get("remote_block_ids"), params
    return params


def _declined(server) -> int:
    with client(server) as c:
        stats = c.get("/v1/kvbranch/stats").json()
    return sum((stats.get("pd") or {}).get("handles_declined", {}).values())


def _still_right(server, plain_server) -> None:
    """The instance answers, and answers right."""
    messages = _messages("Name a planet.")
    assert text_of(chat(server, messages, max_tokens=8)) == text_of(
        chat(plain_server, messages, max_tokens=8)
    )


def _forged_variants(handle: dict) -> list[dict]:
    """The attacks seen on main: the seal removed and an internal marker added (the checks
    were skipped), and a seal that made the scheduler hook raise."""
    unsealed = {k: v for k, v in handle.items() if k not in (MAC_FIELD, CLAIM_FIELD)}
    return [
        dict(unsealed, kvbranch_verified=1),
        dict(unsealed, _remote_blocks_processed=True),
        dict(unsealed, kvbranch_verified=47, _remote_blocks_processed=True),
        dict(handle, **{MAC_FIELD: "é" * 64}),
        dict(handle, **{MAC_FIELD: "\u2603"}),
    ]


def test_a_tenants_own_handle_straight_at_d_is_refused(pd, plain_server):
    prefill, decode, router = pd
    other = _messages("Name a color.")
    handle = _p_handle(prefill, _messages("Name a fruit."), headers=KEY_B_HEADERS)
    for params in _forged_variants(handle):
        r = _post(decode, _body(decode, other, kv_transfer_params=params), headers=KEY_B_HEADERS)
        assert r.status_code == 403, r.text
        assert "router" in r.json()["error"]["message"]
    _still_right(decode, plain_server)


def test_marker_carrying_handles_are_checked_even_from_the_router(pd, plain_server):
    """Signed as the router signs (the client's dict reached the connector): every check runs
    whatever the dict carries; D computes the other prompt itself, its answer is plain's."""
    prefill, decode, router = pd
    other = _messages("Name a color.")
    expected = text_of(chat(plain_server, other, max_tokens=16))
    declined = _declined(decode)
    variants = _forged_variants(_p_handle(prefill, _messages("Name a fruit.")))
    for params in variants:
        started = time.monotonic()
        r = _post(decode, _body(decode, other, kv_transfer_params=params), signed=True)
        assert r.status_code == 200, r.text  # never a 5xx, never a hang (180 s client timeout)
        assert time.monotonic() - started < 120
        assert text_of(r.json()) == expected
        assert r.json()["kvbranch"]["remote_hit_tokens"] == 0, r.json()["kvbranch"]
    assert _declined(decode) == declined + len(variants)  # one decline a forged handle
    _still_right(decode, plain_server)


def test_a_forged_pull_handle_at_p_recomputes(pd, plain_server):
    prefill, decode, router = pd
    messages = _messages("Name a tree.")
    expected = text_of(chat(plain_server, messages, max_tokens=1))
    handle = {
        "remote_block_ids": [[0, 1]],
        "remote_engine_id": "x",
        "remote_host": "127.0.0.1",
        "remote_port": 9,
        "remote_request_id": "r",
        "remote_num_tokens": 200,
        "kvbranch_verified": 200,
        "_remote_blocks_processed": True,
        "do_remote_decode": True,
        "do_remote_prefill": False,
    }
    assert _post(prefill, _body(prefill, messages, 1, kv_transfer_params=handle)).status_code == 403
    r = _post(prefill, _body(prefill, messages, 1, kv_transfer_params=handle), signed=True)
    assert r.status_code == 200, r.text
    assert r.json()["kvbranch"]["remote_hit_tokens"] == 0
    assert text_of(r.json()) == expected
    _still_right(prefill, plain_server)


def test_params_in_the_extension_args_are_refused(pd):
    prefill, decode, router = pd
    before = {s.name: pd_activity(s) for s in (prefill, decode)}
    xargs = {"kv_transfer_params": {"do_remote_decode": True}}
    for server in (prefill, decode, router):
        body = _body(server, _messages("hi"), 4, vllm_xargs=xargs)
        r = _post(server, body)
        assert r.status_code in (400, 403), r.text
    # refused before any engine saw them: no generation, no pull, no handle checked, no hold
    assert {s.name: pd_activity(s) for s in (prefill, decode)} == before


def test_hold_claims_come_from_the_router_only(pd):
    prefill, decode, router = pd
    # a real hold of D's (a turn D served alone, as the router asks for one) and its handle
    held = chat(
        decode,
        _messages("Name a river."),
        max_tokens=4,
        session_id="attack-hold",
        kv_transfer_params={"do_remote_prefill": False},
        auth=as_router(),
    )["kv_transfer_params"]
    assert held.get("remote_block_ids"), held
    before = pd_activity(decode)
    for handle in ({"kvbranch_mac": "x"}, held):
        with client(decode) as c:
            r = c.post(HOLD_CLAIM_PATH, json={"handle": handle})
        assert r.status_code == 403, r.text
        with client(router) as c:
            r = c.post(HOLD_CLAIM_PATH, json={"handle": handle})
        assert r.status_code == 404, r.text
    # none of them reached D's hold registry (not even as a refused claim), and the hold is
    # still unclaimed: the router's own claim gets it (a claim is granted once)
    assert pd_activity(decode) == before
    with client(decode, as_router()) as c:
        r = c.post(HOLD_CLAIM_PATH, json={"handle": held})
    assert r.status_code == 200 and CLAIM_FIELD in r.json(), r.text


def _raw_request(url: str, request: bytes, timeout: float = 30.0) -> bytes:
    """Send bytes as they are (httpx would normalise the path) and read the whole answer."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=timeout) as sock:
        sock.sendall(request)
        data = b""
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                return data
            data += chunk


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/kvbranch/../../metrics"),
        ("GET", "/v1/kvbranch/%2e%2e/%2e%2e/metrics"),
        ("GET", "/v1/kvbranch/..%2f..%2fmetrics"),
        ("POST", "/v1/kvbranch/../chat/completions"),
        ("POST", "/v1/kvbranch/sessions/..%2f..%2freset_prefix_cache"),
    ],
)
def test_traversal_through_the_router_is_404(pd, method, path):
    prefill, decode, router = pd
    body = b'{"model":"m","messages":[],"kv_transfer_params":{"do_remote_decode":true}}'
    request = (
        f"{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
        f"Authorization: Bearer {router.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    answer = _raw_request(router.url, request)
    status = answer.split(b"\r\n", 1)[0]
    assert b" 404 " in status, answer[:300]
    assert b"vllm:" not in answer and b"remote_block_ids" not in answer


@pytest.mark.parametrize(
    ("method", "path"), [("GET", "/server_info"), ("POST", "/reset_prefix_cache")]
)
def test_dev_routes_need_a_key(pd, method, path):
    """Without a key: 401, and nothing done (the device cache a refused reset would have
    dropped still serves the same prompt); with one: vLLM's own answer."""
    resets = path == "/reset_prefix_cache"
    messages = _messages("Name a tree.")
    for server in pd[:2]:
        if resets:
            chat(server, messages, max_tokens=1)  # now in the device cache
        with httpx.Client(base_url=server.url, timeout=30) as c:
            r = c.request(method, path)
        assert r.status_code == 401, r.text
        if resets:
            again = chat(server, messages, max_tokens=1)["kvbranch"]
            assert again["device_hit_tokens"] > 0, again  # the refused reset reset nothing
        with client(server) as c:  # with a key (tests run with dev mode on): vLLM's answer
            r = c.request(method, path)
        assert r.status_code == 200, r.text


def test_repeated_identity_headers_are_a_400(pd):
    prefill, decode, router = pd
    headers = [
        ("Authorization", f"Bearer {router.api_key}"),
        ("Authorization", f"Bearer {KEY_B}"),
    ]
    with httpx.Client(base_url=router.url, timeout=30) as c:
        r = c.post("/v1/chat/completions", json=_body(router, _messages("hi"), 4), headers=headers)
        assert r.status_code == 400, r.text
        r = c.post(
            "/v1/chat/completions",
            json=_body(router, _messages("hi"), 4),
            headers=[("X-Session-ID", "a"), ("X-Session-ID", "b"), headers[0]],
        )
        assert r.status_code == 400, r.text


def test_a_slow_client_does_not_hold_the_router(pd, plain_server):
    """Half a request's headers, then silence: the router serves others meanwhile and closes
    that connection once its header deadline (``--header-timeout-s``) has passed."""
    prefill, decode, router = pd
    parts = urlsplit(router.url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=30)
    try:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        give_up = time.monotonic() + ROUTER_HEADER_TIMEOUT_S + CLOSE_SLACK_S
        _still_right(router, plain_server)
        # Closed already (b"" at once) or within the slack; a router still holding it past
        # that ignored its deadline.
        sock.settimeout(max(give_up - time.monotonic(), 0.01))
        try:
            got = sock.recv(1024)
        except TimeoutError:
            pytest.fail(
                f"the router held a slow client's connection {CLOSE_SLACK_S:.0f} s past its "
                f"{ROUTER_HEADER_TIMEOUT_S:.0f} s header deadline"
            )
        assert got == b"", got  # closed by the router, with nothing sent
    finally:
        sock.close()


def test_the_cluster_still_serves_a_real_conversation_right(pd, plain_server):
    prefill, decode, router = pd
    messages = _messages("Tell me about the moon in two sentences.")
    first = chat(router, messages, max_tokens=24, session_id="after-attacks")
    assert text_of(first) == text_of(chat(plain_server, messages, max_tokens=24))
    turn2 = [
        *messages,
        {"role": "assistant", "content": text_of(first)},
        {"role": "user", "content": "And about the sun?"},
    ]
    second = chat(router, turn2, max_tokens=16, session_id="after-attacks")
    assert text_of(second) == text_of(chat(plain_server, turn2, max_tokens=16))
