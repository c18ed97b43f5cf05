"""Relaying an instance's answer to the client, taking out what only the router should see.

The generating instance's answer carries D's returned transfer params (``kv_transfer_params``):
in the JSON body, or — on a stream, where vLLM 0.32 returns none — in the usage chunk, where
the kvbranch middleware puts them. The router files them in its index for the next turn's pull
and removes them from what the client gets. It also puts P's prompt-source split (the
``kvbranch`` object: P ran the prefill, so P's split is the turn's) over D's, and drops the
usage chunk it asked for itself when the client did not ask for one.

A client that leaves mid-stream closes the upstream response, so D sees the disconnect and
aborts the request. An instance that stops mid-stream (its engine died, its connection broke)
leaves the client an error event, never a clean end: a cut answer must not pass for a short
complete one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
from fastapi.responses import Response, StreamingResponse

from sdk.contract import RESPONSE_FIELD, TRANSFER_PARAMS_FIELD, error_body
from sdk.contract.wire import SSE_DATA, SSE_EVENT_END
from server.common.sse import EventSplitter, Rewrite, encode_event, json_event, rewrite_events

#: Called with the transfer params an answer carried (whatever they are; the caller checks).
FileParams = Callable[[Any], None]


def passthrough(r: httpx.Response, headers: dict[str, str] | None = None) -> Response:
    """An instance's answer, as it answered (status, body, content type)."""
    return Response(
        r.content,
        status_code=r.status_code,
        media_type=r.headers.get("content-type"),
        headers=headers,
    )


def ask_for_usage(body: dict[str, Any]) -> bool:
    """Make the instance send the usage chunk (D's params ride on it); returns whether the
    client asked for it itself."""
    options = body.get("stream_options")
    want_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    body["stream_options"] = dict(options if isinstance(options, dict) else {}, include_usage=True)
    return want_usage


def rewrite_json(data: dict[str, Any], file_params: FileParams, split: Any) -> dict[str, Any]:
    """A non-streaming answer: file its transfer params, put P's split in."""
    file_params(data.pop(TRANSFER_PARAMS_FIELD, None))
    if split is not None:
        data[RESPONSE_FIELD] = split
    return data


_MARKERS = (b'"usage"', TRANSFER_PARAMS_FIELD.encode())


def rewrite_event(
    event: bytes, file_params: FileParams, split: Any, want_usage: bool
) -> bytes | None:
    """One SSE event (without its blank-line terminator): file and remove transfer params,
    put P's split in; None drops the event (the usage chunk the client did not ask for)."""
    chunk = json_event(event, *_MARKERS)
    if chunk is None:
        return event
    file_params(chunk.pop(TRANSFER_PARAMS_FIELD, None))
    if chunk.get("usage") and not chunk.get("choices") and not want_usage:
        return None  # the client did not ask for the usage chunk; we did
    if split is not None and RESPONSE_FIELD in chunk:
        chunk[RESPONSE_FIELD] = split
    return encode_event(chunk)


class _Upstream:
    """Closes the instance's response and runs ``on_close`` exactly once, however the relay
    ends: after the last event, when the client leaves mid-stream, or when it leaves before
    the first event (then the event generator never ran, and its ``finally`` neither)."""

    def __init__(
        self,
        resp: httpx.Response,
        on_close: Callable[[], None],
        on_first: Callable[[], None] | None = None,
        chunks: AsyncIterator[bytes] | None = None,
    ) -> None:
        self.resp = resp
        #: The body's raw chunks: the response's own, or what is left of them (with the
        #: chunks already read put back) when the caller read the first one itself.
        self.chunks = chunks if chunks is not None else resp.aiter_raw()
        self._on_close: Callable[[], None] | None = on_close
        self._on_first = on_first

    def first(self) -> None:
        """The instance's first bytes arrived (or the relay ended before any): ``on_first``
        runs once."""
        on_first, self._on_first = self._on_first, None
        if on_first is not None:
            on_first()

    async def close(self) -> None:
        self.first()
        on_close, self._on_close = self._on_close, None
        if on_close is None:
            return
        try:
            on_close()
        finally:
            await self.resp.aclose()  # a client that left: D sees the disconnect and aborts


#: The event that ends a complete OpenAI stream.
DONE_EVENT = SSE_DATA + b"[DONE]"


def cut_short_event(why: str) -> bytes:
    """The error event a relayed stream ends with when the instance's stream stopped before
    its ``[DONE]``: OpenAI's shape for an error in a stream (the ``openai`` client and the
    sdk raise on it), so a client never takes a cut answer for a short complete one."""
    message = f"the answer is incomplete: the instance's stream ended before its end ({why})"
    return encode_event(error_body(502, message)) + SSE_EVENT_END


async def relay_events(upstream: _Upstream, rewrite: Rewrite) -> AsyncIterator[bytes]:
    """The upstream stream, each complete event passed through ``rewrite``; a trailing partial
    event passes as is. A stream that stops before ``[DONE]`` — the instance closed it, or the
    connection broke — ends with :func:`cut_short_event` instead of a clean end. The upstream
    is released however it ends."""
    events = EventSplitter()
    done = False
    try:
        try:
            async for data in upstream.chunks:
                upstream.first()
                complete = events.feed(data)
                done = done or DONE_EVENT in complete
                out = rewrite_events(complete, rewrite)
                if out:
                    yield out
        except httpx.HTTPError as exc:  # the instance went away mid-answer
            if not done:
                yield cut_short_event(type(exc).__name__)
            return
        rest = events.rest()
        done = done or rest.strip() == DONE_EVENT
        if rest:
            yield rest
        if not done:
            yield cut_short_event("no [DONE]")
    finally:
        await upstream.close()


class _RelayedStream(StreamingResponse):
    """A streaming response that releases the upstream stream whatever happens to it."""

    def __init__(self, content: AsyncIterator[bytes], upstream: _Upstream, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._upstream = upstream

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._upstream.close()


def relay_stream(
    resp: httpx.Response,
    file_params: FileParams,
    split: Any,
    want_usage: bool,
    on_close: Callable[[], None],
    headers: dict[str, str],
    on_first: Callable[[], None] | None = None,
    chunks: AsyncIterator[bytes] | None = None,
) -> StreamingResponse:
    """The client's streaming response for an open upstream stream. ``on_first`` runs once,
    when the instance's first bytes arrive (its prompt is computed) or the relay ends.
    ``chunks``: the body's raw chunks when the caller has read some (:func:`put_back`)."""

    def rewrite(event: bytes) -> bytes | None:
        return rewrite_event(event, file_params, split, want_usage)

    upstream = _Upstream(resp, on_close, on_first, chunks)
    return _RelayedStream(
        relay_events(upstream, rewrite),
        upstream,
        media_type="text/event-stream",
        headers=headers,
    )


async def put_back(head: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """A body's raw chunks with the first one, already read, in front again."""
    if head:
        yield head
    async for data in rest:
        yield data
