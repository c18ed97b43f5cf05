"""``ChatKVBranch``: a LangChain chat model for kvbranch servers, on :mod:`sdk.conversation`.

(Over 400 lines because LangChain wants everything on the class: ~25 documented fields with
ChatOpenAI's names and aliases, the four generation hooks, the run-config overrides, tools and
structured output, and the kvbranch hooks. Each is a few lines; the work is in the sibling
modules: ``messages`` (conversion), ``langgraph`` (ids), ``structured`` (tools) and
:mod:`sdk.conversation` (ids, forks, prefetch).)

Swap ``ChatOpenAI(base_url=..., model=...)`` for ``ChatKVBranch(base_url=..., model=...)``:
invoke/stream/batch (sync and async), ``bind_tools`` (tool calls and streamed tool-call
chunks), ``with_structured_output`` (``json_schema``, ``function_calling``, ``json_mode``),
``usage_metadata`` with ``input_token_details["cache_read"]``, stop sequences, callbacks,
LangSmith ``ls_*`` params, and the sdk's timeouts and retries all behave as LangChain users
expect. On top, every request names a kvbranch **session** and **branch**, so the server keeps
that conversation's KV cache between turns:

* per model instance: ``ChatKVBranch(session_id="s1")`` (or ``auto_session=True`` for a fresh id);
* per call: ``model.invoke(msgs, session_id=..., branch_id=...)``, or the run config -
  ``config={"configurable": {"thread_id": "t1"}}`` / ``{"metadata": {"kvbranch_session_id":
  ...}}``;
* LangGraph, with no code change: the ``thread_id`` LangGraph puts in the run metadata is the
  session; after a time-travel fork (``checkpoint_id`` in the metadata) the call goes to a
  branch of its own, forked on the server from the session's ``main`` where the prompt agrees
  (:mod:`integrations.langchain.langgraph`);
* :meth:`ChatKVBranch.fork` returns a model bound to a new branch (alternative plans, parallel
  graph nodes). The fork happens on the server at once when the session is known, else lazily
  at the branch's first call;
* when the model emits a tool call, the branch is prefetched in the background
  (``prefetch_on_tool_call``) so its KV is warm when the tool result comes back;
  :meth:`pin`/:meth:`unpin`/:meth:`prefetch` are the explicit hooks.

LangChain keeps the history; the model and all its copies share one
:class:`sdk.conversation.Conversation`, which keeps the ids, the forks and the prefetches.
``response_metadata`` carries ``model_name``, ``finish_reason``, ``id``, ``token_usage``,
the kvbranch ``session_id``/``branch_id``, the prompt-source split (``kvbranch``: device /
host / recomputed tokens) and, for streams, ``ttft_s``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LangSmithParams, LanguageModelInput
from langchain_core.language_models.chat_models import agenerate_from_stream, generate_from_stream
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage
from langchain_core.messages.utils import convert_to_messages
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from integrations.langchain.langgraph import (
    BRANCH_KEY,
    SESSION_KEY,
    ModelIds,
    config_ref,
    lift_config,
    resolve_ref,
)
from integrations.langchain.messages import final_chunk, to_chat_result, to_chunk, to_wire_messages
from integrations.langchain.structured import (
    ToolLike,
    bind_tools_to,
    openai_tool_choice,
    structured_runnable,
)
from sdk import AsyncKVBranchClient, BranchInfo, KVBranchClient, PrefetchResult, RetryPolicy
from sdk.conversation import BranchRef, ClientSet, Conversation, coerce_id

__all__ = ["ChatKVBranch", "SESSION_KEY", "BRANCH_KEY"]

logger = logging.getLogger("kvbranch.langchain")

_SAMPLING = ("temperature", "max_tokens", "top_p", "seed")
_Input = LanguageModelInput
_Config = RunnableConfig | None
_Chunks = Iterator[AIMessageChunk]
_AChunks = AsyncIterator[AIMessageChunk]
_Msgs = list[BaseMessage]
_Stop = list[str] | None
_Run = CallbackManagerForLLMRun | None
_ARun = AsyncCallbackManagerForLLMRun | None


@dataclass(frozen=True)
class _Request:
    """One call, in the sdk's shape: where it goes, its messages, the chat parameters."""

    ref: BranchRef
    messages: list[dict[str, Any]]
    params: dict[str, Any]


class ChatKVBranch(BaseChatModel):
    """LangChain chat model for a kvbranch (or any OpenAI-compatible) server.

    Example:
        .. code-block:: python

            from integrations.langchain import ChatKVBranch

            llm = ChatKVBranch(base_url="http://127.0.0.1:8000", model="SmolLM2-135M-Instruct",
                               temperature=0, max_tokens=64, session_id="chat-42")
            llm.invoke("Hi!").usage_metadata["input_token_details"]["cache_read"]
            plan_b = llm.fork()             # same session, new branch
    """

    model_config = ConfigDict(populate_by_name=True, arbitrary_types_allowed=True)

    # --- model and sampling (ChatOpenAI names and aliases) ---------------------------------
    model_name: str | None = Field(default=None, alias="model")
    """Served model name; default: the server's first model."""
    temperature: float | None = None
    max_tokens: int | None = Field(default=None, alias="max_completion_tokens")
    top_p: float | None = None
    seed: int | None = None
    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    """Default stop sequences (merged with a call's ``stop``)."""
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Other request-body parameters (e.g. ``presence_penalty``, ``logprobs``)."""
    extra_body: dict[str, Any] | None = None
    """Merged into the request body last (any server-specific parameter)."""

    # --- transport -------------------------------------------------------------------------
    base_url: str | None = Field(default=None, alias="openai_api_base")
    """Server root (``/v1`` suffix accepted); default ``$KVBRANCH_BASE_URL``,
    ``$OPENAI_BASE_URL``, then ``http://127.0.0.1:8000``."""
    api_key: SecretStr | None = Field(default=None, alias="openai_api_key")
    timeout: float | None = Field(default=None, alias="request_timeout")
    """Seconds to wait for a response (or between stream chunks); default 600."""
    max_retries: int | None = None
    """Retries after the first attempt (sdk policy: connection errors, 429, 502-504; a
    stream only before its first byte). Default: the sdk's (3 retries within 60 s)."""
    default_headers: dict[str, str] | None = None
    transport: Any = Field(default=None, exclude=True)
    """An ``httpx.BaseTransport`` for the sync client (tests: ``httpx.MockTransport``)."""
    async_transport: Any = Field(default=None, exclude=True)
    """An ``httpx.AsyncBaseTransport`` for the async clients."""
    streaming: bool = False
    """``invoke`` streams internally (callbacks get tokens)."""
    stream_usage: bool = True
    """Ask for the usage chunk at the end of streams (``usage_metadata`` when streaming)."""

    # --- kvbranch sessions -----------------------------------------------------------------
    session_id: str | None = None
    """Session of every call of this model (unless a call names its own)."""
    branch_id: str | None = None
    """Branch of every call (default ``main``)."""
    auto_session: bool = False
    """Without ``session_id``: make a fresh session id for this model instance."""
    use_langgraph_ids: bool = True
    """Take the session from ``thread_id`` and a branch from ``checkpoint_id`` in the run
    metadata (what LangGraph passes) when the model has no ``session_id`` of its own."""
    fork_parent: str | None = None
    """Set by :meth:`fork`: the branch this model's branch forks from (used to fork it on the
    server at its first call when the session was not known at fork time)."""
    prefetch_on_tool_call: bool = True
    """After an answer with tool calls, prefetch the branch in the background."""
    strict_tools: bool | None = None
    """``strict`` of :meth:`bind_tools` when a binding does not say. ``None``: the tool specs
    carry none, and a kvbranch server marks them ``strict`` itself (vLLM then constrains the
    arguments by the tool's JSON schema); ``True`` asks for that of any OpenAI-compatible
    server, plain vLLM included; ``False`` opts out (free-form arguments)."""
    kvbranch: bool | None = None
    """``True``/``False`` to skip the probe for the kvbranch routes (``None``: probe once)."""

    _conversation: Conversation = PrivateAttr()

    @model_validator(mode="after")
    def _setup(self) -> ChatKVBranch:
        if self.session_id is None and self.auto_session:
            self.session_id = f"lc-{secrets.token_hex(8)}"
        if self.max_retries is not None and self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        retry = (
            RetryPolicy(max_attempts=self.max_retries + 1) if self.max_retries is not None else None
        )
        clients = ClientSet(
            self.base_url,
            api_key=self.api_key.get_secret_value() if self.api_key else None,
            model=self.model_name,
            timeout=self.timeout if self.timeout is not None else 600.0,
            retry=retry,
            default_headers=self.default_headers,
            kvbranch=self.kvbranch,
            transport=self.transport,
            async_transport=self.async_transport,
        )
        # shared by every copy (fork, bind): clients, lazy forks, background prefetches
        self._conversation = Conversation(clients, logger=logger)
        return self

    # --- LangChain plumbing ----------------------------------------------------------------
    @property
    def _llm_type(self) -> str:
        return "kvbranch-chat"

    @classmethod
    def is_lc_serializable(cls) -> bool:
        return False

    @property
    def _identifying_params(self) -> dict[str, Any]:
        return {
            "model_name": self.model_name,
            "base_url": self.base_url,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
            "top_p": self.top_p,
            "seed": self.seed,
            "stop": self.stop,
            "session_id": self.session_id,
            "branch_id": self.branch_id,
            **self.model_kwargs,
        }

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="kvbranch",
            ls_model_type="chat",
            ls_model_name=kwargs.get("model") or self.model_name or "unknown",
        )
        temperature = kwargs.get("temperature", self.temperature)
        if temperature is not None:
            params["ls_temperature"] = temperature
        max_tokens = kwargs.get("max_tokens", self.max_tokens)
        if max_tokens is not None:
            params["ls_max_tokens"] = max_tokens
        ls_stop = stop or kwargs.get("stop") or self.stop
        if ls_stop:
            params["ls_stop"] = ls_stop
        return params

    # run config -> run metadata (so configurable thread_id etc. reach _generate)
    def invoke(self, input: _Input, config: _Config = None, **kw: Any) -> AIMessage:
        return super().invoke(input, lift_config(config), **kw)

    async def ainvoke(self, input: _Input, config: _Config = None, **kw: Any) -> AIMessage:
        return await super().ainvoke(input, lift_config(config), **kw)

    def stream(self, input: _Input, config: _Config = None, **kw: Any) -> _Chunks:
        return super().stream(input, lift_config(config), **kw)

    def astream(self, input: _Input, config: _Config = None, **kw: Any) -> _AChunks:
        return super().astream(input, lift_config(config), **kw)

    # --- clients ---------------------------------------------------------------------------
    @property
    def conversation(self) -> Conversation:
        """The kvbranch side of this model and its copies (ids, forks, prefetches)."""
        return self._conversation

    @property
    def client(self) -> KVBranchClient:
        """The sync sdk client (made on first use, shared with forks and bindings)."""
        return self._conversation.clients.sync

    @property
    def async_client(self) -> AsyncKVBranchClient:
        """The async sdk client of the running event loop."""
        return self._conversation.clients.current()

    # --- requests --------------------------------------------------------------------------
    def _ids(self) -> ModelIds:
        return ModelIds(self.session_id, self.branch_id, self.fork_parent, self.use_langgraph_ids)

    def _request(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None,
        run_manager: CallbackManagerForLLMRun | AsyncCallbackManagerForLLMRun | None,
        stream: bool,
        kwargs: dict[str, Any],
    ) -> _Request:
        """The call in the sdk's shape, built once: named chat parameters (call kwargs over
        the model's fields) and ``extra_body`` (``model_kwargs`` < named fields < other call
        kwargs < the model's ``extra_body``, as the body is merged)."""
        ref = resolve_ref(self._ids(), kwargs, run_manager.metadata if run_manager else None)
        params: dict[str, Any] = {"model": kwargs.pop("model", None) or self.model_name}
        extra = dict(self.model_kwargs)
        for name in _SAMPLING:
            value = kwargs.pop(name, None)
            value = getattr(self, name) if value is None else value
            if value is not None:
                params[name] = value
                extra.pop(name, None)
        stops = list(self.stop or []) + [s for s in (stop or []) if s not in (self.stop or [])]
        if stops:
            params["stop"] = stops
            extra.pop("stop", None)
        tools = kwargs.pop("tools", None)
        choice = kwargs.pop("tool_choice", None)
        if tools:
            params["tools"] = tools
            params["tool_choice"] = openai_tool_choice(choice, tools)
        if stream and not self.stream_usage:
            extra["stream_options"] = {"include_usage": False}
        kwargs.pop("stream", None)
        extra.update({k: v for k, v in kwargs.items() if v is not None})
        extra.update(self.extra_body or {})
        params["extra_body"] = extra or None
        return _Request(ref, to_wire_messages(messages), params)

    # --- generation ------------------------------------------------------------------------
    def _generate(
        self, messages: _Msgs, stop: _Stop = None, run_manager: _Run = None, **kwargs: Any
    ) -> ChatResult:
        if self.streaming:
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        call = self._request(messages, stop, run_manager, False, kwargs)
        result, _ = self._conversation.chat(
            call.ref, call.messages, prefetch_on_tool_call=self.prefetch_on_tool_call, **call.params
        )
        return to_chat_result(result, call.ref)

    async def _agenerate(
        self, messages: _Msgs, stop: _Stop = None, run_manager: _ARun = None, **kwargs: Any
    ) -> ChatResult:
        if self.streaming:
            chunks = self._astream(messages, stop, run_manager, **kwargs)
            return await agenerate_from_stream(chunks)
        call = self._request(messages, stop, run_manager, False, kwargs)
        on_tool_call = self.prefetch_on_tool_call
        result, _ = await self._conversation.achat(
            call.ref, call.messages, prefetch_on_tool_call=on_tool_call, **call.params
        )
        return to_chat_result(result, call.ref)

    def _stream(
        self, messages: _Msgs, stop: _Stop = None, run_manager: _Run = None, **kwargs: Any
    ) -> Iterator[ChatGenerationChunk]:
        call = self._request(messages, stop, run_manager, True, kwargs)
        stream, _ = self._conversation.chat_stream(
            call.ref, call.messages, prefetch_on_tool_call=self.prefetch_on_tool_call, **call.params
        )
        with stream:
            chunks = (to_chunk(c) for c in stream)
            yield from (c for c in chunks if c is not None)
        yield final_chunk(stream.result, call.ref)

    async def _astream(
        self, messages: _Msgs, stop: _Stop = None, run_manager: _ARun = None, **kwargs: Any
    ) -> AsyncIterator[ChatGenerationChunk]:
        call = self._request(messages, stop, run_manager, True, kwargs)
        on_tool_call = self.prefetch_on_tool_call
        stream, _ = await self._conversation.achat_stream(
            call.ref, call.messages, prefetch_on_tool_call=on_tool_call, **call.params
        )
        async with stream:
            async for chunk in stream:
                if (out := to_chunk(chunk)) is not None:
                    yield out
        yield final_chunk(stream.result, call.ref)

    # --- tools and structured output -------------------------------------------------------
    def bind_tools(
        self,
        tools: Sequence[ToolLike],
        *,
        tool_choice: dict[str, Any] | str | bool | None = None,
        strict: bool | None = None,
        parallel_tool_calls: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (OpenAI tool schemas; pydantic classes, TypedDicts, functions and
        ``BaseTool``\\ s are converted). ``tool_choice``: ``"auto"``, ``"none"``,
        ``"any"``/``"required"``/``True``, a tool name, or an OpenAI tool_choice dict.
        ``strict``: default :attr:`strict_tools`."""
        return bind_tools_to(
            self,
            tools,
            choice=tool_choice,
            strict=self.strict_tools if strict is None else strict,
            parallel_tool_calls=parallel_tool_calls,
            **kwargs,
        )

    def with_structured_output(
        self,
        schema: dict[str, Any] | type | None = None,
        *,
        method: Literal["json_schema", "function_calling", "json_mode"] = "json_schema",
        include_raw: bool = False,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, Any]:
        """Structured output. ``json_schema`` (default) has the server constrain the answer
        to the schema (``response_format``); ``function_calling`` forces a call of a tool
        with that schema; ``json_mode`` asks for any JSON object (describe the schema in the
        prompt)."""
        if kwargs:
            raise ValueError(f"unsupported arguments: {sorted(kwargs)}")
        return structured_runnable(
            self, schema, method=method, include_raw=include_raw, strict=strict
        )

    # --- sessions, branches, pins ----------------------------------------------------------
    def _fork_call(
        self,
        branch_id: str | None,
        at_messages: Sequence[Any] | None,
        config: RunnableConfig | None,
    ) -> tuple[BranchRef, str, list[dict[str, Any]] | None]:
        parent = config_ref(self._ids(), config)
        new = coerce_id(branch_id) if branch_id else f"br-{secrets.token_hex(6)}"
        assert new is not None
        wire = None
        if at_messages is not None:
            wire = to_wire_messages(convert_to_messages(list(at_messages)))
        return parent, new, wire

    def _bound_to(self, child: BranchRef) -> ChatKVBranch:
        return self.model_copy(
            update={
                "session_id": child.session_id,
                "branch_id": child.branch_id,
                "fork_parent": child.fork_parent,
            }
        )

    def fork(
        self,
        branch_id: str | None = None,
        *,
        at_messages: Sequence[Any] | None = None,
        config: RunnableConfig | None = None,
    ) -> ChatKVBranch:
        """A copy of this model bound to a new branch of the same session, forked from this
        model's branch (``main`` by default): at the end of its last sequence, or where
        ``at_messages`` end. With no session known yet (e.g. a LangGraph thread, known only
        at call time), the server-side fork happens at the new branch's first call, where
        its prompt agrees with the parent. Server errors only lose cache sharing."""
        parent, new, wire = self._fork_call(branch_id, at_messages, config)
        return self._bound_to(self._conversation.fork(parent, new, at_messages=wire))

    async def afork(
        self,
        branch_id: str | None = None,
        *,
        at_messages: Sequence[Any] | None = None,
        config: RunnableConfig | None = None,
    ) -> ChatKVBranch:
        """Async :meth:`fork`."""
        parent, new, wire = self._fork_call(branch_id, at_messages, config)
        return self._bound_to(await self._conversation.afork(parent, new, at_messages=wire))

    def _require(self, config: RunnableConfig | None) -> BranchRef:
        ref = config_ref(self._ids(), config)
        if ref.session_id is None:
            raise ValueError(
                "no kvbranch session: set session_id (or auto_session=True), or "
                "pass a config with a thread_id / kvbranch_session_id"
            )
        return ref

    def pin(self, ttl_s: float, *, config: RunnableConfig | None = None) -> BranchInfo | None:
        """Keep this model's branch (or ``config``'s) in the server's host store for
        ``ttl_s`` seconds, renewed by each use. ``None`` on a server without kvbranch."""
        return self._conversation.pin(self._require(config), ttl_s)

    def unpin(self, *, config: RunnableConfig | None = None) -> BranchInfo | None:
        return self._conversation.unpin(self._require(config))

    def prefetch(self, *, config: RunnableConfig | None = None) -> PrefetchResult | None:
        """Ask the server to warm the device cache with the branch (returns at once)."""
        return self._conversation.prefetch(self._require(config))

    def branch_info(self, *, config: RunnableConfig | None = None) -> BranchInfo | None:
        return self._conversation.info(self._require(config))

    def delete_session(self, *, config: RunnableConfig | None = None) -> None:
        """Delete the session on the server (releases its pins)."""
        session_id = self._require(config).session_id
        assert session_id is not None
        self._conversation.delete_session(session_id)

    def close(self) -> None:
        """Close the sync client (async clients close with their event loop)."""
        self._conversation.close()
