"""Strict types for the request fields the router reads or rewrites, with vLLM's own rules for
them — checked before any leg runs.

The router rewrites a turn's prefill leg (``max_tokens=1``, ``stream=false``, ``n=1``, no
``stream_options``, ``min_tokens`` at most 1), so P validates *those* values, and a request
whose own values D refuses (``min_tokens`` 5 > ``max_tokens`` 2) used to cost P the whole
prompt's prefill and a hold before D's 400. And the router acts on a field only when it has
the JSON type it expects: ``"stream": 1`` is streamed by vLLM (pydantic's lax mode) while the
router waited for JSON — a 503 after D had generated. So each of these fields is ``null`` or
the JSON type vLLM's schema names, in vLLM's ranges, else 400 naming it; a request that passes
is one P and D validate alike. (Rules of vLLM 0.32: ``SamplingParams._verify_args`` and the
request models' validators; a unit test pins each against vLLM's own models.)
"""

from __future__ import annotations

from typing import Any

__all__ = ["field_problem"]

#: Integer fields: (name, least value).
_INTS = (
    ("max_tokens", 1),
    ("max_completion_tokens", 1),
    ("max_output_tokens", 1),
    ("min_tokens", 0),
    ("n", 1),
)
#: Past this an integer is no count of tokens or answers (and no C type holds it).
_MAX_INT = 2**31 - 1


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def field_problem(payload: dict[str, Any]) -> tuple[str, str] | None:
    """``(param, message)`` for the first field the router reads that has the wrong type or
    breaks vLLM's rules for it, else None."""
    stream = payload.get("stream")
    if stream is not None and not isinstance(stream, bool):
        return "stream", f"'stream' must be true or false, got {type(stream).__name__}"
    for name, least in _INTS:
        value = payload.get(name)
        if value is None:
            continue
        if not _is_int(value):
            return name, f"'{name}' must be an integer, got {type(value).__name__}"
        if not least <= value <= _MAX_INT:
            return name, f"'{name}' must be between {least} and {_MAX_INT}, got {value}"
    options = payload.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            return "stream_options", "'stream_options' must be an object"
        if options and not stream:  # vLLM's rule: an empty object passes
            return "stream_options", "Stream options can only be defined when `stream=True`."
        for flag in ("include_usage", "continuous_usage_stats"):
            if options.get(flag) is not None and not isinstance(options[flag], bool):
                return f"stream_options.{flag}", f"'{flag}' must be true or false"
    limit = payload.get("max_completion_tokens")
    if limit is None:
        limit = payload.get("max_tokens")
    least = payload.get("min_tokens")
    if least is not None and limit is not None and least > limit:
        return "min_tokens", (
            f"min_tokens must be less than or equal to max_tokens={limit}, got {least}."
        )
    return None
