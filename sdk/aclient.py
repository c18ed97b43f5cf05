"""The asynchronous kvbranch client: :class:`AsyncKVBranchClient` is
:class:`sdk.client.KVBranchClient` with ``async`` methods (same arguments, same errors,
same retry policy, awaiting its ``async_sleep`` between attempts)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import httpx

from server.contract import (
    HEALTH_PATH,
    SESSIONS_PATH,
    STATS_PATH,
    BranchInfo,
    CreateSessionRequest,
    DeleteResult,
    ForkRequest,
    HealthInfo,
    PinRequest,
    PrefetchResult,
    SessionInfo,
    Stats,
    branch_path,
    branches_path,
    check_id,
    pin_path,
    prefetch_path,
    session_path,
)

from sdk._common import CHAT_PATH, MODELS_PATH, chat_payload
from sdk.client import _ClientBase, _dump, _parse, event_to_chunk, max_model_len_of
from sdk.errors import (
    APIConnectionError,
    APIResponseError,
    NotFoundError,
    StreamInterruptedError,
    error_from_response,
    error_from_transport,
)
from sdk.retry import RetryPolicy
from sdk.sse import SSEDecoder
from sdk.types import ChatAccumulator, ChatChunk, ChatResult

if TYPE_CHECKING:
    from sdk.session import AsyncSession

__all__ = ["AsyncKVBranchClient", "AsyncChatStream"]


class AsyncKVBranchClient(_ClientBase):
    """Asynchronous client of a kvbranch (or any OpenAI-compatible) server.

    Args:
        base_url: server root, e.g. ``http://127.0.0.1:8000`` (``/v1`` suffix accepted);
            default ``$KVBRANCH_BASE_URL``, ``$OPENAI_BASE_URL``, then ``http://127.0.0.1:8000``.
        api_key: sent as ``Authorization: Bearer``; default ``$KVBRANCH_API_KEY``, then
            ``$OPENAI_API_KEY``.
        model: default model of chat calls (else the server's first model).
        timeout: seconds to wait for a response or between stream chunks (connect: 10 s).
        retry: the :class:`RetryPolicy` (default: 4 attempts within 60 s).
        kvbranch: ``True``/``False`` to skip the health probe that decides whether session
            features are used.
        transport: an httpx transport (tests: ``httpx.MockTransport``).
    """

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None,
                 model: str | None = None, timeout: float | httpx.Timeout | None = 600.0,
                 retry: RetryPolicy | None = None,
                 default_headers: Mapping[str, str] | None = None,
                 kvbranch: bool | None = None,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        super().__init__(base_url, api_key, model, timeout, retry, default_headers, kvbranch)
        self._http = httpx.AsyncClient(base_url=self.base_url, headers=self._headers,
                                  timeout=self.timeout, transport=transport)

    # --- lifecycle ------------------------------------------------------------------------
    async def close(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncKVBranchClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    # --- plumbing -------------------------------------------------------------------------
    async def _send(self, method: str, path: str, body: Any = None,
              headers: Mapping[str, str] | None = None) -> Any:
        async def attempt() -> Any:
            try:
                response = await self._http.request(method, path, json=body, headers=headers)
            except httpx.HTTPError as exc:
                raise error_from_transport(exc, url=f"{self.base_url}{path}") from exc
            if response.status_code >= 400:
                raise error_from_response(response)
            if not response.content:
                return None
            try:
                return response.json()
            except ValueError as exc:
                raise APIResponseError(f"{method} {path}: response is not JSON: "
                                       f"{response.text[:200]!r}") from exc

        return await self.retry.acall(attempt)

    async def _open_stream(self, body: dict[str, Any], headers: Mapping[str, str] | None
                     ) -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
        """Send a streaming request and read its first bytes, with retries: until the first
        byte, nothing was generated for us, so trying again duplicates nothing."""
        url = f"{self.base_url}{CHAT_PATH}"

        async def attempt() -> tuple[httpx.Response, AsyncIterator[bytes], bytes]:
            request = self._http.build_request("POST", CHAT_PATH, json=body, headers=headers)
            try:
                response = await self._http.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise error_from_transport(exc, url=url) from exc
            try:
                if response.status_code >= 400:
                    await response.aread()
                    raise error_from_response(response)
                chunks = response.aiter_bytes()
                first = await anext(chunks, b"")
                if not first:
                    raise APIConnectionError(f"{url}: the stream closed before its first byte")
            except httpx.HTTPError as exc:
                await response.aclose()
                raise error_from_transport(exc, url=url) from exc
            except BaseException:
                await response.aclose()
                raise
            return response, chunks, first

        return await self.retry.acall(attempt)

    # --- discovery ------------------------------------------------------------------------
    async def health(self) -> HealthInfo:
        """``GET /v1/kvbranch/health``; :class:`KVBranchUnavailableError` on a server
        without kvbranch."""
        self._health = _parse(HealthInfo, await self._send("GET", HEALTH_PATH))
        return self._health

    async def kvbranch_available(self) -> bool:
        """Whether the server has the kvbranch routes (probed once, then remembered). The
        first ``False`` logs one warning; session features then run client-side only."""
        if self._kvbranch is None:
            try:
                await self.health()
                self._kvbranch = True
            except NotFoundError:
                self._mark_unavailable()
        return bool(self._kvbranch)

    async def models(self) -> list[str]:
        """Ids of the server's models (``GET /v1/models``)."""
        data = await self._send("GET", MODELS_PATH)
        try:
            return [m["id"] for m in data["data"]]
        except (TypeError, KeyError) as exc:
            raise APIResponseError(f"unexpected /v1/models response: {data!r:.200}") from exc

    async def max_model_len(self, model: str | None = None) -> int | None:
        """The context length of ``model`` from ``GET /v1/models`` (see
        :meth:`sdk.KVBranchClient.max_model_len`)."""
        return max_model_len_of(await self._send("GET", MODELS_PATH), model or self.model)

    async def resolve_model(self, model: str | None = None) -> str:
        """``model``, else the client's default, else the server's first model."""
        if model:
            return model
        if not self.model:
            ids = await self.models()
            if not ids:
                raise APIResponseError("the server lists no models; pass model=")
            self.model = ids[0]
        return self.model

    # --- chat -----------------------------------------------------------------------------
    async def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = None,
             session_id: str | None = None, branch_id: str | None = None,
             temperature: float | None = None, max_tokens: int | None = None,
             stop: str | Sequence[str] | None = None,
             tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None,
             top_p: float | None = None, seed: int | None = None,
             extra_body: Mapping[str, Any] | None = None,
             extra_headers: Mapping[str, str] | None = None) -> ChatResult:
        """One chat completion (not streamed). ``session_id``/``branch_id`` name the
        kvbranch session and branch the request continues; ``extra_body`` is merged into the
        request body (any server-specific parameter)."""
        body = chat_payload(messages, model=await self.resolve_model(model), stream=False,
                            session_id=session_id, branch_id=branch_id,
                            temperature=temperature, max_tokens=max_tokens, stop=stop,
                            tools=tools, tool_choice=tool_choice, top_p=top_p, seed=seed,
                            extra_body=extra_body)
        start = time.perf_counter()
        data = await self._send("POST", CHAT_PATH, body, extra_headers)
        return ChatResult.from_openai(data, latency_s=time.perf_counter() - start)

    async def chat_stream(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = None,
                    session_id: str | None = None, branch_id: str | None = None,
                    temperature: float | None = None, max_tokens: int | None = None,
                    stop: str | Sequence[str] | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None,
                    top_p: float | None = None, seed: int | None = None,
                    extra_body: Mapping[str, Any] | None = None,
                    extra_headers: Mapping[str, str] | None = None,
                    on_complete: Callable[[ChatResult], None] | None = None) -> AsyncChatStream:
        """A streamed chat completion: ``async for`` over the returned :class:`AsyncChatStream` for
        :class:`ChatChunk`\\ s; its ``result`` is the whole answer once it finished. The
        request is sent (and retried, up to its first byte) before this returns."""
        body = chat_payload(messages, model=await self.resolve_model(model), stream=True,
                            session_id=session_id, branch_id=branch_id,
                            temperature=temperature, max_tokens=max_tokens, stop=stop,
                            tools=tools, tool_choice=tool_choice, top_p=top_p, seed=seed,
                            extra_body=extra_body)
        start = time.perf_counter()
        response, chunks, first = await self._open_stream(body, extra_headers)
        return AsyncChatStream(response, chunks, first, start=start, on_complete=on_complete)

    # --- sessions and branches ------------------------------------------------------------
    async def session(self, session_id: str | None = None, *, system: str | None = None,
                messages: Sequence[Mapping[str, Any]] | None = None, auto_pin: bool = True,
                pin_ttl_s: float | None = None) -> AsyncSession:
        """An :class:`~sdk.session.AsyncSession` whose ``main`` branch starts with ``messages``
        (after a ``system`` message, if given). Created on the server when it has kvbranch;
        an existing server session of that id is attached to."""
        from sdk.session import AsyncSession

        return await AsyncSession._open(self, session_id, system=system, messages=messages,
                             auto_pin=auto_pin, pin_ttl_s=pin_ttl_s)

    async def create_session(self, session_id: str | None = None, *, auto_pin: bool = True,
                       pin_ttl_s: float | None = None) -> SessionInfo:
        body = CreateSessionRequest(session_id=session_id, auto_pin=auto_pin,
                                    pin_ttl_s=pin_ttl_s)
        return _parse(SessionInfo, await self._send("POST", SESSIONS_PATH, _dump(body)))

    async def get_session(self, session_id: str) -> SessionInfo:
        path = session_path(check_id(session_id, "session_id"))
        return _parse(SessionInfo, await self._send("GET", path))

    async def delete_session(self, session_id: str) -> DeleteResult:
        path = session_path(check_id(session_id, "session_id"))
        return _parse(DeleteResult, await self._send("DELETE", path))

    async def list_branches(self, session_id: str) -> list[BranchInfo]:
        data = await self._send("GET", branches_path(check_id(session_id, "session_id")))
        if not isinstance(data, list):
            raise APIResponseError(f"expected a list of branches, got {data!r:.200}")
        return [_parse(BranchInfo, b) for b in data]

    async def get_branch(self, session_id: str, branch_id: str) -> BranchInfo:
        path = branch_path(check_id(session_id, "session_id"), check_id(branch_id, "branch_id"))
        return _parse(BranchInfo, await self._send("GET", path))

    async def fork_branch(self, session_id: str, *, parent: str = "main",
                    branch_id: str | None = None, token_offset: int | None = None,
                    messages: Sequence[Mapping[str, Any]] | None = None) -> BranchInfo:
        """Server-side fork of ``parent``: after ``token_offset`` tokens, or where
        ``messages`` (rendered with the chat template) end, or at its end."""
        body = ForkRequest(parent=parent, branch_id=branch_id, token_offset=token_offset,
                           messages=None if messages is None else [dict(m) for m in messages])
        path = branches_path(check_id(session_id, "session_id"))
        return _parse(BranchInfo, await self._send("POST", path, _dump(body)))

    async def delete_branch(self, session_id: str, branch_id: str) -> DeleteResult:
        path = branch_path(check_id(session_id, "session_id"), check_id(branch_id, "branch_id"))
        return _parse(DeleteResult, await self._send("DELETE", path))

    async def pin_branch(self, session_id: str, branch_id: str, ttl_s: float) -> BranchInfo:
        """Keep the branch's blocks in the host store for ``ttl_s`` seconds (renewed by each
        use). :class:`~sdk.errors.ConflictError` when it exceeds the pin budget."""
        body = PinRequest(ttl_s=ttl_s)
        path = pin_path(check_id(session_id, "session_id"), check_id(branch_id, "branch_id"))
        return _parse(BranchInfo, await self._send("POST", path, _dump(body)))

    async def unpin_branch(self, session_id: str, branch_id: str) -> BranchInfo:
        path = pin_path(check_id(session_id, "session_id"), check_id(branch_id, "branch_id"))
        return _parse(BranchInfo, await self._send("DELETE", path))

    async def prefetch_branch(self, session_id: str, branch_id: str) -> PrefetchResult:
        """Ask the server to warm the device cache with the branch's last sequence (in the
        background; returns at once)."""
        path = prefetch_path(check_id(session_id, "session_id"),
                             check_id(branch_id, "branch_id"))
        return _parse(PrefetchResult, await self._send("POST", path))

    async def stats(self) -> Stats:
        return _parse(Stats, await self._send("GET", STATS_PATH))


class AsyncChatStream:
    """An open streamed answer: ``async for chunk in stream``. Same contract as
    :class:`sdk.client.ChatStream` (``ttft_s``, ``result``, ``final()``, ``aclose()``,
    ``async with``)."""

    def __init__(self, response: httpx.Response, chunks: AsyncIterator[bytes], first: bytes,
                 *, start: float, on_complete: Callable[[ChatResult], None] | None = None
                 ) -> None:
        self._response = response
        self._chunks = chunks
        self._first = first
        self._start = start
        self._on_complete = on_complete
        self._acc = ChatAccumulator()
        self._result: ChatResult | None = None
        self._iterated = False
        self.ttft_s: float | None = None

    @property
    def result(self) -> ChatResult:
        if self._result is None:
            raise RuntimeError("the stream has not finished: iterate it (or await "
                               "final()) first")
        return self._result

    @property
    def text(self) -> str:
        return "".join(self._acc.text)

    async def final(self) -> ChatResult:
        async for _ in self:
            pass
        return self.result

    def __aiter__(self) -> AsyncIterator[ChatChunk]:
        if self._iterated:
            raise RuntimeError("an AsyncChatStream can be iterated only once")
        self._iterated = True
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[ChatChunk]:
        decoder = SSEDecoder()
        done = False
        try:
            async for raw in self._raw_chunks():
                for event in decoder.feed(raw):
                    chunk = event_to_chunk(event)
                    if chunk is None:
                        done = True
                        break
                    yield self._take(chunk)
                if done:
                    break
            if not done:
                for event in decoder.close():
                    chunk = event_to_chunk(event)
                    if chunk is None:
                        done = True
                        break
                    yield self._take(chunk)
        finally:
            await self.aclose()
        if not done and self._acc.finish_reason is None:
            raise StreamInterruptedError("the stream ended before the answer finished (no "
                                         "finish_reason, no [DONE]); not retried")
        self._result = self._acc.result(ttft_s=self.ttft_s,
                                        latency_s=time.perf_counter() - self._start)
        if self._on_complete is not None:
            self._on_complete(self._result)

    async def _raw_chunks(self) -> AsyncIterator[bytes]:
        yield self._first
        try:
            async for raw in self._chunks:
                yield raw
        except httpx.HTTPError as exc:
            raise StreamInterruptedError(
                f"the stream broke after {self._acc.chunks} chunks: {exc or type(exc).__name__}"
                "; not retried (it would run the generation again)") from exc

    def _take(self, chunk: ChatChunk) -> ChatChunk:
        if self.ttft_s is None and (chunk.content or chunk.tool_calls):
            self.ttft_s = time.perf_counter() - self._start
        self._acc.add(chunk)
        return chunk

    async def aclose(self) -> None:
        await self._response.aclose()

    async def __aenter__(self) -> AsyncChatStream:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
