"""The chat side of :mod:`sdk.testing`'s fake server: scripted replies, a stand-in tokenizer,
the SSE stream of a chat completion (chunks as vLLM sends them, an injectable break), and the
injected failures (a status with a body, or a transport exception)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from sdk.contract import RESPONSE_FIELD
from sdk.contract.wire import SSE_DATA as DATA
from sdk.contract.wire import SSE_EVENT_END as EVENT_END

__all__ = [
    "EventStream",
    "FakeToolCall",
    "Reply",
    "default_reply",
    "raiser",
    "responder",
    "stream_chunks",
    "tokens",
]


@dataclass
class FakeToolCall:
    name: str
    arguments: str
    id: str = "call_0"


@dataclass
class Reply:
    content: str = ""
    tool_calls: list[FakeToolCall] = field(default_factory=list)
    finish_reason: str | None = None


def default_reply(messages: list[dict[str, Any]]) -> Reply:
    """``"echo <n>: <last user text>"``, n = number of messages: deterministic."""
    last = next((m.get("content") for m in reversed(messages) if m.get("role") == "user"), "")
    return Reply(content=f"echo {len(messages)}: {last}")


def tokens(messages: list[dict[str, Any]]) -> list[str]:
    """A stand-in tokenization: one token per word of each rendered message."""
    out: list[str] = []
    for m in messages:
        out.append(f"<{m.get('role')}>")
        out.extend(str(m.get("content") or "").split())
        for tc in m.get("tool_calls") or []:
            out.append(json.dumps(tc, sort_keys=True))
    return out


def stream_chunks(
    cid: str,
    model: str,
    content: str,
    tool_calls: list[FakeToolCall],
    finish: str,
    usage: dict[str, Any] | None,
    split: dict[str, Any] | None,
    piece: int,
) -> list[dict[str, Any]]:
    """The chunks of a streamed chat completion: content and tool-call arguments in pieces of
    ``piece`` characters, the finish, then (when asked) the usage chunk with the split."""

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return {"id": cid, "object": "chat.completion.chunk", "model": model, "choices": [choice]}

    def pieces(text: str) -> list[str]:
        return [text[i : i + piece] for i in range(0, len(text), piece)]

    chunks = [chunk({"role": "assistant", "content": ""})]
    chunks += [chunk({"content": text}) for text in pieces(content)]
    for index, tc in enumerate(tool_calls):
        function = {"name": tc.name, "arguments": ""}
        start = {"index": index, "id": tc.id, "type": "function", "function": function}
        chunks.append(chunk({"tool_calls": [start]}))
        for text in pieces(tc.arguments):
            chunks.append(
                chunk({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
            )
    chunks.append(chunk({}, finish))
    if usage is not None:
        last: dict[str, Any] = {
            "id": cid,
            "object": "chat.completion.chunk",
            "model": model,
            "choices": [],
            "usage": usage,
        }
        if split is not None:
            last[RESPONSE_FIELD] = split
        chunks.append(last)
    return chunks


class EventStream(httpx.SyncByteStream, httpx.AsyncByteStream):
    """The SSE body of ``chunks`` then ``[DONE]``, readable by the sync and the async client;
    after ``break_after`` events the connection breaks (``httpx.ReadError``)."""

    def __init__(self, chunks: list[dict[str, Any]], break_after: int | None = None) -> None:
        self._events = self._encode(chunks, break_after)

    @staticmethod
    def _encode(chunks: list[dict[str, Any]], break_after: int | None) -> Iterator[bytes]:
        for i, chunk in enumerate(chunks):
            if break_after is not None and i >= break_after:
                raise httpx.ReadError("connection reset by peer (injected)")
            yield DATA + json.dumps(chunk).encode() + EVENT_END
        yield DATA + b"[DONE]" + EVENT_END

    def __iter__(self) -> Iterator[bytes]:
        yield from self._events

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self._events:
            yield chunk


def raiser(exc: Exception) -> Callable[[httpx.Request], httpx.Response]:
    def fail(request: httpx.Request) -> httpx.Response:
        raise exc

    return fail


def responder(
    status: int, payload: Any, headers: dict[str, str] | None
) -> Callable[[httpx.Request], httpx.Response]:
    def fail(request: httpx.Request) -> httpx.Response:
        if isinstance(payload, (bytes, str)):
            return httpx.Response(status, content=payload, headers=headers)
        return httpx.Response(status, json=payload, headers=headers)

    return fail
