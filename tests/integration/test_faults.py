"""Faults against the real server (real vLLM, real model, real connector):

* a client that disconnects in the middle of a stream: the request is aborted in the engine,
  the connector's planner still sees it finish (``request_finished``), nothing stays running or
  pinned beyond the session's own lease, and the server keeps serving;
* a full host store: evictions happen, a pinned branch keeps all its blocks, and the answer
  served from the store afterwards is the same greedy answer as the one computed from scratch;
* overload (429 / 503 with ``Retry-After``) in front of the real server: the sdk's retry
  waits what the server asked and then gets the real server's answer.

Timeouts here are hang guards, never performance assertions.
"""

from __future__ import annotations

import json
import secrets
import threading
import time

import httpx
import pytest

from sdk import KVBranchClient, RetryPolicy
from server.launcher.process import free_port
from tests.integration.helpers import (
    BLOCK,
    branch_info,
    chat,
    client,
    create_session,
    filler,
    reset_device_cache,
    stats,
    text_of,
    two_messages,
)

HANG_GUARD_S = 180.0


def _wait_for(what: str, probe, timeout_s: float = HANG_GUARD_S, every_s: float = 0.5):
    """Poll ``probe()`` until it returns something truthy (hang guard: ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every_s)
    raise AssertionError(f"{what}: not reached within {timeout_s}s (last: {last!r})")


def _requests_running(server) -> float:
    with client(server) as c:
        text = c.get("/metrics").text
    total = 0.0
    found = False
    for line in text.splitlines():
        if line.startswith("vllm:num_requests_running"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, "vllm:num_requests_running missing from /metrics"
    return total


# --- a. client disconnects mid-stream ------------------------------------------------------
def test_client_disconnect_mid_stream_aborts_the_request_and_leaks_nothing(kvbranch_server):
    server = kvbranch_server
    sid = f"abort-{secrets.token_hex(6)}"
    create_session(server, session_id=sid, pin_ttl_s=600)
    pinned_before = stats(server)["store"]["pinned_blocks"]
    messages = two_messages("Write a very long story about a cache.", words=300, seed=41)
    max_tokens = 3000
    body = {
        "model": server.model,
        "messages": messages,
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "session_id": sid,
    }

    chunks = 0
    with httpx.Client(
        base_url=server.url,
        headers=server.headers(),
        timeout=httpx.Timeout(HANG_GUARD_S, connect=10.0),
    ) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {") and '"content"' in line:
                    chunks += 1
                    if chunks == 3:
                        break
        # leaving both blocks closes the connection with the response half read
    assert chunks == 3

    # the engine aborted it: nothing runs any more ...
    _wait_for("vllm:num_requests_running back to 0", lambda: _requests_running(server) == 0)

    # ... and the connector's planner saw it finish (request_finished is what updates the
    # branch: its request count and its token sequence)
    def finished_once():
        info = branch_info(server, sid)
        return info if info["requests"] == 1 else None

    branch = _wait_for("the aborted request reached request_finished", finished_once)
    prompt_tokens = chat(server, messages, max_tokens=1)["usage"]["prompt_tokens"]
    assert prompt_tokens < branch["num_tokens"] < prompt_tokens + max_tokens  # cut short
    assert branch["pinned"] and branch["pinned_blocks"] >= 1  # its own lease, renewed on finish

    # nothing pinned beyond the session's own pin
    pinned_after = stats(server)["store"]["pinned_blocks"]
    assert pinned_after - pinned_before <= branch["pinned_blocks"]

    # the server still serves, the session too
    again = chat(
        server, messages[:1] + [{"role": "user", "content": "Say ok."}], session=sid, max_tokens=4
    )
    assert again["kvbranch"]["session_id"] == sid
    assert branch_info(server, sid)["requests"] == 2

    # deleting the session releases its pins
    with client(server) as c:
        r = c.delete(f"/v1/kvbranch/sessions/{sid}")
        assert r.status_code == 200, r.text
        assert c.get(f"/v1/kvbranch/sessions/{sid}").status_code == 404
    assert stats(server)["store"]["pinned_blocks"] <= pinned_before
    assert _requests_running(server) == 0


# --- b. host store full ----------------------------------------------------------------------
def test_full_host_store_evicts_unpinned_first_and_answers_stay_greedy_identical(
    kvbranch_server, plain_server
):
    """tests/integration/test_connector.py already checks evictions and that a pinned branch
    survives while an unpinned one is evicted; this adds the answers: after the overflow, the
    pinned branch's next request is served from the host store and gives the same greedy
    answer as plain vLLM (no connector, no host store) computing the same prompt."""
    server = kvbranch_server
    sid = f"full-{secrets.token_hex(6)}"
    create_session(server, session_id=sid, pin_ttl_s=600)
    messages = two_messages("Which tool should run first? Answer briefly.", words=300, seed=4242)
    reference = text_of(chat(plain_server, messages, max_tokens=16))
    first = chat(server, messages, max_tokens=16)  # no session, never-seen prompt
    # Never-seen: no whole block is reused. The chat template's opening tokens may match a tail
    # an earlier test left in the store (token-exact reuse), never more than part of a block.
    split = first["kvbranch"]
    assert split["device_hit_tokens"] == 0 and split["host_hit_tokens"] < BLOCK
    assert split["recomputed_tokens"] > first["usage"]["prompt_tokens"] - BLOCK
    assert text_of(first) == reference
    chat(server, messages, session=sid, max_tokens=16)
    pinned = branch_info(server, sid)
    assert pinned["pinned"] and pinned["pinned_blocks"] >= 2
    evictions_before = stats(server)["store"]["evictions"]
    capacity = stats(server)["store"]["capacity_blocks"]

    # overflow: unrelated prompts worth more blocks than the whole store
    pushed = 0
    i = 0
    while pushed <= capacity + 8:
        response = chat(server, filler(500 + i), max_tokens=1)
        pushed += response["usage"]["prompt_tokens"] // BLOCK
        i += 1
    store = stats(server)["store"]
    assert store["evictions"] > evictions_before
    assert store["used_blocks"] <= store["capacity_blocks"]
    pinned = branch_info(server, sid)
    assert pinned["stored_blocks"] == pinned["pinned_blocks"] >= 2  # all of it survived

    # the next request of the pinned branch comes from the store, with the same answer
    reset_device_cache(server)
    again = chat(server, messages, session=sid, max_tokens=16)
    assert again["kvbranch"]["device_hit_tokens"] == 0
    assert again["kvbranch"]["host_hit_tokens"] >= BLOCK
    assert text_of(again) == reference
    with client(server) as c:
        assert c.delete(f"/v1/kvbranch/sessions/{sid}").status_code == 200


# --- c. overload: 429 / 503 with Retry-After, then the real server --------------------------
class OverloadProxy:
    """A tiny ASGI reverse proxy (uvicorn, in a thread) in front of the real server: the first
    ``fail`` chat requests get the given (status, Retry-After) answers, every later request is
    forwarded to the real server unchanged (streams too)."""

    def __init__(self, upstream: str, failures: list[tuple[int, str]]) -> None:
        self.upstream = upstream
        self.failures = list(failures)
        self.chat_attempts = 0
        self.forwarded = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = None
        self._thread: threading.Thread | None = None

    async def app(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        if scope["path"] == "/v1/chat/completions":
            self.chat_attempts += 1
            if self.failures:
                status, retry_after = self.failures.pop(0)
                payload = json.dumps(
                    {
                        "error": {
                            "message": "overloaded, retry later",
                            "type": "Overloaded",
                            "code": status,
                        }
                    }
                ).encode()
                await send(
                    {
                        "type": "http.response.start",
                        "status": status,
                        "headers": [
                            (b"content-type", b"application/json"),
                            (b"retry-after", retry_after.encode()),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": payload})
                return
        self.forwarded += 1
        headers = {
            k.decode(): v.decode()
            for k, v in scope["headers"]
            if k.lower() not in (b"host", b"content-length")
        }
        url = self.upstream + scope["path"]
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode()
        async with httpx.AsyncClient(timeout=HANG_GUARD_S) as upstream:
            async with upstream.stream(scope["method"], url, content=body, headers=headers) as r:
                await send(
                    {
                        "type": "http.response.start",
                        "status": r.status_code,
                        "headers": [
                            (k.encode(), v.encode())
                            for k, v in r.headers.items()
                            if k.lower() not in ("content-length", "transfer-encoding")
                        ],
                    }
                )
                async for piece in r.aiter_raw():
                    await send({"type": "http.response.body", "body": piece, "more_body": True})
                await send({"type": "http.response.body", "body": b""})

    def __enter__(self) -> OverloadProxy:
        import uvicorn

        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            interface="asgi3",
            lifespan="on",
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        _wait_for("overload proxy up", lambda: self._server.started, timeout_s=30, every_s=0.05)
        return self

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_sdk_backs_off_on_429_and_503_with_retry_after_then_gets_the_real_answer(
    kvbranch_server, stream
):
    messages = [{"role": "user", "content": "Name the capital of Italy in one word."}]
    direct = text_of(chat(kvbranch_server, messages, max_tokens=12))
    waits: list[float] = []

    def sleep(seconds: float) -> None:  # the real wait, recorded
        waits.append(seconds)
        time.sleep(seconds)

    retry = RetryPolicy(max_attempts=4, max_total_s=60, sleep=sleep)
    with OverloadProxy(kvbranch_server.url, [(429, "1"), (503, "2")]) as proxy:
        with KVBranchClient(
            proxy.url, api_key=kvbranch_server.api_key, retry=retry, timeout=HANG_GUARD_S
        ) as sdk:
            if stream:
                answer = sdk.chat_stream(messages, max_tokens=12, temperature=0)
                for _ in answer:
                    pass
                text = answer.result.text
            else:
                text = sdk.chat(messages, max_tokens=12, temperature=0).text
    assert proxy.chat_attempts == 3  # 429, 503, then the real server
    assert waits == [1.0, 2.0]  # exactly what Retry-After asked
    assert text == direct  # the real server's greedy answer
