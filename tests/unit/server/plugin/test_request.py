"""The request body is read once for every kvbranch layer (guard and middleware), bounded, and
replayed to the app as the innermost layer left it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from sdk.contract import GENERATE_PATHS
from server.plugin.guard import KVBranchGuard
from server.plugin.middleware import KVBranchMiddleware
from server.plugin.request import read_body


class Client:
    """An ASGI ``receive`` that sends ``chunks`` and counts how often it was asked."""

    def __init__(self, *chunks: bytes, disconnect: bool = False) -> None:
        self.messages = [
            {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1}
            for i, c in enumerate(chunks)
        ]
        if disconnect:
            self.messages[-1]["more_body"] = True
            self.messages.append({"type": "http.disconnect"})
        self.calls = 0

    async def __call__(self) -> dict[str, Any]:
        self.calls += 1
        if self.messages:
            return self.messages.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")


def scope(body: bytes = b"") -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": GENERATE_PATHS[0],
        "headers": [(b"content-type", b"application/json")],
    }


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_read_once_then_replayed_from_the_scope():
    async def go() -> None:
        client = Client(b'{"a":', b" 1}")
        s = scope()
        body, receive = await read_body(s, client)
        assert body.data == b'{"a": 1}' and not body.more and client.calls == 2
        again, receive2 = await read_body(s, receive)  # a second layer: nothing is read
        assert again is body and receive2 is receive and client.calls == 2
        body.data = b"rewritten"
        assert await receive() == {"type": "http.request", "body": b"rewritten", "more_body": False}

    run(go())


def test_reading_stops_past_the_limit_and_the_rest_passes_through():
    async def go() -> None:
        client = Client(b"12345", b"67890", b"abc")
        body, receive = await read_body({}, client, limit=6)
        assert body.over_limit and body.more and body.data == b"1234567890"
        assert (await receive())["body"] == b"1234567890"
        assert (await receive())["body"] == b"abc"  # straight from the client

    run(go())


def test_a_client_that_leaves_mid_body():
    async def go() -> None:
        body, _ = await read_body({}, Client(b"12", disconnect=True))
        assert body.disconnected and not body.more and body.data == b"12"

    run(go())


def test_guard_and_middleware_read_the_body_once():
    payload = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "session_id": "s1"}
    seen: list[bytes] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        message = await receive()
        seen.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def send(message: dict[str, Any]) -> None:
        pass

    raw = json.dumps(payload).encode()
    client = Client(raw[:10], raw[10:])
    stack = KVBranchGuard(KVBranchMiddleware(app))
    run(stack(scope(), client, send))
    assert client.calls == 2  # each chunk once: nobody read the body twice
    forwarded = json.loads(seen[0])
    assert forwarded["session_id"] == "s1" and "kvbranch_tag" in forwarded["vllm_xargs"]
