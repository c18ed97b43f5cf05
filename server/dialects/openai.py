"""OpenAI's cache hints (chat completions, completions, responses).

``prompt_cache_key`` names the request's cache entry — kvbranch makes it the request's
*session* (exactly what ``session_id``/``X-Session-ID`` do, so it is scoped to the caller's
tenant the same way: the registry keys sessions by (tenant, id)). A key that is a kvbranch id
is used as is (then ``/v1/kvbranch/sessions/<key>`` addresses it); any other string becomes
``pck-`` + a digest of it. ``prompt_cache_retention`` (``"in_memory"``/``"in-memory"``: the
server's default lease; ``"24h"`` or another duration up to 24 h) and
``prompt_cache_options.ttl`` (``"30m"``) become the *pin lease* of the session's branch; the pin
is budget-capped like any automatic pin (it degrades to LRU retention, it never fails the
request). ``usage.prompt_tokens_details.cached_tokens`` stays vLLM's number (no usage rewrite).
"""

from __future__ import annotations

from typing import Any

from sdk.contract import (
    CACHE_KEY_SESSION_PREFIX,
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    PROMPT_CACHE_KEY_FIELD,
    PROMPT_CACHE_OPTIONS_FIELD,
    PROMPT_CACHE_RETENTION_FIELD,
    RESPONSES_PATH,
    check_id,
)
from sdk.contract.wire import has_lone_surrogate
from server.dialects.base import DialectError, Hints, digest, is_duration, parse_duration

#: Routes whose body takes OpenAI's cache hints (and has vLLM's ``session_id`` field).
OPENAI_PATHS = (CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, RESPONSES_PATH)
#: Retention values meaning "the server's default lease" (OpenAI spells it with ``_``).
IN_MEMORY = ("in_memory", "in-memory")
MAX_CACHE_KEY_CHARS = 1024


def parse_retention(value: Any) -> float | None:
    """OpenAI's ``prompt_cache_retention`` → pin lease in seconds, or None for the server's
    default lease (``in_memory``) or no hint."""
    param = PROMPT_CACHE_RETENTION_FIELD
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in IN_MEMORY:
        return None
    if not is_duration(value):
        raise DialectError(
            param,
            f"{param} must be 'in_memory' (also 'in-memory') or a "
            f"duration such as '24h' (at most 24h), got {value!r}",
        )
    return parse_duration(value, param)


def parse_cache_options(value: Any) -> float | None:
    """OpenAI's ``prompt_cache_options`` (``{"mode": ..., "ttl": "30m"}``) → its ttl."""
    param = PROMPT_CACHE_OPTIONS_FIELD
    if value is None:
        return None
    if not isinstance(value, dict):
        raise DialectError(
            param, f"{param} must be an object such as {{'ttl': '30m'}}, got {value!r}"
        )
    mode = value.get("mode")
    if mode is not None and mode not in ("implicit", "explicit"):
        raise DialectError(
            f"{param}.mode", f"{param}.mode must be 'implicit' or 'explicit', got {mode!r}"
        )
    ttl = value.get("ttl")
    return None if ttl is None else parse_duration(ttl, f"{param}.ttl")


def cache_key_session(value: Any) -> str | None:
    """OpenAI's ``prompt_cache_key`` → a session id: the key itself when it is a valid id,
    else ``pck-`` + a digest of it; None when absent or empty."""
    param = PROMPT_CACHE_KEY_FIELD
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise DialectError(param, f"{param} must be a string, got {type(value).__name__}")
    if len(value) > MAX_CACHE_KEY_CHARS:
        raise DialectError(
            param, f"{param} must be at most {MAX_CACHE_KEY_CHARS} characters, got {len(value)}"
        )
    if has_lone_surrogate(value):  # no UTF-8 for a digest, nor for vLLM's echo of the key
        raise DialectError(
            param,
            f"{param} must be valid Unicode: it contains a lone UTF-16 surrogate, got "
            f"{ascii(value)[:80]}",
        )
    try:
        return check_id(value, param)
    except ValueError:
        return digest(CACHE_KEY_SESSION_PREFIX, value.encode("utf-8"))


class OpenAIDialect:
    """``prompt_cache_key`` → session; ``prompt_cache_retention`` / ``prompt_cache_options``
    → pin lease."""

    name: str = "openai"
    paths: tuple[str, ...] = OPENAI_PATHS
    session_field: bool = True

    def check(self, payload: dict[str, Any]) -> None:
        self.hints(payload, own_session=False)

    def hints(self, payload: dict[str, Any], own_session: bool) -> Hints:
        key = cache_key_session(payload.get(PROMPT_CACHE_KEY_FIELD))
        ttls = [
            t
            for t in (
                parse_retention(payload.get(PROMPT_CACHE_RETENTION_FIELD)),
                parse_cache_options(payload.get(PROMPT_CACHE_OPTIONS_FIELD)),
            )
            if t is not None
        ]
        return Hints(session_id=None if own_session else key, pin_ttl_s=max(ttls) if ttls else None)
