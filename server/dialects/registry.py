"""The dialect registry: every caller of the cache hints goes through here — the guard
(:func:`problem`: a 400 naming the field), the middleware (:func:`apply`: session, pin lease
and usage rewrite mapped onto the request) and the P/D router's turn key (:func:`session_of`:
the session the instance will use, so a turn routes and is held under the same key).

A route is spoken by the first dialect of :data:`DIALECTS` that lists it; a route none lists
has no hints (nothing is checked, derived or rewritten there).
"""

from __future__ import annotations

import logging
from typing import Any

from sdk.contract import MAX_TTL_S, PIN_TTL_XARG, SESSION_XARG
from server.dialects.anthropic import AnthropicDialect
from server.dialects.base import Dialect, DialectError, Hints, explicit_session
from server.dialects.openai import OpenAIDialect

logger = logging.getLogger("kvbranch.dialects")

#: The dialects, in order (the first that lists a route speaks it).
DIALECTS: tuple[Dialect, ...] = (OpenAIDialect(), AnthropicDialect())


def dialect_for(path: str) -> Dialect | None:
    """The dialect the route's bodies speak, or None."""
    return next((d for d in DIALECTS if path in d.paths), None)


def problem(payload: dict[str, Any], path: str) -> tuple[str, str] | None:
    """(param, message) for the first cache hint of this request the server cannot use, or
    None. Pure; the guard answers it with a 400."""
    dialect = dialect_for(path)
    if dialect is None:
        return None
    try:
        dialect.check(payload)
    except DialectError as exc:
        return exc.param, exc.message[:300]
    except Exception:  # noqa: BLE001 - a bug here must not break the guard (nor the connection)
        logger.exception("kvbranch: cache hints of a %s request not checked", path)
    return None


def hints_of(payload: dict[str, Any], path: str, session_header: str | None = None) -> Hints:
    """Read the request's cache hints. Raises :class:`DialectError` (the guard has already
    answered those with a 400, so elsewhere they only mean "no hints")."""
    dialect = dialect_for(path)
    if dialect is None:
        return Hints()
    own = explicit_session(payload, session_header, session_field=dialect.session_field)
    return dialect.hints(payload, own_session=own is not None)


def _hints_or_none(payload: dict[str, Any], path: str, session_header: str | None) -> Hints:
    try:
        return hints_of(payload, path, session_header)
    except DialectError:
        return Hints()  # the guard answered it; nothing reaches here on a served route
    except Exception:  # noqa: BLE001 - hints are best effort: the request goes on without them
        logger.exception("kvbranch: cache hints of a %s request not applied", path)
        return Hints()


def apply(payload: dict[str, Any], path: str, session_header: str | None = None) -> Hints:
    """Map the request's cache hints onto it in place: the derived session (the body's
    ``session_id`` where the route has that field, else ``vllm_xargs.session_id``) and the pin
    lease (:data:`PIN_TTL_XARG`). Call after the middleware's own rewrite (which strips
    client-set internal xargs). Returns the hints (empty ones on bad input)."""
    dialect = dialect_for(path)
    if dialect is None:
        return Hints()
    hints = _hints_or_none(payload, path, session_header)
    xargs = payload.get("vllm_xargs")
    if (hints.session_id or hints.pin_ttl_s) and xargs is None:
        xargs = payload["vllm_xargs"] = {}
    if not isinstance(xargs, dict):
        return Hints()  # vLLM refuses the body with its own message
    if hints.session_id:
        if dialect.session_field:
            payload["session_id"] = hints.session_id
        else:
            xargs[SESSION_XARG] = hints.session_id
    if hints.pin_ttl_s:
        xargs[PIN_TTL_XARG] = float(min(hints.pin_ttl_s, MAX_TTL_S))
    return hints


def session_of(payload: dict[str, Any], path: str, session_header: str | None) -> str | None:
    """The session an instance gives this request: the one it names itself (vLLM's order:
    body, header, xargs — the body only where the route has the field), else the one its
    dialect derives (``prompt_cache_key``, Anthropic breakpoints); None without either or when
    its hints are bad (the instance refuses those). Never raises; does not change ``payload``."""
    dialect = dialect_for(path)
    session_field = dialect.session_field if dialect is not None else True
    own = explicit_session(payload, session_header, session_field=session_field)
    if own is not None:
        return own
    return _hints_or_none(payload, path, session_header).session_id
