"""The synchronous kvbranch client (httpx).

:class:`KVBranchClient` speaks the OpenAI chat API to any compatible server, and the kvbranch
routes (sessions, branches, pins, prefetch, stats; see :mod:`server.contract`) to a kvbranch
server. :meth:`KVBranchClient.session` returns a :class:`sdk.session.Session`, the object most
users want: it keeps every branch's history and re-sends it, so a server that lost its state
only costs time.
"""

from __future__ import annotations

import json
import logging
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
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

from sdk._common import (
    CHAT_PATH,
    MODELS_PATH,
    chat_payload,
    make_timeout,
    resolve_api_key,
    resolve_base_url,
    user_agent,
)
from sdk.errors import (
    APIConnectionError,
    APIResponseError,
    NotFoundError,
    StreamInterruptedError,
    error_from_response,
    error_from_transport,
)
from sdk.retry import RetryPolicy
from sdk.sse import SSEDecoder, ServerSentEvent
from sdk.types import ChatAccumulator, ChatChunk, ChatResult

if TYPE_CHECKING:
    from sdk.session import Session

__all__ = ["KVBranchClient", "ChatStream"]

logger = logging.getLogger("kvbranch.sdk")

UNAVAILABLE_WARNING = ("kvbranch: {url} has no kvbranch routes (a plain OpenAI-compatible "
                       "server); sessions, branches, pins and prefetch run client-side only "
                       "(full history re-sent each turn, no server cache management)")


def _dump(model: Any) -> dict[str, Any]:
    return model.model_dump(exclude_none=True)


def _parse(model: Any, data: Any) -> Any:
    try:
        return model.model_validate(data)
    except ValueError as exc:
        raise APIResponseError(f"unexpected {model.__name__} from the server: {exc}") from exc


def max_model_len_of(data: Any, model: str | None) -> int | None:
    """``max_model_len`` of ``model`` (else of the first model) in a ``/v1/models`` response;
    ``None`` when the model is not listed or the server does not report it (vLLM does)."""
    try:
        entries = [m for m in data["data"] if isinstance(m, dict)]
    except (TypeError, KeyError) as exc:
        raise APIResponseError(f"unexpected /v1/models response: {data!r:.200}") from exc
    entry = next((m for m in entries if model is None or m.get("id") == model), None)
    value = entry.get("max_model_len") if entry is not None else None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


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


class _ClientBase:
    """Configuration shared by the sync and async clients."""

    def __init__(self, base_url: str | None, api_key: str | None, model: str | None,
                 timeout: float | httpx.Timeout | None, retry: RetryPolicy | None,
                 default_headers: Mapping[str, str] | None, kvbranch: bool | None) -> None:
        self.base_url = resolve_base_url(base_url)
        self.api_key = resolve_api_key(api_key)
        self.model = model
        self.timeout = make_timeout(timeout)
        self.retry = retry or RetryPolicy()
        self._headers = {"User-Agent": user_agent(), "Accept": "application/json"}
        if self.api_key:
            self._headers["Authorization"] = f"Bearer {self.api_key}"
        self._headers.update(default_headers or {})
        self._kvbranch = kvbranch
        self._health: HealthInfo | None = None
        self._warned = False

    def _mark_unavailable(self) -> None:
        self._kvbranch = False
        if not self._warned:
            self._warned = True
            message = UNAVAILABLE_WARNING.format(url=self.base_url)
            logger.info(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)


class KVBranchClient(_ClientBase):
    """Synchronous client of a kvbranch (or any OpenAI-compatible) server.

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
                 transport: httpx.BaseTransport | None = None) -> None:
        super().__init__(base_url, api_key, model, timeout, retry, default_headers, kvbranch)
        self._http = httpx.Client(base_url=self.base_url, headers=self._headers,
                                  timeout=self.timeout, transport=transport)

    # --- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> KVBranchClient:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- plumbing -------------------------------------------------------------------------
    def _send(self, method: str, path: str, body: Any = None,
              headers: Mapping[str, str] | None = None) -> Any:
        def attempt() -> Any:
            try:
                response = self._http.request(method, path, json=body, headers=headers)
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

        return self.retry.call(attempt)

    def _open_stream(self, body: dict[str, Any], headers: Mapping[str, str] | None
                     ) -> tuple[httpx.Response, Iterator[bytes], bytes]:
        """Send a streaming request and read its first bytes, with retries: until the first
        byte, nothing was generated for us, so trying again duplicates nothing."""
        url = f"{self.base_url}{CHAT_PATH}"

        def attempt() -> tuple[httpx.Response, Iterator[bytes], bytes]:
            request = self._http.build_request("POST", CHAT_PATH, json=body, headers=headers)
            try:
                response = self._http.send(request, stream=True)
            except httpx.HTTPError as exc:
                raise error_from_transport(exc, url=url) from exc
            try:
                if response.status_code >= 400:
                    response.read()
                    raise error_from_response(response)
                chunks = response.iter_bytes()
                first = next(chunks, b"")
                if not first:
                    raise APIConnectionError(f"{url}: the stream closed before its first byte")
            except httpx.HTTPError as exc:
                response.close()
                raise error_from_transport(exc, url=url) from exc
            except BaseException:
                response.close()
                raise
            return response, chunks, first

        return self.retry.call(attempt)

    # --- discovery ------------------------------------------------------------------------
    def health(self) -> HealthInfo:
        """``GET /v1/kvbranch/health``; :class:`KVBranchUnavailableError` on a server
        without kvbranch."""
        self._health = _parse(HealthInfo, self._send("GET", HEALTH_PATH))
        return self._health

    def kvbranch_available(self) -> bool:
        """Whether the server has the kvbranch routes (probed once, then remembered). The
        first ``False`` logs one warning; session features then run client-side only."""
        if self._kvbranch is None:
            try:
                self.health()
                self._kvbranch = True
            except NotFoundError:
                self._mark_unavailable()
        return bool(self._kvbranch)

    def models(self) -> list[str]:
        """Ids of the server's models (``GET /v1/models``)."""
        data = self._send("GET", MODELS_PATH)
        try:
            return [m["id"] for m in data["data"]]
        except (TypeError, KeyError) as exc:
            raise APIResponseError(f"unexpected /v1/models response: {data!r:.200}") from exc

    def max_model_len(self, model: str | None = None) -> int | None:
        """The context length (prompt + answer tokens) of ``model`` (default: the client's
        model, else the server's first) from ``GET /v1/models``; ``None`` when the server
        does not report one."""
        return max_model_len_of(self._send("GET", MODELS_PATH), model or self.model)

    def resolve_model(self, model: str | None = None) -> str:
        """``model``, else the client's default, else the server's first model."""
        if model:
            return model
        if not self.model:
            ids = self.models()
            if not ids:
                raise APIResponseError("the server lists no models; pass model=")
            self.model = ids[0]
        return self.model

    # --- chat -----------------------------------------------------------------------------
    def chat(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = None,
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
        body = chat_payload(messages, model=self.resolve_model(model), stream=False,
                            session_id=session_id, branch_id=branch_id,
                            temperature=temperature, max_tokens=max_tokens, stop=stop,
                            tools=tools, tool_choice=tool_choice, top_p=top_p, seed=seed,
                            extra_body=extra_body)
        start = time.perf_counter()
        data = self._send("POST", CHAT_PATH, body, extra_headers)
        return ChatResult.from_openai(data, latency_s=time.perf_counter() - start)

    def chat_stream(self, messages: Sequence[Mapping[str, Any]], *, model: str | None = None,
                    session_id: str | None = None, branch_id: str | None = None,
                    temperature: float | None = None, max_tokens: int | None = None,
                    stop: str | Sequence[str] | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = None,
                    top_p: float | None = None, seed: int | None = None,
                    extra_body: Mapping[str, Any] | None = None,
                    extra_headers: Mapping[str, str] | None = None,
                    on_complete: Callable[[ChatResult], None] | None = None) -> ChatStream:
        """A streamed chat completion: iterate the returned :class:`ChatStream` for
        :class:`ChatChunk`\\ s; its ``result`` is the whole answer once it finished. The
        request is sent (and retried, up to its first byte) before this returns."""
        body = chat_payload(messages, model=self.resolve_model(model), stream=True,
                            session_id=session_id, branch_id=branch_id,
                            temperature=temperature, max_tokens=max_tokens, stop=stop,
                            tools=tools, tool_choice=tool_choice, top_p=top_p, seed=seed,
                            extra_body=extra_body)
        start = time.perf_counter()
        response, chunks, first = self._open_stream(body, extra_headers)
        return ChatStream(response, chunks, first, start=start, on_complete=on_complete)

    # --- sessions and branches ------------------------------------------------------------
    def session(self, session_id: str | None = None, *, system: str | None = None,
                messages: Sequence[Mapping[str, Any]] | None = None, auto_pin: bool = True,
                pin_ttl_s: float | None = None) -> Session:
        """A :class:`~sdk.session.Session` whose ``main`` branch starts with ``messages``
        (after a ``system`` message, if given). Created on the server when it has kvbranch;
        an existing server session of that id is attached to."""
        from sdk.session import Session

        return Session._open(self, session_id, system=system, messages=messages,
                             auto_pin=auto_pin, pin_ttl_s=pin_ttl_s)

    def create_session(self, session_id: str | None = None, *, auto_pin: bool = True,
                       pin_ttl_s: float | None = None) -> SessionInfo:
        body = CreateSessionRequest(session_id=session_id, auto_pin=auto_pin,
                                    pin_ttl_s=pin_ttl_s)
        return _parse(SessionInfo, self._send("POST", SESSIONS_PATH, _dump(body)))

    def get_session(self, session_id: str) -> SessionInfo:
        path = session_path(check_id(session_id, "session_id"))
        return _parse(SessionInfo, self._send("GET", path))

    def delete_session(self, session_id: str) -> DeleteResult:
        path = session_path(check_id(session_id, "session_id"))
        return _parse(DeleteResult, self._send("DELETE", path))

    def list_branches(self, session_id: str) -> list[BranchInfo]:
        data = self._send("GET", branches_path(check_id(session_id, "session_id")))
        if not isinstance(data, list):
            raise APIResponseError(f"expected a list of branches, got {data!r:.200}")
        return [_parse(BranchInfo, b) for b in data]

    def get_branch(self, session_id: str, branch_id: str) -> BranchInfo:
        path = branch_path(check_id(session_id, "session_id"), check_id(branch_id, "branch_id"))
        return _parse(BranchInfo, self._send("GET", path))

    def fork_branch(self, session_id: str, *, parent: str = "main",
                    branch_id: str | None = None, token_offset: int | None = None,
                    messages: Sequence[Mapping[str, Any]] | None = None) -> BranchInfo:
        """Server-side fork of ``parent``: after ``token_offset`` tokens, or where
        ``messages`` (rendered with the chat template) end, or at its end."""
        body = ForkRequest(parent=parent, branch_id=branch_id, token_offset=token_offset,
                           messages=None if messages is None else [dict(m) for m in messages])
        path = branches_path(check_id(session_id, "session_id"))
        return _parse(BranchInfo, self._send("POST", path, _dump(body)))

    def delete_branch(self, session_id: str, branch_id: str) -> DeleteResult:
        path = branch_path(check_id(session_id, "session_id"), check_id(branch_id, "branch_id"))
        return _parse(DeleteResult, self._send("DELETE", path))

    def pin_branch(self, session_id: str, branch_id: str, ttl_s: float) -> BranchInfo:
        """Keep the branch's blocks in the host store for ``ttl_s`` seconds (renewed by each
        use). :class:`~sdk.errors.ConflictError` when it exceeds the pin budget."""
        body = PinRequest(ttl_s=ttl_s)
        path = pin_path(check_id(session_id, "session_id"), check_id(branch_id, "branch_id"))
        return _parse(BranchInfo, self._send("POST", path, _dump(body)))

    def unpin_branch(self, session_id: str, branch_id: str) -> BranchInfo:
        path = pin_path(check_id(session_id, "session_id"), check_id(branch_id, "branch_id"))
        return _parse(BranchInfo, self._send("DELETE", path))

    def prefetch_branch(self, session_id: str, branch_id: str) -> PrefetchResult:
        """Ask the server to warm the device cache with the branch's last sequence (in the
        background; returns at once)."""
        path = prefetch_path(check_id(session_id, "session_id"),
                             check_id(branch_id, "branch_id"))
        return _parse(PrefetchResult, self._send("POST", path))

    def stats(self) -> Stats:
        return _parse(Stats, self._send("GET", STATS_PATH))


class ChatStream:
    """An open streamed answer. Iterate it for :class:`ChatChunk`\\ s (content deltas,
    tool-call deltas, finish reason, and last the usage chunk with the kvbranch split).

    ``ttft_s`` is set at the first content or tool-call delta; ``result`` (a
    :class:`ChatResult`) once the stream finished. A stream that breaks midway raises
    :class:`~sdk.errors.StreamInterruptedError` and is not retried. Use it as a context
    manager, or call :meth:`close`, when not reading it to the end.
    """

    def __init__(self, response: httpx.Response, chunks: Iterator[bytes], first: bytes, *,
                 start: float, on_complete: Callable[[ChatResult], None] | None = None
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
            raise RuntimeError("the stream has not finished: iterate it (or call "
                               "final()) first")
        return self._result

    @property
    def text(self) -> str:
        """The content received so far."""
        return "".join(self._acc.text)

    def final(self) -> ChatResult:
        """Read the rest of the stream; the whole answer."""
        for _ in self:
            pass
        return self.result

    def __iter__(self) -> Iterator[ChatChunk]:
        if self._iterated:
            raise RuntimeError("a ChatStream can be iterated only once")
        self._iterated = True
        decoder = SSEDecoder()
        done = False
        try:
            for raw in self._raw_chunks():
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
            self.close()
        if not done and self._acc.finish_reason is None:
            raise StreamInterruptedError("the stream ended before the answer finished (no "
                                         "finish_reason, no [DONE]); not retried")
        self._finish()

    def _raw_chunks(self) -> Iterator[bytes]:
        yield self._first
        try:
            yield from self._chunks
        except httpx.HTTPError as exc:
            raise StreamInterruptedError(
                f"the stream broke after {self._acc.chunks} chunks: {exc or type(exc).__name__}"
                "; not retried (it would run the generation again)") from exc

    def _take(self, chunk: ChatChunk) -> ChatChunk:
        if self.ttft_s is None and (chunk.content or chunk.tool_calls):
            self.ttft_s = time.perf_counter() - self._start
        self._acc.add(chunk)
        return chunk

    def _finish(self) -> None:
        self._result = self._acc.result(ttft_s=self.ttft_s,
                                        latency_s=time.perf_counter() - self._start)
        if self._on_complete is not None:
            self._on_complete(self._result)

    def close(self) -> None:
        self._response.close()

    def __enter__(self) -> ChatStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

