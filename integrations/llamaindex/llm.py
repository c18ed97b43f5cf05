"""``KVBranchLLM``: a LlamaIndex ``FunctionCallingLLM`` over the kvbranch sdk.

Swap it in for ``OpenAILike``/``OpenAI`` and an agent's conversation keeps its KV cache on the
server between turns::

    from integrations.llamaindex import KVBranchLLM
    from llama_index.core.agent.workflow import FunctionAgent

    llm = KVBranchLLM(base_url="http://127.0.0.1:8000", max_tokens=256)
    agent = FunctionAgent(tools=[get_weather], llm=llm)
    await agent.run("What is the weather in Paris?")
    planner = llm.fork()            # a model bound to a new branch sharing the cached prefix

Sessions and branches. LlamaIndex passes nothing about sessions to the LLM, so the binding is
the instance: each ``KVBranchLLM`` owns one kvbranch session (``session_id``, created on the
server on first use) and is bound to one branch of it (``branch_id``, default ``main``). Every
call sends the messages LlamaIndex gives it, as they are, on that branch; the branch's client
history (an :class:`sdk.Branch`) becomes those messages plus the answer, which is where
:meth:`KVBranchLLM.fork` cuts and what the sdk re-creates the branch from if the server lost
it. ``fork()``/``afork()`` return a new ``KVBranchLLM`` bound to a new branch of the same
session (server-side fork: the common prefix's blocks are shared, not copied). When an answer
contains a tool call, the branch is prefetched in the background (``prefetch_on_tool_call``), so
the turn carrying the tool result starts warm; a failed prefetch is logged, never raised.

What the server reports comes back on every ``ChatResponse``/``CompletionResponse``:
``additional_kwargs`` holds ``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
``cached_tokens`` (dropped by ``OpenAILike``), ``kvbranch`` (where the prompt's tokens came from:
``device_hit_tokens``, ``host_hit_tokens``, ``recomputed_tokens``), ``ttft_s`` (streams) and
``latency_s``; ``raw`` is the server's JSON (the last chunk, for streams).

Tool calls: ``tools``/``tool_choice`` are OpenAI's; ``tool_required=True`` sends
``tool_choice="required"`` and a tool name forces that tool. Arguments are read leniently (see
:func:`integrations.llamaindex._convert.tool_kwargs`): a model that writes a bare value instead
of a JSON object gets it mapped onto the tool's single parameter.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
import time
import warnings
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

import httpx
from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    ToolCallBlock,
)
from llama_index.core.bridge.pydantic import Field, PrivateAttr
from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW, DEFAULT_NUM_OUTPUTS
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection

from sdk import (
    DEFAULT_BRANCH,
    NO_RETRY,
    AsyncBranch,
    AsyncKVBranchClient,
    AsyncSession,
    Branch,
    KVBranchClient,
    KVBranchError,
    RetryPolicy,
    Session,
)
from sdk._common import resolve_base_url
from sdk.types import ChatAccumulator, ChatChunk, ChatResult
from server.contract import check_id

from integrations.llamaindex._convert import (
    openai_tool_calls,
    resolve_tool_choice,
    to_chat_message,
    to_openai_message,
    to_openai_messages,
    tool_kwargs,
    tool_schemas,
)

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

__all__ = ["KVBranchLLM"]

logger = logging.getLogger("kvbranch.llamaindex")

# Keyword arguments LlamaIndex may hand to chat() that are not request parameters.
_NOT_PARAMS = frozenset({"verbose", "allow_parallel_tool_calls", "tool_required",
                         "error_on_no_tool_call", "error_on_tool_error", "formatted"})
_PARAMS = ("temperature", "max_tokens", "stop", "top_p", "seed", "tools", "tool_choice")
_PROBE_RETRY_S = 30.0


class _Shared:
    """What an LLM shares with its forks: the sdk clients and sessions (sync and, per event
    loop, async), each branch's client history, server facts, background prefetches."""

    def __init__(self, llm: KVBranchLLM, transport: Any) -> None:
        self.base_url = llm.base_url
        self.api_key = llm.api_key
        self.model = llm.model
        self.timeout = llm.timeout
        self.retry = RetryPolicy(max_attempts=llm.max_retries + 1)
        self.headers = dict(llm.default_headers or {})
        self.session_id = llm.session_id
        self.auto_pin = llm.auto_pin
        self.pin_ttl_s = llm.pin_ttl_s
        self.transport = transport
        self.lock = threading.RLock()
        self._client: KVBranchClient | None = None
        self._session: Session | None = None
        self._aclient: AsyncKVBranchClient | None = None
        self._asession: AsyncSession | None = None
        self._aloop: asyncio.AbstractEventLoop | None = None
        self._alock: asyncio.Lock | None = None
        self.kvbranch: bool | None = None
        self.histories: dict[str, list[dict[str, Any]]] = {}
        self.forks: dict[str, tuple[str | None, int | None]] = {}
        self.model_name: str | None = llm.model
        self.context_window: int | None = None
        self._probed_at: float | None = None
        self.tasks: set[asyncio.Task] = set()
        self.threads: set[threading.Thread] = set()

    # --- server facts ---------------------------------------------------------------------
    def probe(self) -> int | None:
        """The model's context length from ``GET /v1/models`` (one quick attempt; a failure
        is retried after 30 s, meanwhile the caller uses its default)."""
        with self.lock:
            if self.context_window is not None:
                return self.context_window
            now = time.monotonic()
            if self._probed_at is not None and now - self._probed_at < _PROBE_RETRY_S:
                return None
            self._probed_at = now
            try:
                with KVBranchClient(self.base_url, api_key=self.api_key, model=self.model,
                                    timeout=10.0, retry=NO_RETRY, default_headers=self.headers,
                                    kvbranch=False, transport=self.transport) as client:
                    self.model_name = client.resolve_model(self.model)
                    self.context_window = client.max_model_len(self.model_name)
            except KVBranchError as exc:
                logger.warning("kvbranch: could not read the context window from %s (%s); "
                               "using %d", self.base_url, exc, DEFAULT_CONTEXT_WINDOW)
            return self.context_window

    # --- sync -----------------------------------------------------------------------------
    @property
    def client(self) -> KVBranchClient:
        with self.lock:
            if self._client is None:
                self._client = KVBranchClient(
                    self.base_url, api_key=self.api_key, model=self.model,
                    timeout=self.timeout, retry=self.retry, default_headers=self.headers,
                    kvbranch=self.kvbranch, transport=self.transport)
            return self._client

    def session(self) -> Session:
        with self.lock:
            if self._session is None:
                client = self.client
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # logged by the sdk
                    self._session = client.session(self.session_id, auto_pin=self.auto_pin,
                                                   pin_ttl_s=self.pin_ttl_s)
                self.kvbranch = client._kvbranch
            return self._session

    def branch(self, branch_id: str) -> Branch:
        session = self.session()
        with self.lock:
            branch = session.branches.get(branch_id)
            if branch is None:
                parent, index = self.forks.get(branch_id, (None, None))
                branch = Branch(session, branch_id, [], parent_id=parent, fork_index=index)
                session.branches[branch_id] = branch
            branch.set_messages(self.histories.get(branch_id, []))
            return branch

    def ids(self, branch_id: str) -> dict[str, str]:
        session = self.session()
        if self.client.kvbranch_available():
            return {"session_id": session.session_id, "branch_id": branch_id}
        return {}

    # --- async (the async client belongs to the event loop that made it) ------------------
    async def aclient(self) -> AsyncKVBranchClient:
        loop = asyncio.get_running_loop()
        if self._aclient is None or self._aloop is not loop:
            self._aclient = AsyncKVBranchClient(
                self.base_url, api_key=self.api_key, model=self.model, timeout=self.timeout,
                retry=self.retry, default_headers=self.headers, kvbranch=self.kvbranch,
                transport=self.transport)
            self._aloop, self._asession, self._alock = loop, None, asyncio.Lock()
        return self._aclient

    async def asession(self) -> AsyncSession:
        client = await self.aclient()
        assert self._alock is not None
        async with self._alock:
            if self._asession is None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)
                    self._asession = await client.session(
                        self.session_id, auto_pin=self.auto_pin, pin_ttl_s=self.pin_ttl_s)
                self.kvbranch = client._kvbranch
            return self._asession

    async def abranch(self, branch_id: str) -> AsyncBranch:
        session = await self.asession()
        branch = session.branches.get(branch_id)
        if branch is None:
            parent, index = self.forks.get(branch_id, (None, None))
            branch = AsyncBranch(session, branch_id, [], parent_id=parent, fork_index=index)
            session.branches[branch_id] = branch
        branch.set_messages(self.histories.get(branch_id, []))
        return branch

    async def aids(self, branch_id: str) -> dict[str, str]:
        session = await self.asession()
        if await (await self.aclient()).kvbranch_available():
            return {"session_id": session.session_id, "branch_id": branch_id}
        return {}

    # --- forks ----------------------------------------------------------------------------
    def check_new_branch(self, branch_id: str | None) -> None:
        if branch_id is not None and branch_id in self.histories:
            raise ValueError(f"branch {branch_id!r} already exists in session "
                             f"{self.session_id!r}")

    def register_fork(self, child: Branch | AsyncBranch) -> None:
        with self.lock:
            self.histories[child.branch_id] = child.messages
            self.forks[child.branch_id] = (child.parent_id, child.fork_index)

    # --- lifecycle ------------------------------------------------------------------------
    def wait_prefetches(self, timeout: float | None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in list(self.threads):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    async def await_prefetches(self, timeout: float | None) -> None:
        tasks = [t for t in self.tasks if not t.done()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)


class KVBranchLLM(FunctionCallingLLM):
    """A LlamaIndex LLM (function calling) on a kvbranch server: one session per instance,
    bound to one branch; see the module docs.

    Args:
        model: model name (default: the server's first model).
        base_url: server root (default ``$KVBRANCH_BASE_URL``, ``$OPENAI_BASE_URL``, then
            ``http://127.0.0.1:8000``; a ``/v1`` suffix is accepted).
        api_key: bearer key (default ``$KVBRANCH_API_KEY``, then ``$OPENAI_API_KEY``).
        temperature, max_tokens: defaults of every request (per-call kwargs override).
        context_window: overrides the context length read from ``GET /v1/models``.
        session_id: the kvbranch session (default: a new unique id); an existing session of
            that id is attached to.
        branch_id: the branch this instance talks on (default ``main``).
        auto_pin, pin_ttl_s: session pin policy (server defaults when ``None``).
        prefetch_on_tool_call: prefetch the branch in the background when an answer calls a
            tool.
        additional_kwargs: extra request-body parameters of every request.
        transport: an httpx transport for the sdk clients (tests: ``FakeKVBranchServer``).
    """

    model: Optional[str] = Field(default=None, description="Model name; default: the "
                                 "server's first model.")
    base_url: str = Field(default_factory=lambda: resolve_base_url(None),
                          description="kvbranch (or OpenAI-compatible) server root.")
    api_key: Optional[str] = Field(default=None, exclude=True, repr=False)
    temperature: Optional[float] = Field(default=None, ge=0.0)
    max_tokens: Optional[int] = Field(default=None, gt=0)
    context_window: Optional[int] = Field(default=None, gt=0, description="Default: the "
                                          "server's max_model_len.")
    timeout: float = Field(default=600.0, gt=0)
    max_retries: int = Field(default=3, ge=0)
    session_id: Optional[str] = Field(default=None, description="kvbranch session id "
                                      "(default: a new unique one).")
    branch_id: str = Field(default=DEFAULT_BRANCH, description="The branch this instance "
                           "is bound to.")
    auto_pin: bool = True
    pin_ttl_s: Optional[float] = Field(default=None, gt=0)
    prefetch_on_tool_call: bool = True
    is_function_calling_model: bool = True
    additional_kwargs: Dict[str, Any] = Field(default_factory=dict)
    default_headers: Optional[Dict[str, str]] = None

    _shared: _Shared = PrivateAttr()

    def __init__(self, *, transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None
                 = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.base_url = resolve_base_url(self.base_url)
        if self.session_id is None:
            self.session_id = f"li-{secrets.token_hex(8)}"
        check_id(self.session_id, "session_id")
        check_id(self.branch_id, "branch_id")
        self._shared = _Shared(self, transport)

    @classmethod
    def class_name(cls) -> str:
        return "KVBranchLLM"

    # --- metadata -------------------------------------------------------------------------
    @property
    def metadata(self) -> LLMMetadata:
        window = self.context_window or self._shared.probe() or DEFAULT_CONTEXT_WINDOW
        return LLMMetadata(context_window=window,
                           num_output=self.max_tokens or DEFAULT_NUM_OUTPUTS,
                           is_chat_model=True,
                           is_function_calling_model=self.is_function_calling_model,
                           model_name=self.model or self._shared.model_name or "unknown")

    # --- sessions and branches ------------------------------------------------------------
    @property
    def session(self) -> Session:
        """The sdk :class:`~sdk.Session` of this LLM and its forks (created on the server on
        first use)."""
        return self._shared.session()

    @property
    def branch(self) -> Branch:
        """The sdk :class:`~sdk.Branch` this LLM is bound to, with its history (``pin``,
        ``unpin``, ``prefetch``, ``info``)."""
        return self._shared.branch(self.branch_id)

    async def abranch(self) -> AsyncBranch:
        """:attr:`branch` as an :class:`~sdk.AsyncBranch`."""
        return await self._shared.abranch(self.branch_id)

    @property
    def history(self) -> list[dict[str, Any]]:
        """The branch's history (OpenAI messages): the last request's messages and its
        answer, or what the branch forked with."""
        return [dict(m) for m in self._shared.histories.get(self.branch_id, [])]

    def fork(self, at_message: int | None = None, *, branch_id: str | None = None
             ) -> KVBranchLLM:
        """A ``KVBranchLLM`` bound to a new branch of this session whose history is this
        branch's ``history[:at_message]`` (default all of it). The server forks its cache at
        the same point. The new instance shares this one's clients and session."""
        self._shared.check_new_branch(branch_id)
        child = self._shared.branch(self.branch_id).fork(at_message, branch_id=branch_id)
        self._shared.register_fork(child)
        return self.model_copy(update={"branch_id": child.branch_id})

    async def afork(self, at_message: int | None = None, *, branch_id: str | None = None
                    ) -> KVBranchLLM:
        """:meth:`fork` over the async client."""
        self._shared.check_new_branch(branch_id)
        parent = await self._shared.abranch(self.branch_id)
        child = await parent.fork(at_message, branch_id=branch_id)
        self._shared.register_fork(child)
        return self.model_copy(update={"branch_id": child.branch_id})

    def wait_for_prefetch(self, timeout: float | None = 30.0) -> None:
        """Wait for background prefetches started by sync calls."""
        self._shared.wait_prefetches(timeout)

    async def await_prefetch(self, timeout: float | None = 30.0) -> None:
        """Wait for background prefetches started by async calls in this event loop."""
        await self._shared.await_prefetches(timeout)

    def delete_session(self) -> None:
        """Delete the session on the server (releasing its pins and blocks)."""
        self._shared.session().delete()
        self._shared.histories.clear()

    def close(self) -> None:
        """Close the sync client (shared with forks)."""
        shared = self._shared
        with shared.lock:
            if shared._client is not None:
                shared._client.close()
                shared._client, shared._session = None, None

    async def aclose(self) -> None:
        """Wait for pending prefetches, then close the clients (shared with forks)."""
        shared = self._shared
        await shared.await_prefetches(10.0)
        if shared._aclient is not None and shared._aloop is asyncio.get_running_loop():
            await shared._aclient.close()
        shared._aclient = shared._asession = shared._aloop = None
        self.close()

    # --- request building -----------------------------------------------------------------
    def _params(self, kwargs: Mapping[str, Any]) -> dict[str, Any]:
        kw = dict(kwargs)
        params: dict[str, Any] = {}
        for name in _PARAMS:
            value = kw.pop(name, None)
            if value is None and name in ("temperature", "max_tokens"):
                value = getattr(self, name)
            if value is not None:
                params[name] = value
        if not params.get("tools"):
            params.pop("tools", None)
            params.pop("tool_choice", None)
        extra = {**self.additional_kwargs, **(kw.pop("extra_body", None) or {})}
        headers = kw.pop("extra_headers", None)
        for name in _NOT_PARAMS:
            kw.pop(name, None)
        extra.update(kw)  # anything else is a request-body parameter (response_format, ...)
        if extra:
            params["extra_body"] = extra
        if headers:
            params["extra_headers"] = headers
        if self.model:
            params["model"] = self.model
        return params

    def _info(self, result: ChatResult, ids: Mapping[str, str]) -> dict[str, Any]:
        usage = result.usage
        info: dict[str, Any] = {
            "prompt_tokens": usage.prompt_tokens if usage else None,
            "completion_tokens": usage.completion_tokens if usage else None,
            "total_tokens": usage.total_tokens if usage else None,
            "cached_tokens": usage.cached_tokens if usage else None,
            "kvbranch": result.split.model_dump() if result.split is not None else None,
            "session_id": ids.get("session_id"),
            "branch_id": ids.get("branch_id"),
            "model": result.model,
            "finish_reason": result.finish_reason,
            "ttft_s": result.ttft_s,
            "latency_s": result.latency_s,
        }
        return info

    def _response(self, result: ChatResult, message: ChatMessage, ids: Mapping[str, str],
                  *, raw: Any = None, delta: str | None = None) -> ChatResponse:
        return ChatResponse(message=message, raw=raw if raw is not None else result.raw,
                            delta=delta, additional_kwargs=self._info(result, ids))

    @staticmethod
    def _partial(acc: ChatAccumulator, chunk: ChatChunk, schemas: Mapping[str, Any]
                 ) -> ChatResponse:
        extra: dict[str, Any] = {}
        if chunk.reasoning:
            extra["thinking_delta"] = chunk.reasoning
        return ChatResponse(message=to_chat_message(acc.result(), schemas, partial=True),
                            raw=chunk.raw, delta=chunk.content or "", additional_kwargs=extra)

    def _record(self, messages: list[dict[str, Any]], result: ChatResult,
                message: ChatMessage) -> bool:
        """Remember the branch's new history (the answer as it will be sent back next time);
        whether a prefetch is due (a tool call)."""
        shared = self._shared
        with shared.lock:
            shared.histories[self.branch_id] = messages + [to_openai_message(message)]
            if result.model:
                shared.model_name = shared.model_name or result.model
        return bool(result.tool_calls) and self.prefetch_on_tool_call

    def _prefetch_in_thread(self) -> None:
        shared, branch_id = self._shared, self.branch_id

        def run() -> None:
            try:
                shared.branch(branch_id).prefetch()
            except Exception as exc:  # noqa: BLE001 - a prefetch is only a hint
                logger.info("kvbranch: prefetch of %s/%s failed: %s", shared.session_id,
                            branch_id, exc)
            finally:
                shared.threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name="kvbranch-prefetch", daemon=True)
        shared.threads.add(thread)
        try:
            thread.start()
        except RuntimeError as exc:  # e.g. the interpreter is shutting down, no threads left
            shared.threads.discard(thread)
            logger.info("kvbranch: could not start a prefetch: %s", exc)

    def _prefetch_in_task(self) -> None:
        shared, branch_id = self._shared, self.branch_id

        async def run() -> None:
            try:
                await (await shared.abranch(branch_id)).prefetch()
            except Exception as exc:  # noqa: BLE001 - a prefetch is only a hint
                logger.info("kvbranch: prefetch of %s/%s failed: %s", shared.session_id,
                            branch_id, exc)

        try:
            task = asyncio.get_running_loop().create_task(run())
            shared.tasks.add(task)
            task.add_done_callback(shared.tasks.discard)
        except Exception as exc:  # noqa: BLE001
            logger.info("kvbranch: could not start a prefetch: %s", exc)

    # --- sync -----------------------------------------------------------------------------
    def _chat(self, messages: Sequence[ChatMessage], kwargs: Mapping[str, Any]
              ) -> ChatResponse:
        msgs = to_openai_messages(messages)
        params = self._params(kwargs)
        schemas = tool_schemas(params.get("tools"))
        ids = self._shared.ids(self.branch_id)
        result = self._shared.client.chat(msgs, **ids, **params)
        message = to_chat_message(result, schemas)
        if self._record(msgs, result, message):
            self._prefetch_in_thread()
        return self._response(result, message, ids)

    def _stream(self, messages: Sequence[ChatMessage], kwargs: Mapping[str, Any]
                ) -> Iterator[ChatResponse]:
        msgs = to_openai_messages(messages)
        params = self._params(kwargs)
        schemas = tool_schemas(params.get("tools"))
        ids = self._shared.ids(self.branch_id)
        acc = ChatAccumulator()
        last_raw: Any = None
        with self._shared.client.chat_stream(msgs, **ids, **params) as stream:
            for chunk in stream:
                acc.add(chunk)
                last_raw = chunk.raw
                if chunk.content or chunk.tool_calls or chunk.reasoning:
                    yield self._partial(acc, chunk, schemas)
        result = stream.result
        message = to_chat_message(result, schemas)
        if self._record(msgs, result, message):
            self._prefetch_in_thread()
        yield self._response(result, message, ids, raw=last_raw, delta="")

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream(messages, kwargs)

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any
                 ) -> CompletionResponse:
        return _to_completion(self._chat([ChatMessage(role=MessageRole.USER, content=prompt)],
                                         kwargs))

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any
                        ) -> CompletionResponseGen:
        responses = self._stream([ChatMessage(role=MessageRole.USER, content=prompt)], kwargs)
        return (_to_completion(r) for r in responses)

    # --- async ----------------------------------------------------------------------------
    async def _achat(self, messages: Sequence[ChatMessage], kwargs: Mapping[str, Any]
                     ) -> ChatResponse:
        msgs = to_openai_messages(messages)
        params = self._params(kwargs)
        schemas = tool_schemas(params.get("tools"))
        ids = await self._shared.aids(self.branch_id)
        client = await self._shared.aclient()
        result = await client.chat(msgs, **ids, **params)
        message = to_chat_message(result, schemas)
        if self._record(msgs, result, message):
            self._prefetch_in_task()
        return self._response(result, message, ids)

    async def _astream(self, messages: Sequence[ChatMessage], kwargs: Mapping[str, Any]
                       ) -> AsyncIterator[ChatResponse]:
        msgs = to_openai_messages(messages)
        params = self._params(kwargs)
        schemas = tool_schemas(params.get("tools"))
        ids = await self._shared.aids(self.branch_id)
        client = await self._shared.aclient()
        acc = ChatAccumulator()
        last_raw: Any = None
        async with await client.chat_stream(msgs, **ids, **params) as stream:
            async for chunk in stream:
                acc.add(chunk)
                last_raw = chunk.raw
                if chunk.content or chunk.tool_calls or chunk.reasoning:
                    yield self._partial(acc, chunk, schemas)
        result = stream.result
        message = to_chat_message(result, schemas)
        if self._record(msgs, result, message):
            self._prefetch_in_task()
        yield self._response(result, message, ids, raw=last_raw, delta="")

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await self._achat(messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any
                           ) -> ChatResponseAsyncGen:
        return self._astream(messages, kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any
                        ) -> CompletionResponse:
        response = await self._achat([ChatMessage(role=MessageRole.USER, content=prompt)],
                                     kwargs)
        return _to_completion(response)

    @llm_completion_callback()
    async def astream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any
                               ) -> CompletionResponseAsyncGen:
        responses = self._astream([ChatMessage(role=MessageRole.USER, content=prompt)], kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            async for response in responses:
                yield _to_completion(response)

        return gen()

    # --- tools ----------------------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: Optional[Union[str, ChatMessage]] = None,
        chat_history: Optional[List[ChatMessage]] = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Any = None,
        **kwargs: Any,
    ) -> Dict[str, Any]:
        """``{"messages", "tools", "tool_choice", ...}`` for :meth:`chat`: OpenAI tool specs;
        ``tool_choice`` a tool name (forces it), ``"auto"``/``"required"``/``"none"`` or an
        OpenAI dict; ``tool_required`` without ``tool_choice`` means ``"required"``."""
        specs = [tool.metadata.to_openai_tool(skip_length_check=True) for tool in tools]
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg)
                            if isinstance(user_msg, str) else user_msg)
        out: Dict[str, Any] = {"messages": messages, **kwargs}
        if specs:
            out["tools"] = specs
            out["tool_choice"] = resolve_tool_choice(tool_choice, tool_required)
        return out

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[BaseTool],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        if not allow_parallel_tool_calls:
            _keep_first_tool_call(response)
        return response

    def get_tool_calls_from_response(
        self,
        response: ChatResponse,
        error_on_no_tool_call: bool = True,
        **kwargs: Any,
    ) -> List[ToolSelection]:
        """The tool calls of a response (its ``ToolCallBlock``\\ s, else OpenAI-style
        ``additional_kwargs["tool_calls"]``), with arguments as dicts."""
        selections: List[ToolSelection] = []
        blocks = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        if blocks:
            for i, block in enumerate(blocks):
                kwargs_ = block.tool_kwargs
                if not isinstance(kwargs_, dict):
                    kwargs_ = tool_kwargs(kwargs_, partial=True)
                selections.append(ToolSelection(tool_id=block.tool_call_id or f"call_{i}",
                                                tool_name=block.tool_name,
                                                tool_kwargs=kwargs_))
        else:
            for call in openai_tool_calls(response.message):
                fn = call["function"]
                selections.append(ToolSelection(tool_id=call["id"], tool_name=fn["name"],
                                                tool_kwargs=tool_kwargs(fn["arguments"],
                                                                        partial=True)))
        if not selections and error_on_no_tool_call:
            raise ValueError("Expected at least one tool call, but got 0 tool calls.")
        return selections


def _to_completion(response: ChatResponse) -> CompletionResponse:
    return CompletionResponse(text=response.message.content or "", delta=response.delta,
                              raw=response.raw, additional_kwargs=response.additional_kwargs)


def _keep_first_tool_call(response: ChatResponse) -> None:
    message = response.message
    calls = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
    if len(calls) > 1:
        message.blocks = [b for b in message.blocks
                          if not isinstance(b, ToolCallBlock) or b is calls[0]]
    raw = message.additional_kwargs.get("tool_calls")
    if isinstance(raw, list) and len(raw) > 1:
        message.additional_kwargs["tool_calls"] = raw[:1]
