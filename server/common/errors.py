"""One builder for kvbranch's JSON error responses (server routes, ASGI guard, P/D router).

The body is :func:`sdk.contract.error_body` — ``{"error": {"message", "type", "param",
"code"}}``, OpenAI's shape, so OpenAI clients and the sdk parse it alike. Lives outside
:mod:`server.plugin` so that the router builds its errors without importing the plugin (or
vLLM); it needs only Starlette.

Any text goes: an error often quotes what the client sent, and a lone UTF-16 surrogate from a
JSON body (``"\\ud800"``) cannot be encoded as UTF-8 — Starlette's ``JSONResponse`` would
raise while answering, and an exception after the answer started drops the client's keep-alive
connection. Every string of the body is cleaned first (:func:`safe_text`: the surrogate is
written out as ``\\ud800``), so the body is always valid UTF-8 JSON.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from starlette.responses import JSONResponse

from sdk.contract import error_body

__all__ = ["asgi_error", "error_response", "safe_text", "send_error"]

Send = Callable[[dict[str, Any]], Awaitable[None]]


def safe_text(text: str) -> str:
    """``text`` with any lone surrogate written out (``\\ud800``): encodable as UTF-8."""
    if text.isascii():
        return text
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _clean(value: Any) -> Any:
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, dict):
        return {_clean(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _body(status: int, message: str, param: str | None, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = _clean(error_body(status, str(message), param, **extra))
    return body


def error_response(
    status: int,
    message: str,
    *,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> JSONResponse:
    """A Starlette/FastAPI response carrying a kvbranch error."""
    return JSONResponse(_body(status, message, param, **extra), status_code=status, headers=headers)


def asgi_error(
    status: int,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> tuple[dict[str, Any], bytes]:
    """The ``http.response.start`` message and the body of an error, for raw ASGI code."""
    body = json.dumps(_body(status, message, param), default=str).encode()
    start = {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *((k.lower().encode(), v.encode()) for k, v in (headers or {}).items()),
        ],
    }
    return start, body


async def send_error(
    send: Send,
    status: int,
    message: str,
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Answer an ASGI request with an error (the router edge's ``_refuse`` calls this with the
    status and headers its table gives the reason it counts)."""
    start, body = asgi_error(status, message, param, headers)
    await send(start)
    await send({"type": "http.response.body", "body": body, "more_body": False})
