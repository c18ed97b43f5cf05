"""What a cache-hint dialect is (:class:`Dialect`), what it reads from a request (:class:`Hints`)
and the pieces the dialects share. Pure: dicts in, dicts out; nothing here needs the engine, so
the P/D router reads a turn's session through the same code the instance does.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Any, Protocol

from sdk.contract import MAX_TTL_S, SESSION_XARG

#: Hex digits of a derived session id's digest (``pck-...``, ``cc-...``).
DIGEST_CHARS = 32
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}


class DialectError(ValueError):
    """A cache hint the server cannot use: 400 with ``param`` and ``message``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


class Engine(Protocol):
    """What a usage rewrite may ask of the serving engine; the plugin implements it over
    vLLM's app state (:mod:`server.plugin.engine_tokens`)."""

    @property
    def block_size(self) -> int | None:
        """The KV cache's block size (only full blocks are written), None when unknown."""
        ...

    async def count_tokens(self, path: str, request: dict[str, Any]) -> int | None:
        """Prompt tokens of ``request`` as a body of route ``path`` would render (None when
        it cannot be counted)."""
        ...


class UsageRewrite(Protocol):
    """A dialect's rewrite of one response's usage (made per request by its hints)."""

    async def rewrite(
        self, payload: dict[str, Any], split: dict[str, Any] | None, engine: Engine | None
    ) -> bool:
        """Rewrite a JSON response body (or one parsed stream event) in place; True when
        something changed. ``split`` is kvbranch's prompt-source split, when known."""
        ...

    async def rewrite_event(
        self, event: bytes, split: dict[str, Any] | None, engine: Engine | None
    ) -> bytes:
        """The same for one SSE event (``event: ...\\ndata: {...}``)."""
        ...


@dataclass
class Hints:
    """What a request's dialect asked for."""

    session_id: str | None = None  # derived; None when the request names its own (or none)
    pin_ttl_s: float | None = None
    usage: UsageRewrite | None = None


class Dialect(Protocol):
    """One client dialect of cache hints. Adding one is a module with a class like this and
    its entry in :data:`server.dialects.registry.DIALECTS`."""

    #: Short name (logs).
    name: str
    #: The routes whose bodies speak it.
    paths: tuple[str, ...]
    #: Whether these routes' bodies have vLLM's ``session_id`` field: then a body session is
    #: the request's own and a derived one is written there; else (``/v1/messages``) only the
    #: header or ``vllm_xargs.session_id`` name one, and a derived one goes into the xargs.
    session_field: bool

    def check(self, payload: dict[str, Any]) -> None:
        """Raise :class:`DialectError` for the first hint the server cannot use."""
        ...

    def hints(self, payload: dict[str, Any], own_session: bool) -> Hints:
        """The request's hints (``own_session``: it names its own session, so none is
        derived). Raises :class:`DialectError` (the guard answered those with a 400)."""
        ...


def explicit_session(
    payload: dict[str, Any], session_header: str | None, *, session_field: bool = True
) -> str | None:
    """The session the request names itself, in vLLM's order: the body's ``session_id`` (on
    routes that have the field), the ``X-Session-ID`` header, ``vllm_xargs.session_id``."""
    body = payload.get("session_id") if session_field else None
    if isinstance(body, str) and body:
        return body
    if session_header:
        return session_header
    xargs = payload.get("vllm_xargs")
    value = xargs.get(SESSION_XARG) if isinstance(xargs, dict) else None
    return value if isinstance(value, str) and value else None


def parse_duration(value: Any, param: str) -> float:
    """``"24h"``, ``"30m"``, ``"90s"`` → seconds (more than 0, at most 24 h)."""
    match = _DURATION.match(value) if isinstance(value, str) else None
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)] if match else 0.0
    if not match or seconds <= 0 or seconds > MAX_TTL_S:
        raise DialectError(
            param,
            f"{param} must be a duration such as '30m' or '24h' "
            f"(more than 0, at most 24h), got {value!r}",
        )
    return seconds


def is_duration(value: Any) -> bool:
    """Whether ``value`` is spelled like a duration (its range is :func:`parse_duration`'s)."""
    return isinstance(value, str) and _DURATION.match(value) is not None


def digest(prefix: str, data: bytes) -> str:
    """A derived session id: ``prefix`` + the first :data:`DIGEST_CHARS` hex of sha256."""
    return prefix + hashlib.sha256(data).hexdigest()[:DIGEST_CHARS]
