"""The router's edge with its clients: what it reads from a request before any instance sees it.

Request bodies are bounded *before* they are read whole (413); a request's tenant — the digest
of its API key — scopes the cluster index the way the instances scope sessions. The router's
own error replies come from the server's one error builder (:mod:`server.errors`).
"""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from sdk.contract import BRANCH_HEADER, MAX_BODY_BYTES, SESSION_HEADER
from server.errors import error_response
from server.router.limits import BODY_TIMEOUT_S
from server.tenants import scope_of

#: Request headers a completion turn forwards to the instances.
FORWARD_HEADERS = ("authorization", SESSION_HEADER.lower(), BRANCH_HEADER.lower())
#: Request headers a session route forwards.
SESSION_ROUTE_HEADERS = ("authorization", "content-type")
#: How long a client should wait before retrying when no instance answers.
RETRY_AFTER = {"Retry-After": "5"}


#: Headers that decide whose request it is and where its KV lives: sent twice, the router's
#: index would read one and the instance another, so such a request is refused (400).
SINGLE_HEADERS = ("authorization", SESSION_HEADER.lower(), BRANCH_HEADER.lower())


def check_headers(request: Request) -> None:
    """Raise :class:`Refused` (400) when a header of :data:`SINGLE_HEADERS` is repeated."""
    for name in SINGLE_HEADERS:
        if len(request.headers.getlist(name)) > 1:
            raise Refused(error_response(400, f"header {name!r} is sent more than once"))


def unavailable(message: str) -> JSONResponse:
    """503 with Retry-After: no instance could take the request."""
    return error_response(503, message, headers=RETRY_AFTER)


def tenant_of(request: Request) -> str:
    """Whose request this is: the scope of its API key (:func:`server.tenants.scope_of`, the
    same tenant id the instances give a key they have). It scopes the cluster index."""
    return scope_of(request.headers.get("authorization"))


class Refused(Exception):
    """The request is refused before any instance sees it; ``response`` says why."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


async def read_body(request: Request) -> bytes:
    """The request body, bounded *before* it is read: a declared Content-Length over
    ``MAX_BODY_BYTES`` is refused unread, and a chunked (or understated) body as soon as the
    bytes read pass the bound — a client cannot make the router buffer an unbounded body."""
    limit = MAX_BODY_BYTES  # read at call time (tests lower it)
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise Refused(error_response(400, "Content-Length is not a number")) from None
        if size > limit:
            raise Refused(error_response(413, f"request body over {limit} bytes"))
    chunks: list[bytes] = []

    async def read() -> None:
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise Refused(error_response(413, f"request body over {limit} bytes"))
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise Refused(
            error_response(408, f"request body not received within {BODY_TIMEOUT_S:g} s")
        ) from None
    return b"".join(chunks)
