"""The synchronous kvbranch client (httpx).

:class:`KVBranchClient` speaks the OpenAI chat API to any compatible server, and the kvbranch
routes (sessions, branches, pins and prefetch, stats; see :mod:`sdk.contract`) to a kvbranch
server. :meth:`KVBranchClient.session` returns a :class:`sdk.session.Session`, the object most
users want: it keeps every branch's history and re-sends it, so a server that lost its state
only costs time.

This module is only the sync *driver*: what each call sends and how its answer is read are
flows of :mod:`sdk._core`, and a stream's rules are :class:`sdk._stream.StreamState`, both
shared with :mod:`sdk.aclient`. Here: sending a request (with retries) and reading bytes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, TypeVar, cast

import httpx
from typing_extensions import Unpack

from sdk import contract
from sdk._common import ChatArgs, ForkArgs, SessionArgs
from sdk._core import Callback, Closing, Done, Flow, Outcome, Request, advance
from sdk._driver import SyncDriver
from sdk._stream import ChatStream, event_to_chunk
from sdk.errors import APIConnectionError, KVBranchError, error_from_response, error_from_transport
from sdk.session import Session
from sdk.types import ChatResult

__all__ = ["KVBranchClient", "ChatStream", "event_to_chunk"]

T = TypeVar("T")


class KVBranchClient(SyncDriver, Closing):
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

    _http: httpx.Client

    def _connect(self, transport: httpx.BaseTransport | None) -> None:
        self._http = httpx.Client(
            base_url=self.base_url, headers=self._headers, timeout=self.timeout, transport=transport
        )

    # --- the driver -----------------------------------------------------------------------
    def _run(self, flow: Flow[T]) -> T:
        """Run a flow of :mod:`sdk._core` to its result, sending each request it yields."""
        step = advance(flow, Outcome())
        while not isinstance(step, Done):
            try:
                outcome = Outcome(self._send(step))
            except KVBranchError as exc:
                outcome = Outcome(error=exc)
            step = advance(flow, outcome)
        return cast(T, step.value)

    def _send(self, request: Request) -> Any:
        def attempt() -> Any:
            try:
                response = self._http.request(
                    request.method, request.path, json=request.body, headers=request.headers
                )
            except httpx.HTTPError as exc:
                raise error_from_transport(exc, url=self._url(request.path)) from exc
            return self._read(request, response)

        return self.retry.call(attempt)

    def _open_stream(self, request: Request) -> tuple[httpx.Response, Iterator[bytes], bytes]:
        """Send a streaming request and read its first bytes, with retries: until the first
        byte, nothing was generated for us, so trying again duplicates nothing."""
        url = self._url(request.path)

        def attempt() -> tuple[httpx.Response, Iterator[bytes], bytes]:
            http_request = self._http.build_request(
                request.method, request.path, json=request.body, headers=request.headers
            )
            try:
                response = self._http.send(http_request, stream=True)
                try:
                    if response.status_code >= 400:
                        response.read()
                        raise error_from_response(response)
                    chunks = response.iter_bytes()
                    first = next(chunks, b"")
                    if not first:
                        raise APIConnectionError(f"{url}: the stream closed before its first byte")
                except BaseException:
                    response.close()
                    raise
            except httpx.HTTPError as exc:
                raise error_from_transport(exc, url=url) from exc
            return response, chunks, first

        return self.retry.call(attempt)

    # --- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        self._http.close()

    # --- discovery ------------------------------------------------------------------------
    def health(self) -> contract.HealthInfo:
        """``GET /v1/kvbranch/health``; :class:`KVBranchUnavailableError` on a server
        without kvbranch."""
        return self._run(self._flows.health())

    def kvbranch_available(self) -> bool:
        """Whether the server has the kvbranch routes (probed once, then remembered). The
        first ``False`` logs one warning; session features then run client-side only."""
        return self._run(self._flows.kvbranch_available())

    def models(self) -> list[str]:
        """Ids of the server's models (``GET /v1/models``)."""
        return self._run(self._flows.models())

    def max_model_len(self, model: str | None = None) -> int | None:
        """The context length (prompt + answer tokens) of ``model`` (default: the client's
        model, else the server's first) from ``GET /v1/models``; ``None`` when the server
        does not report one."""
        return self._run(self._flows.max_model_len(model))

    def resolve_model(self, model: str | None = None) -> str:
        """``model``, else the client's default, else the server's first model."""
        return self._run(self._flows.resolve_model(model))

    # --- chat -----------------------------------------------------------------------------
    def chat(self, messages: Sequence[Mapping[str, Any]], **args: Unpack[ChatArgs]) -> ChatResult:
        """One chat completion (not streamed). ``session_id``/``branch_id`` name the
        kvbranch session and branch the request continues; ``extra_body`` is merged into the
        request body (any server-specific parameter); the other keywords (``model``,
        ``temperature``, ``max_tokens``, ``stop``, ``tools``, ``tool_choice``, ``top_p``,
        ``seed``, ``extra_headers``) are :class:`~sdk._common.ChatArgs`."""
        return self._run(self._flows.chat(messages, **args))

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        on_complete: Callback | None = None,
        **args: Unpack[ChatArgs],
    ) -> ChatStream:
        """A streamed chat completion: iterate the returned :class:`ChatStream` for
        :class:`ChatChunk`\\ s; its ``result`` is the whole answer once it finished (and is
        passed to ``on_complete``). The request is sent (and retried, up to its first byte)
        before this returns. Same keywords as :meth:`chat`."""
        request = self._run(self._flows.chat_request(messages, stream=True, **args))
        start = time.perf_counter()
        return ChatStream(*self._open_stream(request), start=start, on_complete=on_complete)

    # --- sessions and branches ------------------------------------------------------------
    def session(self, session_id: str | None = None, **options: Unpack[SessionArgs]) -> Session:
        """A :class:`~sdk.session.Session` whose ``main`` branch starts with ``messages``
        (after a ``system`` message, if given). Created on the server when it has kvbranch;
        an existing server session of that id is attached to. Keywords:
        :class:`~sdk._common.SessionArgs` (``system``, ``messages``, ``auto_pin``,
        ``pin_ttl_s``)."""
        return self._run(Session._opening(self, session_id, options))

    def create_session(
        self,
        session_id: str | None = None,
        *,
        auto_pin: bool = True,
        pin_ttl_s: float | None = None,
    ) -> contract.SessionInfo:
        """Create a server session (``session_id`` chosen by the server when omitted)."""
        return self._run(
            self._flows.create_session(session_id, auto_pin=auto_pin, pin_ttl_s=pin_ttl_s)
        )

    def get_session(self, session_id: str) -> contract.SessionInfo:
        return self._run(self._flows.get_session(session_id))

    def delete_session(self, session_id: str) -> contract.DeleteResult:
        return self._run(self._flows.delete_session(session_id))

    def list_branches(self, session_id: str) -> list[contract.BranchInfo]:
        return self._run(self._flows.list_branches(session_id))

    def get_branch(self, session_id: str, branch_id: str) -> contract.BranchInfo:
        return self._run(self._flows.get_branch(session_id, branch_id))

    def fork_branch(self, session_id: str, **fork: Unpack[ForkArgs]) -> contract.BranchInfo:
        """Server-side fork of ``parent`` (default ``main``) as ``branch_id`` (server-made when
        omitted): after ``token_offset`` tokens, or where ``messages`` (rendered with the chat
        template) end, or at its end (see :class:`~sdk._common.ForkArgs`)."""
        return self._run(self._flows.fork_branch(session_id, **fork))

    def delete_branch(self, session_id: str, branch_id: str) -> contract.DeleteResult:
        return self._run(self._flows.delete_branch(session_id, branch_id))

    def pin_branch(self, session_id: str, branch_id: str, ttl_s: float) -> contract.BranchInfo:
        """Keep the branch's blocks in the host store for ``ttl_s`` seconds (renewed by each
        use). :class:`~sdk.errors.ConflictError` when it exceeds the pin budget."""
        return self._run(self._flows.pin_branch(session_id, branch_id, ttl_s))

    def unpin_branch(self, session_id: str, branch_id: str) -> contract.BranchInfo:
        return self._run(self._flows.unpin_branch(session_id, branch_id))

    def prefetch_branch(
        self, session_id: str, branch_id: str, to_device: bool = False
    ) -> contract.PrefetchResult:
        """Make the branch's next turn start warm (returns at once). Nothing runs when its
        blocks are in the device cache, or all in the host store (the next turn loads them in
        one copy) unless ``to_device``; otherwise the engine runs the branch's last sequence in
        the background."""
        return self._run(self._flows.prefetch_branch(session_id, branch_id, to_device))

    def stats(self) -> contract.Stats:
        return self._run(self._flows.stats())
