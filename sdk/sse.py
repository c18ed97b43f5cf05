"""Incremental Server-Sent Events parser (the WHATWG event-stream format), transport-free.

Feed it bytes as they arrive, in chunks of any size (an event, a line, a UTF-8 character may
be split across chunks); it yields complete :class:`ServerSentEvent`\\ s. Lines end in
``\\n``, ``\\r\\n`` or ``\\r``; ``:`` lines are comments; ``data`` lines of one event are joined
with ``\\n``; unknown fields and malformed lines (no colon: a field name with an empty value)
are ignored as the format requires. At the end of the stream a last event that had data but no
closing blank line is still delivered (servers that close right after the last line lose
nothing).
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass

__all__ = ["ServerSentEvent", "SSEDecoder", "iter_sse", "aiter_sse"]


@dataclass(frozen=True)
class ServerSentEvent:
    data: str
    event: str = "message"
    id: str | None = None
    retry: int | None = None


class SSEDecoder:
    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""  # text after the last complete line
        self._data: list[str] = []
        self._event = ""
        self._id: str | None = None
        self._retry: int | None = None
        self._has_field = False

    def feed(self, chunk: bytes) -> list[ServerSentEvent]:
        """Events completed by ``chunk``."""
        text = self._pending + self._utf8.decode(chunk)
        events: list[ServerSentEvent] = []
        start = 0
        n = len(text)
        while True:
            # Find the next line terminator: \r\n, \n or \r.
            i = start
            while i < n and text[i] not in "\r\n":
                i += 1
            if i >= n:
                break
            if text[i] == "\r":
                if i + 1 >= n:
                    break  # a lone \r at the end may be the first half of \r\n: wait
                end = i + 2 if text[i + 1] == "\n" else i + 1
            else:
                end = i + 1
            event = self._line(text[start:i])
            if event is not None:
                events.append(event)
            start = end
        self._pending = text[start:]
        return events

    def close(self) -> list[ServerSentEvent]:
        """End of stream: the last line and event, if any."""
        events: list[ServerSentEvent] = []
        tail = self._pending + self._utf8.decode(b"", final=True)
        self._pending = ""
        if tail.endswith("\r"):
            tail = tail[:-1]
        for line in tail.split("\n") if tail else []:
            event = self._line(line)
            if event is not None:
                events.append(event)
        if self._data:
            event = self._line("")
            if event is not None:
                events.append(event)
        return events

    def _line(self, line: str) -> ServerSentEvent | None:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None  # comment (keep-alive)
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
            self._has_field = True
        elif name == "event":
            self._event = value
        elif name == "id":
            if "\0" not in value:
                self._id = value
        elif name == "retry":
            if value.isdigit():
                self._retry = int(value)
        # anything else: ignored
        return None

    def _dispatch(self) -> ServerSentEvent | None:
        if not self._has_field:
            self._event = ""
            return None
        event = ServerSentEvent(
            data="\n".join(self._data),
            event=self._event or "message",
            id=self._id,
            retry=self._retry,
        )
        self._data = []
        self._event = ""
        self._has_field = False
        return event


def iter_sse(chunks: Iterable[bytes]) -> Iterator[ServerSentEvent]:
    decoder = SSEDecoder()
    for chunk in chunks:
        yield from decoder.feed(chunk)
    yield from decoder.close()


async def aiter_sse(chunks: AsyncIterable[bytes]) -> AsyncIterator[ServerSentEvent]:
    decoder = SSEDecoder()
    async for chunk in chunks:
        for event in decoder.feed(chunk):
            yield event
    for event in decoder.close():
        yield event
