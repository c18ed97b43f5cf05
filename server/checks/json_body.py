"""A request's JSON body, parsed once by the guard and refused (400) when no layer after it
could handle it: nested deeper than :data:`MAX_JSON_DEPTH`, or holding a lone UTF-16 surrogate.

Both are valid JSON that Python parses, and both used to break *after* the parse:

* ``json.loads`` of ``[[[[...]]]]`` raises ``RecursionError`` (not a ``ValueError``) near
  Python's recursion limit, and a body just under it breaks the next recursive walk (the
  middleware's re-encoding, the dialects, pydantic) instead — a 500, not the client's error.
* ``"\\ud800"`` (a lone surrogate, as JSON allows) becomes a ``str`` that cannot be encoded as
  UTF-8: every digest of it (``prompt_cache_key``, ``cache_salt``, an Anthropic prefix), the
  tokenizer and any answer echoing it raise ``UnicodeEncodeError`` — and an exception raised in
  an ASGI layer after vLLM's handler answered it makes uvicorn drop the keep-alive connection.

:func:`parse` answers ``(payload, problem)``: ``problem`` is ``(param, message)`` naming where
the body is wrong (``messages[0].content[1].text``), for the guard's 400. A body that is not
JSON at all is no problem here (``(None, None)``): the route answers it in its own words.
The checks cost a few byte scans on ordinary bodies; past those, one C-level pass (the
nesting level by level, a re-encoding for surrogates), and a Python walk over the parsed value
only to name the place of a problem found.
"""

from __future__ import annotations

import json
import re
from collections import deque
from itertools import chain, compress
from typing import Any

from sdk.contract.wire import MAX_JSON_DEPTH, has_lone_surrogate

__all__ = ["MAX_JSON_DEPTH", "parse", "problem_of"]

Problem = tuple[str, str]
#: ``\ud800``-``\udfff`` escaped, or raw (UTF-8-style bytes ED A0..BF, which ``json.loads``
#: decodes with ``surrogatepass``); valid pairs match too, the walk tells them apart.
_SURROGATE_BYTES = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")
_BODY = "body"
_TOO_DEEP = "request body is nested too deeply: at most {limit} levels of JSON arrays and objects"


def _safe(text: str) -> str:
    """``text`` with any lone surrogate written as ``\\udXXX`` (for a param name)."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _path(trail: Any) -> str:
    keys: list[Any] = []
    while trail is not None:
        trail, key = trail
        keys.append(key)
    out = ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else (f".{_safe(key)}" if out else _safe(key))
    return out or _BODY


def _surrogate_message(where: str, text: str) -> str:
    first = ascii(next(c for c in text if 0xD800 <= ord(c) <= 0xDFFF))[1:-1]
    return (
        f"{where} is not valid Unicode: it contains a lone UTF-16 surrogate ({first}); "
        "send text as UTF-8, or escape a character outside the BMP as a surrogate pair"
    )


def problem_of(payload: Any, *, depth: bool = True, strings: bool = True) -> Problem | None:
    """``(param, message)`` for the shallowest value of a parsed body nested deeper than
    :data:`MAX_JSON_DEPTH` or holding a lone surrogate (in a key or a string), else None.
    Iterative: safe on any depth ``json.loads`` returned."""
    if strings and isinstance(payload, str) and has_lone_surrogate(payload):
        return _BODY, _surrogate_message(_BODY, payload)
    if not isinstance(payload, (dict, list)):
        return None
    queue: deque[tuple[Any, int, Any]] = deque([(payload, 1, None)])
    while queue:
        value, level, trail = queue.popleft()
        if depth and level > MAX_JSON_DEPTH:
            return _path(trail), _TOO_DEEP.format(limit=MAX_JSON_DEPTH)
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if strings and isinstance(key, str) and has_lone_surrogate(key):
                where = _path((trail, key))
                return where, _surrogate_message(f"the key of {where}", key)
            if isinstance(item, (dict, list)):
                queue.append((item, level + 1, (trail, key)))
            elif strings and isinstance(item, str) and has_lone_surrogate(item):
                where = _path((trail, key))
                return where, _surrogate_message(where, item)
    return None


def parse(body: bytes) -> tuple[Any, Problem | None]:
    """The body's JSON value (None when it is not JSON) and its problem, if any."""
    if not body:
        return None, None
    try:
        payload = json.loads(body)
    except RecursionError:
        return None, (_BODY, _TOO_DEEP.format(limit=MAX_JSON_DEPTH))
    except ValueError:  # not JSON (or not UTF-8): the route answers it itself
        return None, None
    deep = body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and _too_deep(payload)
    # UTF-16/32 bodies (json.loads takes them too) hide their escapes from the byte scan.
    utf8 = json.detect_encoding(body) in ("utf-8", "utf-8-sig")
    maybe = not utf8 or _SURROGATE_BYTES.search(body) is not None  # valid pairs match too
    strings = maybe and not deep and not _encodable(payload)
    if not deep and not strings:
        return payload, None
    return payload, problem_of(payload, depth=deep, strings=strings)  # where: the slow walk


def _children(value: Any) -> Any:
    return value.values() if value.__class__ is dict else value


_IS_CONTAINER = frozenset((dict, list)).__contains__


def _too_deep(payload: Any) -> bool:
    """Whether ``payload`` nests deeper than :data:`MAX_JSON_DEPTH`: one level at a time, the
    per-value work in C (``map``/``compress``), Python only once per container."""
    level = [payload] if payload.__class__ in (dict, list) else []
    for _ in range(MAX_JSON_DEPTH):
        if not level:
            return False
        values = list(chain.from_iterable(map(_children, level)))
        level = list(compress(values, map(_IS_CONTAINER, map(type, values))))
    return bool(level)


def _encodable(payload: Any) -> bool:
    """Whether every string (and key) of ``payload`` encodes as UTF-8: one C-level pass."""
    try:
        json.dumps(payload, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
