"""One builder for kvbranch's JSON error responses (server routes, ASGI guard, P/D router).

The body is :func:`server.contract.error_body` — ``{"error": {"message", "type", "param",
"code"}}``, OpenAI's shape, so OpenAI clients and the sdk parse it alike. Lives outside
:mod:`server.plugin` so that the router builds its errors without importing the plugin (or
vLLM); it needs only Starlette.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.responses import JSONResponse

from server.contract import error_body

__all__ = ["asgi_error", "error_response", "send_error"]

Send = Callable[[dict[str, Any]], Awaitable[None]]


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    """A Starlette/FastAPI response carrying a kvbranch error."""
    return JSONResponse(
        error_body(status, message, param, **extra), status_code=status, headers=headers
    )


def asgi_error(status: int, message: str, param: str | None = None) -> tuple[dict[str, Any], bytes]:
    """The ``http.response.start`` message and the body of an error, for raw ASGI code."""
    body = json.dumps(error_body(status, message, param)).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ],
    }
    return start, body


async def send_error(send: Send, status: int, message: str, param: str | None = None) -> None:
    """Answer an ASGI request with an error."""
    start, body = asgi_error(status, message, param)
    await send(start)
    await send({"type": "http.response.body", "body": body, "more_body": False})
