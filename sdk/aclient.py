"""The asynchronous kvbranch client: :class:`AsyncKVBranchClient` has the methods of
:class:`sdk.client.KVBranchClient`, ``async`` (same arguments, same errors, same retry policy,
awaiting its ``async_sleep`` between attempts).

Like the sync client, this is only a driver: it runs the same flows of :mod:`sdk._core` and
feeds the same :class:`sdk._stream.StreamState`; only sending and reading bytes are its own.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import httpx
from typing_extensions import Unpack

from sdk import contract
from sdk._common import ChatArgs, ForkArgs, SessionArgs
from sdk._core import AsyncClosing, Callback, Done, Flow, Outcome, Request, advance, copy_docs
from sdk._driver import AsyncDriver
from sdk._stream import AsyncChatStream
from sdk.client import KVBranchClient
from sdk.errors import APIConnectionError, KVBranchError, error_from_response, error_from_transport
from sdk.session import AsyncSession
from sdk.types import ChatResult

__all__ = ["AsyncKVBranchClient", "AsyncChatStream"]

T = TypeVar("T")


class AsyncKVBranchClient(AsyncDriver, AsyncClosing):
    """Asynchronous client of a kvbranch (or any OpenAI-compatible) server; the arguments
    are those of :class:`~sdk.KVBranchClient`, with an ``httpx.AsyncBaseTransport``."""

    _http: httpx.AsyncClient

    def _connect(self, transport: httpx.AsyncBaseTransport | None) -> None:
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=self._headers, timeout=self.timeout, transport=transport
        )

    # --- the driver -----------------------------------------------------------------------
    async def _arun(self, flow: Flow[T]) -> T:
        """Run a flow of :mod:`sdk._core` to its result, sending each request it yields."""
        step = advance(flow, Outcome())
        while not isinstance(step, Done):
            try:
                outcome = Outcome(await self._send(step))
            except KVBranchError as exc:
                outcome = Outcome(error=exc)
            step = advance(flow, outcome)
        return cast(T, step.value)

    async def _send(self, request: Request) -> Any:
        async def attempt() -> Any:
            try:
                response = await self._http.request(
                    request.method, request.path, json=request.body, headers=request.headers
                )
            except httpx.HTTPError as exc:
                raise error_from_transport(exc, url=self._url(request.path)) from exc
            return self._read(request, response)

        return await self.retry.acall(attempt)

    async def _open_stream(
        self, request: Request
    ) -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
        """Send a streaming request and read its first bytes, with retries (see
        :meth:`KVBranchClient._open_stream`)."""
        url = self._url(request.path)

        async def attempt() -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
            http_request = self._http.build_request(
                request.method, request.path, json=request.body, headers=request.headers
            )
            try:
                response = await self._http.send(http_request, stream=True)
                try:
                    if response.status_code >= 400:
                        await response.aread()
                        raise error_from_response(response)
                    chunks = response.aiter_bytes()
                    first = await anext(chunks, b"")
                    if not first:
                        raise APIConnectionError(f"{url}: the stream closed before its first byte")
                except BaseException:
                    await response.aclose()
                    raise
            except httpx.HTTPError as exc:
                raise error_from_transport(exc, url=url) from exc
            return response, chunks, first

        return await self.retry.acall(attempt)

    # --- lifecycle ------------------------------------------------------------------------
    async def close(self) -> None:
        await self._http.aclose()

    aclose = close  # httpx's name: ``async with`` and ``contextlib.aclosing`` call it

    # --- discovery ------------------------------------------------------------------------
    async def health(self) -> contract.HealthInfo:
        return await self._arun(self._flows.health())

    async def kvbranch_available(self) -> bool:
        return await self._arun(self._flows.kvbranch_available())

    async def models(self) -> list[str]:
        return await self._arun(self._flows.models())

    async def max_model_len(self, model: str | None = None) -> int | None:
        return await self._arun(self._flows.max_model_len(model))

    async def resolve_model(self, model: str | None = None) -> str:
        return await self._arun(self._flows.resolve_model(model))

    # --- chat -----------------------------------------------------------------------------
    async def chat(
        self, messages: Sequence[Mapping[str, Any]], **args: Unpack[ChatArgs]
    ) -> ChatResult:
        return await self._arun(self._flows.chat(messages, **args))

    async def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        on_complete: Callback | None = None,
        **args: Unpack[ChatArgs],
    ) -> AsyncChatStream:
        request = await self._arun(self._flows.chat_request(messages, stream=True, **args))
        start = time.perf_counter()
        return AsyncChatStream(
            *await self._open_stream(request), start=start, on_complete=on_complete
        )

    # --- sessions and branches ------------------------------------------------------------
    async def session(
        self, session_id: str | None = None, **options: Unpack[SessionArgs]
    ) -> AsyncSession:
        return await self._arun(AsyncSession._opening(self, session_id, options))

    async def create_session(
        self,
        session_id: str | None = None,
        *,
        auto_pin: bool = True,
        pin_ttl_s: float | None = None,
    ) -> contract.SessionInfo:
        return await self._arun(
            self._flows.create_session(session_id, auto_pin=auto_pin, pin_ttl_s=pin_ttl_s)
        )

    async def get_session(self, session_id: str) -> contract.SessionInfo:
        return await self._arun(self._flows.get_session(session_id))

    async def delete_session(self, session_id: str) -> contract.DeleteResult:
        return await self._arun(self._flows.delete_session(session_id))

    async def list_branches(self, session_id: str) -> list[contract.BranchInfo]:
        return await self._arun(self._flows.list_branches(session_id))

    async def get_branch(self, session_id: str, branch_id: str) -> contract.BranchInfo:
        return await self._arun(self._flows.get_branch(session_id, branch_id))

    async def fork_branch(self, session_id: str, **fork: Unpack[ForkArgs]) -> contract.BranchInfo:
        return await self._arun(self._flows.fork_branch(session_id, **fork))

    async def delete_branch(self, session_id: str, branch_id: str) -> contract.DeleteResult:
        return await self._arun(self._flows.delete_branch(session_id, branch_id))

    async def pin_branch(
        self, session_id: str, branch_id: str, ttl_s: float
    ) -> contract.BranchInfo:
        return await self._arun(self._flows.pin_branch(session_id, branch_id, ttl_s))

    async def unpin_branch(self, session_id: str, branch_id: str) -> contract.BranchInfo:
        return await self._arun(self._flows.unpin_branch(session_id, branch_id))

    async def prefetch_branch(
        self, session_id: str, branch_id: str, to_device: bool = False
    ) -> contract.PrefetchResult:
        return await self._arun(self._flows.prefetch_branch(session_id, branch_id, to_device))

    async def stats(self) -> contract.Stats:
        return await self._arun(self._flows.stats())


copy_docs(AsyncKVBranchClient, KVBranchClient)
