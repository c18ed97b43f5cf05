"""The state of a streamed chat answer, shared by :class:`sdk.ChatStream` and
:class:`sdk.AsyncChatStream`: SSE decoding, events to chunks, time to first token, the
accumulated answer, and the end-of-stream checks. The two stream classes only read bytes
(``for`` or ``async for``) and feed them here, so the stream's rules are written once. Both
live here, below the clients that open them and the sessions that return them (the clients
re-export them: ``sdk.client.ChatStream``, ``sdk.aclient.AsyncChatStream``)."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from typing import Generic, TypeVar

import httpx

from sdk._common import CHAT_PATH
from sdk._core import AsyncClosing, Closing, copy_docs
from sdk.errors import APIResponseError, StreamInterruptedError, error_from_response
from sdk.sse import ServerSentEvent, SSEDecoder
from sdk.types import ChatAccumulator, ChatChunk, ChatResult

__all__ = ["StreamState", "ChatStream", "AsyncChatStream", "event_to_chunk"]

Chunks = TypeVar("Chunks")


def event_to_chunk(event: ServerSentEvent) -> ChatChunk | None:
    """A chat chunk, or ``None`` for ``[DONE]``. An ``{"error": ...}`` event raises the
    server's error; unreadable JSON raises :class:`APIResponseError`."""
    data = event.data.strip()
    if data == "[DONE]":
        return None
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise APIResponseError(f"malformed stream event (not JSON): {data[:200]!r}") from exc
    if isinstance(obj, dict) and isinstance(obj.get("error"), dict):
        err = obj["error"]
        status = err.get("code") if isinstance(err.get("code"), int) else 500
        response = httpx.Response(status, json=obj, request=httpx.Request("POST", CHAT_PATH))
        raise error_from_response(response)
    return ChatChunk.from_openai(obj)


class StreamState(Generic[Chunks]):
    """An open streamed answer, less its I/O: the response, its byte chunks (an iterator or
    an async iterator) and the first bytes, already read. ``ttft_s`` is set at the first
    content or tool-call delta; ``result`` (a :class:`ChatResult`) once the stream finished."""

    def __init__(
        self,
        response: httpx.Response,
        chunks: Chunks,
        first: bytes,
        *,
        start: float,
        on_complete: Callable[[ChatResult], None] | None = None,
    ) -> None:
        self._response = response
        self._chunks = chunks
        self._first = first
        self._start = start
        self._on_complete = on_complete
        self._decoder = SSEDecoder()
        self._acc = ChatAccumulator()
        self._result: ChatResult | None = None
        self._iterated = False
        self._done = False
        self.ttft_s: float | None = None

    @property
    def result(self) -> ChatResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished: iterate it (or call final()) first")
        return self._result

    @property
    def text(self) -> str:
        """The content received so far."""
        return "".join(self._acc.text)

    def _begin(self) -> None:
        if self._iterated:
            raise RuntimeError(f"a {type(self).__name__} can be iterated only once")
        self._iterated = True

    def _feed(self, raw: bytes) -> Iterator[ChatChunk]:
        """The chunks ``raw`` completes, up to ``[DONE]``."""
        return self._take(self._decoder.feed(raw))

    def _close(self) -> Iterator[ChatChunk]:
        """End of the bytes: the last event, if the stream did not end with ``[DONE]``."""
        return self._take(() if self._done else self._decoder.close())

    def _take(self, events: Iterable[ServerSentEvent]) -> Iterator[ChatChunk]:
        for event in events:
            chunk = event_to_chunk(event)
            if chunk is None:
                self._done = True
                return
            if self.ttft_s is None and (chunk.content or chunk.tool_calls):
                self.ttft_s = time.perf_counter() - self._start
            self._acc.add(chunk)
            yield chunk

    def _interrupted(self, exc: httpx.HTTPError) -> StreamInterruptedError:
        return StreamInterruptedError(
            f"the stream broke after {self._acc.chunks} chunks: {exc or type(exc).__name__}"
            "; not retried (it would run the generation again)"
        )

    def _finish(self) -> None:
        if not self._done and self._acc.finish_reason is None:
            raise StreamInterruptedError(
                "the stream ended before the answer finished (no "
                "finish_reason, no [DONE]); not retried"
            )
        self._result = self._acc.result(
            ttft_s=self.ttft_s, latency_s=time.perf_counter() - self._start
        )
        if self._on_complete is not None:
            self._on_complete(self._result)


class ChatStream(StreamState[Iterator[bytes]], Closing):
    """An open streamed answer. Iterate it for :class:`ChatChunk`\\ s (content deltas,
    tool-call deltas, finish reason, and last the usage chunk with the kvbranch split).

    ``ttft_s`` is set at the first content or tool-call delta; ``result`` (a
    :class:`ChatResult`) once the stream finished. A stream that breaks midway raises
    :class:`~sdk.errors.StreamInterruptedError` and is not retried. Use it as a context
    manager, or call :meth:`close`, when not reading it to the end.
    """

    def final(self) -> ChatResult:
        """Read the rest of the stream; the whole answer."""
        for _ in self:
            pass
        return self.result

    def __iter__(self) -> Iterator[ChatChunk]:
        self._begin()
        try:
            for raw in self._raw_chunks():
                yield from self._feed(raw)
                if self._done:
                    break
            yield from self._close()
        finally:
            self.close()
        self._finish()

    def _raw_chunks(self) -> Iterator[bytes]:
        yield self._first
        try:
            yield from self._chunks
        except httpx.HTTPError as exc:
            raise self._interrupted(exc) from exc

    def close(self) -> None:
        self._response.close()


class AsyncChatStream(StreamState[AsyncIterator[bytes]], AsyncClosing):
    """An open streamed answer: ``async for chunk in stream``. Same contract as
    :class:`sdk.client.ChatStream` (``ttft_s``, ``result``, ``final()``, ``aclose()``,
    ``async with``)."""

    async def final(self) -> ChatResult:
        async for _ in self:
            pass
        return self.result

    def __aiter__(self) -> AsyncIterator[ChatChunk]:
        self._begin()
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ChatChunk]:
        try:
            async for raw in self._raw_chunks():
                for chunk in self._feed(raw):
                    yield chunk
                if self._done:
                    break
            for chunk in self._close():
                yield chunk
        finally:
            await self.aclose()
        self._finish()

    async def _raw_chunks(self) -> AsyncIterator[bytes]:
        yield self._first
        try:
            async for raw in self._chunks:
                yield raw
        except httpx.HTTPError as exc:
            raise self._interrupted(exc) from exc

    async def aclose(self) -> None:
        await self._response.aclose()


copy_docs(AsyncChatStream, ChatStream)
