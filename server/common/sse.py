"""Server-sent events as kvbranch rewrites them in flight: the plugin's middleware puts the
prompt-source split into a stream's usage chunk, and the P/D router takes transfer params out
of the stream it relays. Both cut the byte stream into events and re-encode a chunk the same
way, with this module (no vLLM, no plugin: the router imports it alone).

An event here is the bytes between two blank lines, without the terminator. Only ``data: {``
events that contain one of the caller's markers are parsed: the byte test is cheap and most
events (token deltas) pass untouched.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from sdk.contract.wire import SSE_DATA, SSE_EVENT_END

__all__ = ["DATA", "EVENT_END", "EventSplitter", "encode_event", "json_event", "rewrite_events"]

DATA = SSE_DATA
EVENT_END = SSE_EVENT_END
_JSON_DATA = DATA + b"{"

#: Rewrites one event; None drops it.
Rewrite = Callable[[bytes], "bytes | None"]


class EventSplitter:
    """Cuts a byte stream into complete events; a partial event waits for the next bytes."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> list[bytes]:
        """The events ``data`` completes (without their terminator)."""
        self._buffer += data
        if EVENT_END not in self._buffer:
            return []
        *events, self._buffer = self._buffer.split(EVENT_END)
        return events

    def rest(self) -> bytes:
        """What is left after the last terminator (a stream that ended mid-event)."""
        rest, self._buffer = self._buffer, b""
        return rest


def json_event(event: bytes, *markers: bytes) -> dict[str, Any] | None:
    """The JSON object of a ``data:`` event that contains one of ``markers`` (any event when
    none are given); None for any other event or one that is not a JSON object."""
    if not event.startswith(_JSON_DATA) or (markers and not any(m in event for m in markers)):
        return None
    try:
        chunk = json.loads(event[len(DATA) :])
    except ValueError:
        return None
    return chunk if isinstance(chunk, dict) else None


def encode_event(chunk: dict[str, Any]) -> bytes:
    """A ``data:`` event of ``chunk`` (compact JSON, as vLLM writes its chunks)."""
    return DATA + json.dumps(chunk, separators=(",", ":")).encode()


def rewrite_events(events: Iterable[bytes], rewrite: Rewrite) -> bytes:
    """The rewritten events, each with its terminator; dropped events leave nothing."""
    out = []
    for event in events:
        rewritten = rewrite(event)
        if rewritten is not None:
            out.append(rewritten + EVENT_END)
    return b"".join(out)
