"""Typed errors of the kvbranch sdk.

Every error the sdk raises for a failed request is a :class:`KVBranchError`; HTTP failures are
:class:`APIStatusError` subclasses carrying the server's own message (``{"error": {"message",
"type", "code"}}`` from kvbranch and vLLM, FastAPI's ``{"detail": ...}``, or the raw text).

``retryable`` says whether the sdk's retry policy may send the request again: only when the
server cannot have produced a result the caller would lose (connection never made, 429,
502/503/504).
"""

from __future__ import annotations

import email.utils
import json
import time
from typing import Any

import httpx
from pydantic import ValidationError

from sdk.contract import ErrorBody

__all__ = [
    "KVBranchError",
    "APIConnectionError",
    "APITimeoutError",
    "StreamInterruptedError",
    "APIResponseError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "NotFoundError",
    "KVBranchUnavailableError",
    "ConflictError",
    "RateLimitError",
    "ServerError",
]
"""The error classes (``sdk`` re-exports exactly these); the helpers below
(``parse_retry_after``, ``error_from_response``, ``error_from_transport``) are the sdk's own."""


class KVBranchError(Exception):
    """Base class of every sdk error."""

    retryable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class APIConnectionError(KVBranchError):
    """The server could not be reached, or the connection broke."""

    def __init__(self, message: str, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


class APITimeoutError(APIConnectionError):
    """A timeout: connecting (retryable) or waiting for the response (not retried, because
    the server may still be generating)."""


class StreamInterruptedError(APIConnectionError):
    """A stream broke after its first byte. Never retried: that would silently run (and
    bill) the generation twice. The conversation history is unchanged; call again."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class APIResponseError(KVBranchError):
    """The server answered 2xx with a body the sdk cannot read (not JSON, wrong shape)."""


class APIStatusError(KVBranchError):
    """The server answered with an HTTP error status."""

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        error_type: str | None = None,
        code: Any = None,
        body: Any = None,
        headers: httpx.Headers | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.error_type = error_type
        self.code = code
        self.body = body
        self.headers = headers if headers is not None else httpx.Headers()

    def __str__(self) -> str:
        return f"HTTP {self.status_code}: {self.message}"


class BadRequestError(APIStatusError):
    """400/422 (and other 4xx without a more specific class): the request is invalid."""


class AuthenticationError(APIStatusError):
    """401/403: missing or wrong API key."""


class NotFoundError(APIStatusError):
    """404: the session, branch or model is unknown to the server."""


class KVBranchUnavailableError(NotFoundError):
    """404 from a ``/v1/kvbranch`` route of a server without kvbranch (a plain
    OpenAI-compatible server)."""


class ConflictError(APIStatusError):
    """409: already exists, or a pin that does not fit the server's pin budget."""


class RateLimitError(APIStatusError):
    """429. ``retry_after`` is the server's ``Retry-After`` in seconds, when it sent one."""

    retryable = True

    def __init__(self, *args: Any, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.retry_after = retry_after


class ServerError(APIStatusError):
    """5xx. 502/503/504 are retryable (``retry_after`` set from ``Retry-After`` if sent)."""

    def __init__(self, *args: Any, retry_after: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.retry_after = retry_after
        self.retryable = self.status_code in (502, 503, 504)


def parse_retry_after(value: str | None, *, now: float | None = None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or an HTTP date); ``None`` if
    absent or unreadable. Never negative."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def _message_of(body: Any, text: str) -> tuple[str, str | None, Any]:
    """The message, type and code of an error body: kvbranch's and vLLM's own shape (the
    contract's :class:`ErrorBody`), else whatever other servers send."""
    try:
        error = ErrorBody.model_validate(body).error
        return error.message, error.type, error.code
    except ValidationError:
        pass
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict):
            return (str(err.get("message") or err), err.get("type"), err.get("code"))
        if isinstance(err, str):
            return err, None, None
        detail = body.get("detail")
        if detail is not None:
            if isinstance(detail, list):  # FastAPI validation errors
                parts = []
                for item in detail:
                    if isinstance(item, dict):
                        loc = ".".join(str(p) for p in item.get("loc", ()))
                        parts.append(f"{loc}: {item.get('msg')}" if loc else str(item.get("msg")))
                    else:
                        parts.append(str(item))
                return "; ".join(parts), None, None
            return str(detail), None, None
        if isinstance(body.get("message"), str):
            return body["message"], body.get("type"), body.get("code")
    text = text.strip()
    return (text[:2000] if text else "(empty response body)"), None, None


def error_from_response(
    response: httpx.Response, *, body_text: str | None = None
) -> APIStatusError:
    """The typed error for an HTTP error response (its body must have been read)."""
    status = response.status_code
    text = body_text if body_text is not None else response.text
    try:
        body: Any = json.loads(text) if text else None
    except ValueError:
        body = None
    message, error_type, code = _message_of(body, text)
    kwargs = dict(
        status_code=status,
        error_type=error_type,
        code=code,
        body=body if body is not None else text,
        headers=response.headers,
    )
    retry_after = parse_retry_after(response.headers.get("retry-after"))
    if status == 429:
        return RateLimitError(message, retry_after=retry_after, **kwargs)
    if status >= 500:
        return ServerError(message, retry_after=retry_after, **kwargs)
    if status in (401, 403):
        return AuthenticationError(message, **kwargs)
    if status == 404:
        path = response.request.url.path if response.request is not None else ""
        from sdk.contract import API_PREFIX

        # kvbranch answers {"error": {...}}; a server without the routes answers FastAPI's
        # {"detail": "Not Found"} (or anything else).
        if API_PREFIX in path and not (
            isinstance(body, dict) and isinstance(body.get("error"), dict)
        ):
            return KVBranchUnavailableError(
                f"this server has no kvbranch routes ({path}: {message})", **kwargs
            )
        return NotFoundError(message, **kwargs)
    if status == 409:
        return ConflictError(message, **kwargs)
    return BadRequestError(message, **kwargs)


def error_from_transport(exc: httpx.HTTPError, *, url: str) -> KVBranchError:
    """The typed error for an httpx transport failure."""
    detail = str(exc) or type(exc).__name__
    if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
        return APITimeoutError(f"timed out connecting to {url}: {detail}", retryable=True)
    if isinstance(exc, httpx.TimeoutException):
        return APITimeoutError(
            f"timed out waiting for {url}: {detail} (not retried: the "
            f"server may still be working on it)",
            retryable=False,
        )
    if isinstance(exc, httpx.ConnectError):
        return APIConnectionError(
            f"cannot connect to {url}: {detail} (is a kvbranch server "
            f"running there? start one with `python -m server`, or set "
            f"KVBRANCH_BASE_URL)",
            retryable=True,
        )
    if isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
        # The connection closed before a response arrived: nothing was returned to us.
        return APIConnectionError(f"connection to {url} broke: {detail}", retryable=True)
    return APIConnectionError(f"request to {url} failed: {detail}", retryable=False)
