"""A request as kvbranch's ASGI layers see it: its route path, its headers, and its body — read
once per request, however many of our layers look at it.

The guard (outermost) reads the body to check sizes and ids; the middleware inside it rewrites
the same body. :func:`read_body` keeps what it read in the ASGI scope, so the second layer gets
it from there instead of reading it again, and hands on a ``receive`` that replays the body (as
the innermost layer last set it) before passing the client's later messages through.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from sdk.contract import MAX_BODY_BYTES
from server.checks.headers import header  # the plugin's layers read headers as the router does

__all__ = ["RequestBody", "drain", "header", "read_body", "route_path"]

Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]

_SCOPE_KEY = "kvbranch.body"


def route_path(scope: dict[str, Any]) -> str:
    """The request path without the app's ``root_path``, as vLLM's key check matches it."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    return path[len(root) :] if root and path.startswith(root) else path


class RequestBody:
    """What :func:`read_body` read. A layer that rewrites the body sets :attr:`data`; the
    replay hands on whatever it is when the app first asks."""

    def __init__(self) -> None:
        self.data = b""
        #: Reading stopped past the limit: the client has more to send (``more_body``).
        self.more = False
        self.over_limit = False
        #: The client went away before the body ended.
        self.disconnected = False
        self._replayed = False

    def replay(self, receive: Receive) -> Receive:
        async def replayed() -> Message:
            if not self._replayed:
                self._replayed = True
                return {"type": "http.request", "body": self.data, "more_body": self.more}
            return await receive()

        return replayed


async def read_body(
    scope: dict[str, Any], receive: Receive, limit: int | None = None
) -> tuple[RequestBody, Receive]:
    """The request's body and the ``receive`` to hand on. Read at most once per request: a
    layer inside another one that read it gets the same :class:`RequestBody` (and its own
    ``receive``, which already replays it). Reading stops as soon as more than ``limit`` bytes
    (default :data:`MAX_BODY_BYTES`) arrived: nothing unbounded is ever buffered."""
    cached = scope.get(_SCOPE_KEY)
    if isinstance(cached, RequestBody):
        return cached, receive
    limit = MAX_BODY_BYTES if limit is None else limit
    body = RequestBody()
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            body.disconnected = True
            body.more = False  # nothing more will come
            break
        chunk = message.get("body", b"")
        chunks.append(chunk)
        size += len(chunk)
        body.more = bool(message.get("more_body"))
        if size > limit:
            body.over_limit = True
            break
        if not body.more:
            break
    body.data = b"".join(chunks)
    scope[_SCOPE_KEY] = body
    return body, body.replay(receive)


async def drain(receive: Receive) -> None:
    """Read and drop the rest of a request body (before answering without it)."""
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body"):
            return
