"""The request headers the cluster reads or forwards, checked before anything acts on them.

* Sent twice, a header that decides whose request it is or where its KV lives would be read
  one way by the router's index and another by the instance: refused (400).
* Not printable ASCII (a raw ``0xE9`` byte, a control character): HTTP header values are
  ASCII in practice, httpx refuses to send anything else, and a key or an id is never
  anything else — so such a header is the client's error (400), not the router's 500 when it
  forwards it.

Works on raw ASGI headers (``scope["headers"]``: a list of ``(name, value)`` byte pairs), so
the router's outermost layer runs it before any route reads a header.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sdk.contract import BRANCH_HEADER, SESSION_HEADER

__all__ = ["CHECKED_HEADERS", "SINGLE_HEADERS", "header", "header_problem"]

#: Headers that decide whose request it is and where its KV lives: at most once each.
SINGLE_HEADERS = frozenset(
    {b"authorization", SESSION_HEADER.lower().encode(), BRANCH_HEADER.lower().encode()}
)
#: Every header the router reads or forwards to an instance: printable ASCII only.
CHECKED_HEADERS = SINGLE_HEADERS | {b"content-type"}
#: Visible ASCII, space and horizontal tab (RFC 9110's field-value, without obs-text).
_ALLOWED = frozenset(range(0x20, 0x7F)) | {0x09}


def header_problem(headers: Iterable[tuple[bytes, bytes]]) -> tuple[str, str] | None:
    """``(header, message)`` for the first header of :data:`CHECKED_HEADERS` that is repeated
    (one of :data:`SINGLE_HEADERS`) or not printable ASCII, else None."""
    seen: set[bytes] = set()
    for raw_name, value in headers:
        name = raw_name.lower()
        if name not in CHECKED_HEADERS:
            continue
        shown = name.decode("latin-1")
        if name in SINGLE_HEADERS:
            if name in seen:
                return shown, f"header {shown!r} is sent more than once"
            seen.add(name)
        if not _ALLOWED.issuperset(value):
            return shown, (
                f"header {shown!r} must be printable ASCII (keys and ids are): "
                "it holds a byte outside 0x20-0x7E"
            )
    return None


def header(scope: dict[str, Any], name: str) -> str | None:
    """An ASGI request header by case-insensitive name (latin-1, as HTTP carries bytes)."""
    key = name.lower().encode()
    for k, v in scope.get("headers", []):
        if k.lower() == key:
            value: str = v.decode("latin-1")
            return value
    return None
