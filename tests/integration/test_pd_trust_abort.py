"""A turn whose client leaves while D is still pulling its prompt's KV from P must not kill D's
engine core (the soak's dead D: vLLM's ``assert req_id in self.requests`` in
``Scheduler._update_from_kv_xfer_finished``).

vLLM keeps the blocks of a request aborted in ``WAITING_FOR_REMOTE_KVS`` until the worker
reports its read ended (``finished_recving``), then frees them and forgets the request. The
host-store child of the P/D connector planned a copy of that request's partial last block as
if it had been computed, and asked vLLM to keep the blocks for that copy too: two reports
(the copy's ``finished_sending``, the read's ``finished_recving``) then each freed the request,
and the second one named a request vLLM had already forgotten.

The deterministic case makes the pull wait: D gets a handle (sealed as P seals it, with the
cluster secret the tests know) whose peer never answers NIXL's handshake, so the request sits
in ``WAITING_FOR_REMOTE_KVS`` for the handshake's 5 s timeout; the client leaves while it does
(seen on D's ``vllm:num_requests_kv_fetch_by_stage``, not by the clock); a second request to
the same silent peer ends only after the handshake failed for both, so the first one's late
report has reached the scheduler by then. D must answer that second request right (a failed
pull recomputes) and serve a real conversation afterwards.

The second case plays the soak through the router: streamed turns with a ~1.5k-token prompt
whose client leaves right after the first byte, two turns of one session racing, then the same
answers as vLLM's own server.

Named to run right after test_pd_trust.py on the same keyed pair: its finished turns leave D
holding conversations for the hold TTL (900 s), and test_pd_trust counts D's holds against its
small device cache (run before it, they filled D and its first test saw holds released).
"""

from __future__ import annotations

import json
import re
import secrets
import socket
import threading
import uuid
from urllib.parse import urlsplit

import httpx
import pytest

from server.common.cluster_auth import ROUTER_PROOF_HEADER, sign
from server.connector.pd.transfer_auth import seal
from tests.integration.cluster_fixture import wait_for
from tests.integration.helpers import chat, client, system_prompt, text_of
from tests.integration.trust_cluster import CLUSTER_SECRET, as_router

CHAT_PATH = "/v1/chat/completions"
#: Client disconnects through the router (bounded: each is a full P prefill).
ROUTER_ABORTS = 4
IN_PROGRESS = re.compile(
    r'^vllm:num_requests_kv_fetch_by_stage\{[^}]*stage="in_progress"[^}]*\}\s+([0-9.e+-]+)', re.M
)


@pytest.fixture(scope="module")
def pd(keyed_pd):
    return keyed_pd


def _messages(words: int, seed: int, question: str) -> list[dict]:
    return [
        {"role": "system", "content": system_prompt(words=words, seed=seed)},
        {"role": "user", "content": question},
    ]


def _body(server, messages, max_tokens: int, **extra) -> dict:
    return {
        "model": server.model,
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        **extra,
    }


def _p_handle(prefill, messages) -> dict:
    """P's handle for ``messages``, asked for as the router asks."""
    body = _body(prefill, messages, 1, kv_transfer_params={"do_remote_decode": True})
    with client(prefill, as_router()) as c:
        r = c.post(CHAT_PATH, json=body)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert params.get("do_remote_prefill") and params.get("remote_block_ids"), params
    return params


def _silent_peer_handle(handle: dict, port: int) -> dict:
    """P's handle, but naming an engine whose NIXL side channel never answers (a listening
    socket nobody reads), sealed again as P would seal it."""
    params = dict(handle)
    params.pop("kvbranch", None)  # P's split, which the router keeps for itself
    params.update(
        remote_engine_id=f"silent-{uuid.uuid4().hex}", remote_host="127.0.0.1", remote_port=port
    )
    return seal(params, CLUSTER_SECRET.encode())


def _kv_fetches_in_progress(decode) -> float:
    with client(decode) as c:
        text = c.get("/metrics").text
    return sum(float(v) for v in IN_PROGRESS.findall(text))


def _engine_alive(server) -> bool:
    try:
        with httpx.Client(base_url=server.url, timeout=30.0, headers=server.headers()) as c:
            return c.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


def _open_stream(server, body: dict, *, signed: bool) -> socket.socket:
    """Send a streamed request on a raw socket and return it unread (the test closes it: the
    client leaving)."""
    content = json.dumps(body).encode()
    parts = urlsplit(server.url)
    headers = {
        "Host": f"{parts.hostname}:{parts.port}",
        "Content-Type": "application/json",
        "Content-Length": str(len(content)),
        **server.headers(),
    }
    if signed:
        headers[ROUTER_PROOF_HEADER] = sign(CLUSTER_SECRET.encode(), "POST", CHAT_PATH, content)
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    sock = socket.create_connection((parts.hostname, parts.port), timeout=600)
    sock.sendall(f"POST {CHAT_PATH} HTTP/1.1\r\n{head}\r\n".encode() + content)
    return sock


def _still_right(server, plain_server, seed: int) -> None:
    messages = _messages(80, seed, "Name a planet.")
    assert text_of(chat(server, messages, max_tokens=8)) == text_of(
        chat(plain_server, messages, max_tokens=8)
    )


def test_a_client_leaving_while_d_pulls_leaves_d_alive(pd, plain_server):
    prefill, decode, router = pd
    messages = _messages(150, 71, f"Summarise the context in one line. ({secrets.token_hex(4)})")
    handle = _p_handle(prefill, messages)
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    try:
        port = silent.getsockname()[1]
        before = _kv_fetches_in_progress(decode)
        body = _body(
            decode, messages, 16, stream=True, kv_transfer_params=_silent_peer_handle(handle, port)
        )
        sock = _open_stream(decode, body, signed=True)
        try:
            wait_for(
                "D's request waiting for its pull",
                lambda: _kv_fetches_in_progress(decode) > before,
                timeout_s=120,
                every_s=0.05,
            )
        finally:
            sock.close()  # the client leaves while the pull waits on the silent peer
        # The same silent peer: this request's pull fails with the first one's (one handshake),
        # so when it is answered the first one's report has reached vLLM's scheduler.
        second = _body(decode, messages, 16, kv_transfer_params=_silent_peer_handle(handle, port))
        try:
            with client(decode, as_router()) as c:
                r = c.post(CHAT_PATH, json=second)
        except httpx.HTTPError as exc:
            raise AssertionError(f"D did not answer after the client left: {exc!r}") from exc
        assert r.status_code == 200, r.text
        assert _engine_alive(decode), "D's engine core died"
        assert text_of(r.json()) == text_of(chat(plain_server, messages, max_tokens=16))
    finally:
        silent.close()
    _still_right(decode, plain_server, 72)
    _still_right(router, plain_server, 73)


def test_clients_leaving_streamed_turns_through_the_router(pd, plain_server):
    prefill, decode, router = pd
    for i in range(ROUTER_ABORTS):
        messages = _messages(600, 80 + i, f"List three facts. ({secrets.token_hex(4)})")
        body = _body(router, messages, 32, stream=True)
        sock = _open_stream(router, body, signed=False)
        try:
            sock.recv(1)  # the first byte of the answer: D has the request
        finally:
            sock.close()
    # Two turns of one session at once (the second may pull what the first holds, or not).
    session = f"race-{secrets.token_hex(4)}"
    first = _messages(300, 90, "Tell me about the moon.")
    seed = chat(router, first, session=session, max_tokens=12)
    turn2 = [
        *first,
        {"role": "assistant", "content": text_of(seed)},
        {"role": "user", "content": "And the sun?"},
    ]
    answers: list[str] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            answers.append(text_of(chat(router, turn2, session=session, max_tokens=12)))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    expected = text_of(chat(plain_server, turn2, max_tokens=12))
    assert answers == [expected, expected]
    assert _engine_alive(decode) and _engine_alive(prefill)
    _still_right(decode, plain_server, 91)
    _still_right(router, plain_server, 92)
