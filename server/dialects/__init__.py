"""Shared by the router's process and vLLM's API server (the plugin): clients' cache hints.
Pure; imports only sdk.contract and itself.

Cache hints in the clients' own dialects, mapped onto kvbranch sessions and pins.

Users arrive with the clients they already have; those already speak a cache-hint dialect:
OpenAI's ``prompt_cache_key`` / ``prompt_cache_retention`` / ``prompt_cache_options``
(:mod:`server.dialects.openai`) and Anthropic's ``cache_control`` breakpoints
(:mod:`server.dialects.anthropic`). Each is a :class:`~server.dialects.base.Dialect`; the
registry (:mod:`server.dialects.registry`) is what the guard, the middleware and the P/D router
call. An explicit session always wins over a derived one; a hint the server cannot use is a 400
naming the field.

Pure (dicts in, dicts out; only ``sdk.contract`` and the standard library), so the router and
the plugin share it; what needs the engine (counting an Anthropic prefix's tokens) is asked of
an :class:`~server.dialects.base.Engine` the plugin provides. Adding a dialect: one module with
its class, its entry in :data:`~server.dialects.registry.DIALECTS`, and its tests.
"""

from server.dialects.base import Dialect, DialectError, Engine, Hints, UsageRewrite
from server.dialects.registry import DIALECTS, apply, dialect_for, hints_of, problem, session_of

__all__ = [
    "DIALECTS",
    "Dialect",
    "DialectError",
    "Engine",
    "Hints",
    "UsageRewrite",
    "apply",
    "dialect_for",
    "hints_of",
    "problem",
    "session_of",
]
