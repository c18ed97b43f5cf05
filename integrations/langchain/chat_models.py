"""``ChatKVBranch``: a LangChain chat model for kvbranch servers, built on :mod:`sdk`.

Swap ``ChatOpenAI(base_url=..., model=...)`` for ``ChatKVBranch(base_url=..., model=...)``:
invoke/stream/batch (sync and async), ``bind_tools`` (tool calls and streamed tool-call
chunks), ``with_structured_output`` (``json_schema``, ``function_calling``, ``json_mode``),
``usage_metadata`` with ``input_token_details["cache_read"]``, stop sequences, callbacks,
LangSmith ``ls_*`` params, and the sdk's timeouts and retries all behave as LangChain users
expect. On top, every request names a kvbranch **session** and **branch**, so the server keeps
that conversation's KV cache between turns:

* per model instance: ``ChatKVBranch(session_id="s1")`` (or ``auto_session=True`` for a fresh id);
* per call: ``model.invoke(msgs, session_id=..., branch_id=...)``, or the run config —
  ``config={"configurable": {"thread_id": "t1"}}`` / ``{"metadata": {"kvbranch_session_id":
  ...}}``;
* LangGraph, with no code change: the ``thread_id`` LangGraph puts in the run metadata is the
  session; after a time-travel fork (``checkpoint_id`` in the metadata) the call goes to a
  branch of its own, forked on the server from the session's ``main`` where the prompt agrees;
* :meth:`ChatKVBranch.fork` returns a model bound to a new branch (alternative plans, parallel
  graph nodes). The fork happens on the server at once when the session is known, else lazily
  at the branch's first call;
* when the model emits a tool call, the branch is prefetched in the background
  (``prefetch_on_tool_call``) so its KV is warm when the tool result comes back;
  :meth:`pin`/:meth:`unpin`/:meth:`prefetch` are the explicit hooks.

``response_metadata`` carries ``model_name``, ``finish_reason``, ``id``, ``token_usage``,
the kvbranch ``session_id``/``branch_id``, the prompt-source split (``kvbranch``: device /
host / recomputed tokens) and, for streams, ``ttft_s``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import threading
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.callbacks import (
    AsyncCallbackManagerForLLMRun,
    CallbackManagerForLLMRun,
)
from langchain_core.language_models import LanguageModelInput
from langchain_core.language_models.chat_models import (
    BaseChatModel,
    LangSmithParams,
    agenerate_from_stream,
    generate_from_stream,
)
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    InvalidToolCall,
    ToolCall,
    ToolCallChunk,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.utils import convert_to_openai_messages
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.base import OutputParserLike
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult
from langchain_core.runnables import (
    Runnable,
    RunnableConfig,
    RunnableMap,
    RunnablePassthrough,
)
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

import sdk
from sdk import (
    DEFAULT_BRANCH,
    AsyncKVBranchClient,
    BadRequestError,
    ConflictError,
    KVBranchClient,
    KVBranchError,
    NotFoundError,
    RetryPolicy,
)
from sdk.types import ChatChunk as SdkChunk
from sdk.types import ChatResult as SdkResult

__all__ = ["ChatKVBranch"]

logger = logging.getLogger("kvbranch.langchain")

#: Run-metadata / ``configurable`` keys read for the session and branch of a call.
SESSION_KEY = "kvbranch_session_id"
BRANCH_KEY = "kvbranch_branch_id"
_LIFTED_KEYS = (SESSION_KEY, BRANCH_KEY, "thread_id", "checkpoint_id")
_ID_OK = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")


def _as_id(value: Any, prefix: str = "") -> str | None:
    """A valid kvbranch id for ``value`` (LangGraph ids are usually already valid)."""
    if value is None or value == "":
        return None
    text = prefix + str(value)
    text = "".join(c if c in _ID_OK else "-" for c in text)
    if not text[0].isalnum():
        text = "x" + text
    return text[:128]


def _lift_config(config: RunnableConfig | None) -> RunnableConfig | None:
    """Copy session-related ``configurable`` keys into ``metadata`` (LangGraph already does
    this for ``thread_id``/``checkpoint_id``; plain LangChain only for a few keys), so the
    chat model sees them in ``run_manager.metadata``."""
    if not config or not config.get("configurable"):
        return config
    configurable = config["configurable"]
    extra = {k: configurable[k] for k in _LIFTED_KEYS
             if isinstance(configurable.get(k), (str, int)) and configurable.get(k) != ""}
    if not extra:
        return config
    metadata = dict(config.get("metadata") or {})
    for key, value in extra.items():
        metadata.setdefault(key, value)
    return {**config, "metadata": metadata}


def _to_wire_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages → OpenAI chat messages (text content as plain strings)."""
    out = convert_to_openai_messages(list(messages), text_format="string")
    for message in out:
        content = message.get("content")
        if message.get("role") in ("assistant", "tool", "system") and isinstance(content, list):
            # v1 content blocks: keep the text; tool calls travel in ``tool_calls``
            message["content"] = "".join(
                b if isinstance(b, str) else (b.get("text") or "")
                for b in content if isinstance(b, str) or b.get("type") == "text")
        if message.get("role") == "assistant" and message.get("tool_calls") \
                and not message.get("content"):
            message["content"] = None
    return out


def _tool_calls_of(result: SdkResult) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for tc in result.tool_calls:
        try:
            args = json.loads(tc.arguments) if tc.arguments.strip() else {}
            error = None if isinstance(args, dict) else (
                f"arguments must be a JSON object, got {type(args).__name__}")
        except ValueError as exc:
            args, error = None, f"arguments are not valid JSON: {exc}"
        if error is None:
            calls.append(ToolCall(name=tc.name, args=args, id=tc.id or None, type="tool_call"))
        else:
            invalid.append(InvalidToolCall(name=tc.name, args=tc.arguments, id=tc.id or None,
                                           error=error, type="invalid_tool_call"))
    return calls, invalid


def _usage_metadata(usage: sdk.Usage | None) -> UsageMetadata | None:
    if usage is None:
        return None
    meta = UsageMetadata(input_tokens=usage.prompt_tokens,
                         output_tokens=usage.completion_tokens,
                         total_tokens=usage.total_tokens
                         or usage.prompt_tokens + usage.completion_tokens)
    if usage.cached_tokens is not None:
        meta["input_token_details"] = InputTokenDetails(cache_read=usage.cached_tokens)
    return meta


def _tool_choice(tool_choice: Any, tools: Sequence[dict[str, Any]]) -> Any:
    """LangChain's tool_choice spellings → OpenAI's."""
    if tool_choice is None or isinstance(tool_choice, dict):
        return tool_choice
    if tool_choice is True or tool_choice == "any":
        return "required"
    if tool_choice is False:
        return "none"
    if tool_choice in ("auto", "none", "required"):
        return tool_choice
    if isinstance(tool_choice, str):
        names = [t["function"]["name"] for t in tools]
        if names and tool_choice not in names:
            raise ValueError(f"tool_choice {tool_choice!r} is not one of the bound tools "
                             f"{names}")
        return {"type": "function", "function": {"name": tool_choice}}
    raise ValueError(f"unsupported tool_choice {tool_choice!r}")


class _Call:
    """Everything one request needs, resolved from fields, call kwargs and run metadata."""

    def __init__(self, payload: dict[str, Any], session_id: str | None,
                 branch_id: str | None, fork_parent: str | None) -> None:
        self.payload = payload
        self.session_id = session_id
        self.branch_id = branch_id
        self.fork_parent = fork_parent


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
    kvbranch: bool | None = None
    """``True``/``False`` to skip the probe for the kvbranch routes (``None``: probe once)."""

    _client: KVBranchClient | None = PrivateAttr(default=None)
    # Keyed by the loop object itself, weakly: ``id(loop)`` values are reused after a loop is
    # collected, which handed a new loop a client whose connections belonged to a dead one.
    _aclients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncKVBranchClient] = \
        PrivateAttr(default_factory=weakref.WeakKeyDictionary)
    _state: dict[str, Any] = PrivateAttr(default_factory=dict)
    _lock: threading.Lock = PrivateAttr(default_factory=threading.Lock)

    @model_validator(mode="after")
    def _setup(self) -> ChatKVBranch:
        if self.session_id is None and self.auto_session:
            self.session_id = f"lc-{secrets.token_hex(8)}"
        if self.max_retries is not None and self.max_retries < 0:
            raise ValueError("max_retries must be >= 0")
        # shared by copies (fork, bind): which (session, branch) pairs exist on the server
        self._state.setdefault("forked", set())
        self._state.setdefault("tasks", set())
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
        return {"model_name": self.model_name, "base_url": self.base_url,
                "temperature": self.temperature, "max_tokens": self.max_tokens,
                "top_p": self.top_p, "seed": self.seed, "stop": self.stop,
                "session_id": self.session_id, "branch_id": self.branch_id,
                **self.model_kwargs}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(ls_provider="kvbranch",
                                 ls_model_name=kwargs.get("model") or self.model_name
                                 or "unknown",
                                 ls_model_type="chat")
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

    # run config → run metadata (so configurable thread_id etc. reach _generate)
    def invoke(self, input: LanguageModelInput, config: RunnableConfig | None = None,
               *, stop: list[str] | None = None, **kwargs: Any) -> AIMessage:
        return super().invoke(input, _lift_config(config), stop=stop, **kwargs)

    async def ainvoke(self, input: LanguageModelInput, config: RunnableConfig | None = None,
                      *, stop: list[str] | None = None, **kwargs: Any) -> AIMessage:
        return await super().ainvoke(input, _lift_config(config), stop=stop, **kwargs)

    def stream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
               stop: list[str] | None = None, **kwargs: Any) -> Iterator[AIMessageChunk]:
        return super().stream(input, _lift_config(config), stop=stop, **kwargs)

    def astream(self, input: LanguageModelInput, config: RunnableConfig | None = None, *,
                stop: list[str] | None = None, **kwargs: Any
                ) -> AsyncIterator[AIMessageChunk]:
        return super().astream(input, _lift_config(config), stop=stop, **kwargs)

    # --- clients ---------------------------------------------------------------------------
    def _client_kwargs(self) -> dict[str, Any]:
        return dict(api_key=self.api_key.get_secret_value() if self.api_key else None,
                    model=self.model_name,
                    timeout=self.timeout if self.timeout is not None else 600.0,
                    retry=(RetryPolicy(max_attempts=self.max_retries + 1)
                           if self.max_retries is not None else None),
                    default_headers=self.default_headers, kvbranch=self.kvbranch)

    @property
    def client(self) -> KVBranchClient:
        """The sync sdk client (made on first use, shared with forks and bindings)."""
        with self._lock:
            if self._client is None:
                self._client = KVBranchClient(self.base_url, transport=self.transport,
                                              **self._client_kwargs())
            return self._client

    @property
    def async_client(self) -> AsyncKVBranchClient:
        """The async sdk client of the running event loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._aclients.get(loop)
            if client is None:
                # one client per loop: httpx async connections belong to their loop; clients
                # of closed loops are dropped (their connections died with the loop)
                for stale in [other for other in list(self._aclients) if other.is_closed()]:
                    self._aclients.pop(stale, None)
                client = AsyncKVBranchClient(self.base_url, transport=self.async_transport,
                                             **self._client_kwargs())
                self._aclients[loop] = client
            return client

    # --- request building ------------------------------------------------------------------
    def _resolve_ids(self, kwargs: dict[str, Any], metadata: Mapping[str, Any] | None
                     ) -> tuple[str | None, str | None, str | None]:
        """(session, branch, fork parent) of a call. Precedence: call kwargs, run metadata
        ``kvbranch_*`` keys, the model's own ids, then LangGraph's thread/checkpoint ids."""
        metadata = metadata or {}
        session = kwargs.pop("session_id", None) or metadata.get(SESSION_KEY)
        branch = kwargs.pop("branch_id", None) or metadata.get(BRANCH_KEY)
        parent = self.fork_parent
        if session is None:
            session = self.session_id
        if session is None and self.use_langgraph_ids and metadata.get("thread_id"):
            session = _as_id(metadata["thread_id"])
            if branch is None and self.branch_id is None and metadata.get("checkpoint_id"):
                # time travel: continue on a branch of that checkpoint, forked from main
                branch = _as_id(metadata["checkpoint_id"], "ckpt-")
                parent = DEFAULT_BRANCH
        if branch is None:
            branch = self.branch_id
        if session is None:
            return None, None, None
        return (_as_id(session), _as_id(branch) if branch else None,
                parent if branch and branch != DEFAULT_BRANCH else None)

    def _build(self, messages: list[BaseMessage], stop: list[str] | None,
               metadata: Mapping[str, Any] | None, stream: bool, **kwargs: Any) -> _Call:
        session, branch, parent = self._resolve_ids(kwargs, metadata)
        body: dict[str, Any] = {**self.model_kwargs}
        for name in ("temperature", "max_tokens", "top_p", "seed"):
            value = kwargs.pop(name, None)
            if value is None:
                value = getattr(self, name)
            if value is not None:
                body[name] = value
        model = kwargs.pop("model", None) or self.model_name
        if model:
            body["model"] = model
        stops = list(self.stop or []) + [s for s in (stop or []) if s not in (self.stop or [])]
        if stops:
            body["stop"] = stops
        tools = kwargs.pop("tools", None)
        if tools:
            body["tools"] = tools
            choice = _tool_choice(kwargs.pop("tool_choice", None), tools)
            if choice is not None:
                body["tool_choice"] = choice
        else:
            kwargs.pop("tool_choice", None)
        if stream and not self.stream_usage:
            body["stream_options"] = {"include_usage": False}
        kwargs.pop("stream", None)
        body.update({k: v for k, v in kwargs.items() if v is not None})
        body.update(self.extra_body or {})
        body["messages"] = _to_wire_messages(messages)
        return _Call(body, session, branch, parent)

    def _sdk_args(self, call: _Call, kvbranch_on: bool) -> dict[str, Any]:
        body = dict(call.payload)
        messages = body.pop("messages")
        args: dict[str, Any] = {"model": body.pop("model", None)}
        for name in ("temperature", "max_tokens", "stop", "tools", "tool_choice", "top_p",
                     "seed"):
            if name in body:
                args[name] = body.pop(name)
        if kvbranch_on and call.session_id:
            args["session_id"] = call.session_id
            if call.branch_id:
                args["branch_id"] = call.branch_id
        args["extra_body"] = body or None
        return {"messages": messages, **args}

    # --- metadata of answers ---------------------------------------------------------------
    @staticmethod
    def _response_metadata(result: SdkResult | None, call: _Call, *, model: str | None,
                           finish_reason: str | None, usage: sdk.Usage | None,
                           split: Any, id_: str | None, ttft_s: float | None = None
                           ) -> dict[str, Any]:
        meta: dict[str, Any] = {"model_provider": "kvbranch", "model_name": model,
                                "finish_reason": finish_reason}
        if id_:
            meta["id"] = id_
        if usage is not None:
            raw = {"prompt_tokens": usage.prompt_tokens,
                   "completion_tokens": usage.completion_tokens,
                   "total_tokens": usage.total_tokens}
            if usage.cached_tokens is not None:
                raw["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
            meta["token_usage"] = raw
        if call.session_id:
            meta["session_id"] = call.session_id
            meta["branch_id"] = call.branch_id or DEFAULT_BRANCH
        if split is not None:
            meta["kvbranch"] = split.model_dump()
        if ttft_s is not None:
            meta["ttft_s"] = ttft_s
        if result is not None and result.latency_s is not None:
            meta["latency_s"] = result.latency_s
        return meta

    def _to_chat_result(self, result: SdkResult, call: _Call) -> ChatResult:
        calls, invalid = _tool_calls_of(result)
        additional: dict[str, Any] = {}
        if result.reasoning:
            additional["reasoning_content"] = result.reasoning
        meta = self._response_metadata(result, call, model=result.model,
                                       finish_reason=result.finish_reason,
                                       usage=result.usage, split=result.split, id_=result.id)
        message = AIMessage(content=result.text, tool_calls=calls, invalid_tool_calls=invalid,
                            additional_kwargs=additional, response_metadata=meta,
                            usage_metadata=_usage_metadata(result.usage))
        return ChatResult(generations=[ChatGeneration(
            message=message, generation_info={"finish_reason": result.finish_reason})],
            llm_output={"model_name": result.model, "token_usage": meta.get("token_usage")})

    # --- kvbranch side calls (best effort) -------------------------------------------------
    def _need_fork(self, call: _Call) -> bool:
        if not (call.session_id and call.branch_id and call.fork_parent):
            return False
        key = (call.session_id, call.branch_id)
        with self._lock:
            if key in self._state["forked"]:
                return False
            self._state["forked"].add(key)
            return True

    def _fork_on_server(self, call: _Call, messages: list[dict[str, Any]]) -> None:
        """Fork ``call``'s branch from its parent where ``messages`` agree with it (once per
        branch); the chat would otherwise create it empty. Errors only lose cache sharing."""
        client = self.client
        try:
            client.fork_branch(call.session_id, parent=call.fork_parent,  # type: ignore[arg-type]
                               branch_id=call.branch_id, messages=messages)
        except ConflictError:
            pass
        except BadRequestError:
            try:
                client.fork_branch(call.session_id, parent=call.fork_parent,  # type: ignore
                                   branch_id=call.branch_id, token_offset=0)
            except KVBranchError as exc:
                logger.debug("kvbranch: fork of %s failed: %s", call.branch_id, exc)
        except KVBranchError as exc:  # parent unknown yet, server without kvbranch, ...
            logger.debug("kvbranch: fork of %s/%s failed: %s", call.session_id,
                         call.branch_id, exc)

    async def _afork_on_server(self, call: _Call, messages: list[dict[str, Any]]) -> None:
        client = self.async_client
        try:
            await client.fork_branch(call.session_id, parent=call.fork_parent,  # type: ignore
                                     branch_id=call.branch_id, messages=messages)
        except ConflictError:
            pass
        except BadRequestError:
            try:
                await client.fork_branch(call.session_id, parent=call.fork_parent,  # type: ignore
                                         branch_id=call.branch_id, token_offset=0)
            except KVBranchError as exc:
                logger.debug("kvbranch: fork of %s failed: %s", call.branch_id, exc)
        except KVBranchError as exc:
            logger.debug("kvbranch: fork of %s/%s failed: %s", call.session_id,
                         call.branch_id, exc)

    def _prefetch_in_background(self, session: str, branch: str) -> None:
        client = self.client

        def run() -> None:
            try:
                client.prefetch_branch(session, branch)
            except Exception as exc:  # noqa: BLE001 - a hint; never fails the turn
                logger.debug("kvbranch: prefetch of %s/%s failed: %s", session, branch, exc)

        threading.Thread(target=run, name="kvbranch-prefetch", daemon=True).start()

    def _aprefetch_in_background(self, session: str, branch: str) -> None:
        client = self.async_client

        async def run() -> None:
            try:
                await client.prefetch_branch(session, branch)
            except Exception as exc:  # noqa: BLE001
                logger.debug("kvbranch: prefetch of %s/%s failed: %s", session, branch, exc)

        task = asyncio.get_running_loop().create_task(run())
        tasks: set = self._state["tasks"]
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    def _after(self, call: _Call, has_tool_calls: bool, kvbranch_on: bool, *,
               asynchronous: bool = False) -> None:
        if has_tool_calls and self.prefetch_on_tool_call and kvbranch_on and call.session_id:
            branch = call.branch_id or DEFAULT_BRANCH
            if asynchronous:
                self._aprefetch_in_background(call.session_id, branch)
            else:
                self._prefetch_in_background(call.session_id, branch)

    def _kvbranch_on(self, call: _Call) -> bool:
        return bool(call.session_id) and self.client.kvbranch_available()

    async def _akvbranch_on(self, call: _Call) -> bool:
        return bool(call.session_id) and await self.async_client.kvbranch_available()

    # --- generation ------------------------------------------------------------------------
    def _generate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                  run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
                  ) -> ChatResult:
        if self.streaming:
            return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))
        call = self._build(messages, stop, run_manager.metadata if run_manager else None,
                           False, **kwargs)
        on = self._kvbranch_on(call)
        args = self._sdk_args(call, on)
        if on and self._need_fork(call):
            self._fork_on_server(call, args["messages"])
        result = self.client.chat(**args)
        chat_result = self._to_chat_result(result, call)
        self._after(call, bool(result.tool_calls), on)
        return chat_result

    async def _agenerate(self, messages: list[BaseMessage], stop: list[str] | None = None,
                         run_manager: AsyncCallbackManagerForLLMRun | None = None,
                         **kwargs: Any) -> ChatResult:
        if self.streaming:
            return await agenerate_from_stream(
                self._astream(messages, stop, run_manager, **kwargs))
        call = self._build(messages, stop, run_manager.metadata if run_manager else None,
                           False, **kwargs)
        on = await self._akvbranch_on(call)
        args = self._sdk_args(call, on)
        if on and self._need_fork(call):
            await self._afork_on_server(call, args["messages"])
        result = await self.async_client.chat(**args)
        chat_result = self._to_chat_result(result, call)
        self._after(call, bool(result.tool_calls), on, asynchronous=True)
        return chat_result

    def _chunk_of(self, chunk: SdkChunk) -> ChatGenerationChunk | None:
        """A content/tool-call delta as a LangChain chunk (``None`` when it has neither)."""
        tool_chunks = [ToolCallChunk(name=d.name, args=d.arguments, id=d.id, index=d.index,
                                     type="tool_call_chunk") for d in chunk.tool_calls]
        additional = {"reasoning_content": chunk.reasoning} if chunk.reasoning else {}
        if not (chunk.content or tool_chunks or additional):
            return None
        return ChatGenerationChunk(message=AIMessageChunk(
            content=chunk.content or "", tool_call_chunks=tool_chunks,
            additional_kwargs=additional))

    def _final_chunk(self, call: _Call, state: dict[str, Any], ttft_s: float | None
                     ) -> ChatGenerationChunk:
        """The last chunk: model name, finish reason, kvbranch split and the usage (each
        carried by exactly one chunk of the stream)."""
        meta = self._response_metadata(None, call, model=state["model"],
                                       finish_reason=state["finish"], usage=state["usage"],
                                       split=state["split"], id_=state["id"], ttft_s=ttft_s)
        return ChatGenerationChunk(
            message=AIMessageChunk(content="", response_metadata=meta,
                                   usage_metadata=_usage_metadata(state["usage"]),
                                   chunk_position="last"),
            generation_info={"finish_reason": state["finish"], "model_name": state["model"]})

    @staticmethod
    def _fold(state: dict[str, Any], chunk: SdkChunk) -> None:
        state["id"] = state["id"] or chunk.id
        state["model"] = state["model"] or chunk.model
        state["finish"] = chunk.finish_reason or state["finish"]
        state["usage"] = chunk.usage or state["usage"]
        state["split"] = chunk.split or state["split"]
        state["tools"] = state["tools"] or bool(chunk.tool_calls)

    def _stream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                run_manager: CallbackManagerForLLMRun | None = None, **kwargs: Any
                ) -> Iterator[ChatGenerationChunk]:
        call = self._build(messages, stop, run_manager.metadata if run_manager else None,
                           True, **kwargs)
        on = self._kvbranch_on(call)
        args = self._sdk_args(call, on)
        if on and self._need_fork(call):
            self._fork_on_server(call, args["messages"])
        state = dict(id=None, model=None, finish=None, usage=None, split=None, tools=False)
        with self.client.chat_stream(**args) as stream:
            for chunk in stream:
                self._fold(state, chunk)
                out = self._chunk_of(chunk)
                if out is not None:
                    yield out
            ttft = stream.ttft_s
        self._after(call, state["tools"], on)
        yield self._final_chunk(call, state, ttft)

    async def _astream(self, messages: list[BaseMessage], stop: list[str] | None = None,
                       run_manager: AsyncCallbackManagerForLLMRun | None = None,
                       **kwargs: Any) -> AsyncIterator[ChatGenerationChunk]:
        call = self._build(messages, stop, run_manager.metadata if run_manager else None,
                           True, **kwargs)
        on = await self._akvbranch_on(call)
        args = self._sdk_args(call, on)
        if on and self._need_fork(call):
            await self._afork_on_server(call, args["messages"])
        state = dict(id=None, model=None, finish=None, usage=None, split=None, tools=False)
        stream = await self.async_client.chat_stream(**args)
        async with stream:
            async for chunk in stream:
                self._fold(state, chunk)
                out = self._chunk_of(chunk)
                if out is not None:
                    yield out
        self._after(call, state["tools"], on, asynchronous=True)
        yield self._final_chunk(call, state, stream.ttft_s)

    # --- tools and structured output -------------------------------------------------------
    def bind_tools(self, tools: Sequence[dict[str, Any] | type | Callable | BaseTool], *,
                   tool_choice: dict | str | bool | None = None, strict: bool | None = None,
                   parallel_tool_calls: bool | None = None, **kwargs: Any
                   ) -> Runnable[LanguageModelInput, AIMessage]:
        """Bind tools (OpenAI tool schemas; pydantic classes, TypedDicts, functions and
        ``BaseTool``\\ s are converted). ``tool_choice``: ``"auto"``, ``"none"``,
        ``"any"``/``"required"``/``True``, a tool name, or an OpenAI tool_choice dict."""
        formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
        if tool_choice is not None:
            _tool_choice(tool_choice, formatted)  # validate now, not at the first call
            kwargs["tool_choice"] = tool_choice
        if parallel_tool_calls is not None:
            kwargs["parallel_tool_calls"] = parallel_tool_calls
        return super().bind(tools=formatted, **kwargs)

    def with_structured_output(self, schema: dict[str, Any] | type | None = None, *,
                               method: Literal["json_schema", "function_calling",
                                               "json_mode"] = "json_schema",
                               include_raw: bool = False, strict: bool | None = None,
                               **kwargs: Any) -> Runnable[LanguageModelInput, Any]:
        """Structured output. ``json_schema`` (default) has the server constrain the answer
        to the schema (``response_format``); ``function_calling`` forces a call of a tool
        with that schema; ``json_mode`` asks for any JSON object (describe the schema in the
        prompt)."""
        if kwargs:
            raise ValueError(f"unsupported arguments: {sorted(kwargs)}")
        if schema is None and method != "json_mode":
            raise ValueError(f"schema is required for method={method!r}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        ls_format = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
        parser: OutputParserLike
        if method == "function_calling":
            tool_name = convert_to_openai_tool(schema)["function"]["name"]  # type: ignore
            llm = self.bind_tools([schema], tool_choice=tool_name, strict=strict,  # type: ignore
                                  ls_structured_output_format=ls_format)
            parser = (PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore
                      if is_pydantic else
                      JsonOutputKeyToolsParser(key_name=tool_name, first_tool_only=True))
        elif method == "json_schema":
            function = convert_to_openai_tool(schema, strict=strict)["function"]  # type: ignore
            json_schema: dict[str, Any] = {"name": function["name"],
                                           "schema": function.get("parameters") or {}}
            if function.get("description"):
                json_schema["description"] = function["description"]
            if strict is not None:
                json_schema["strict"] = strict
            llm = self.bind(response_format={"type": "json_schema",
                                             "json_schema": json_schema},
                            ls_structured_output_format=ls_format)
            parser = (PydanticOutputParser(pydantic_object=schema)  # type: ignore[arg-type]
                      if is_pydantic else JsonOutputParser())
        elif method == "json_mode":
            llm = self.bind(response_format={"type": "json_object"},
                            ls_structured_output_format=ls_format)
            parser = (PydanticOutputParser(pydantic_object=schema)  # type: ignore[arg-type]
                      if is_pydantic else JsonOutputParser())
        else:
            raise ValueError(f"method must be 'json_schema', 'function_calling' or "
                             f"'json_mode', got {method!r}")
        if not include_raw:
            return llm | parser
        parser_with_fallback = RunnablePassthrough.assign(
            parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
        ).with_fallbacks([RunnablePassthrough.assign(parsed=lambda _: None)],
                         exception_key="parsing_error")
        return RunnableMap(raw=llm) | parser_with_fallback

    # --- sessions, branches, pins ----------------------------------------------------------
    def _ids_for(self, config: RunnableConfig | None) -> tuple[str | None, str]:
        metadata = dict((_lift_config(config) or {}).get("metadata") or {})
        session, branch, _ = self._resolve_ids({}, metadata)
        return session, branch or DEFAULT_BRANCH

    def _fork_args(self, branch_id: str | None, at_messages: Sequence[Any] | None,
                   config: RunnableConfig | None) -> tuple[str | None, str, str, Any]:
        session, parent = self._ids_for(config)
        new = _as_id(branch_id) if branch_id else f"br-{secrets.token_hex(6)}"
        wire = None
        if at_messages is not None:
            from langchain_core.messages.utils import convert_to_messages
            wire = _to_wire_messages(convert_to_messages(list(at_messages)))
        return session, parent, new, wire  # type: ignore[return-value]

    def fork(self, branch_id: str | None = None, *, at_messages: Sequence[Any] | None = None,
             config: RunnableConfig | None = None) -> ChatKVBranch:
        """A copy of this model bound to a new branch of the same session, forked from this
        model's branch (``main`` by default): at the end of its last sequence, or where
        ``at_messages`` end. With no session known yet (e.g. a LangGraph thread, known only
        at call time), the server-side fork happens at the new branch's first call, where
        its prompt agrees with the parent. Server errors only lose cache sharing."""
        session, parent, new, wire = self._fork_args(branch_id, at_messages, config)
        forked = self.model_copy(update={"session_id": session, "branch_id": new,
                                         "fork_parent": parent})
        if session is not None and self.client.kvbranch_available():
            call = _Call({}, session, new, parent)
            with self._lock:
                self._state["forked"].add((session, new))
            try:
                self.client.fork_branch(session, parent=parent, branch_id=new, messages=wire)
            except ConflictError:
                pass
            except NotFoundError:
                with self._lock:  # parent not on the server yet: fork at the first call
                    self._state["forked"].discard((session, new))
            except BadRequestError:  # messages the chat template cannot render
                self._fork_on_server(call, [{"role": "user", "content": ""}])
            except KVBranchError as exc:
                logger.warning("kvbranch: fork of %s/%s failed (%s); the branch works, "
                               "without sharing the parent's cache", session, new, exc)
        return forked

    async def afork(self, branch_id: str | None = None, *,
                    at_messages: Sequence[Any] | None = None,
                    config: RunnableConfig | None = None) -> ChatKVBranch:
        """Async :meth:`fork`."""
        session, parent, new, wire = self._fork_args(branch_id, at_messages, config)
        forked = self.model_copy(update={"session_id": session, "branch_id": new,
                                         "fork_parent": parent})
        client = self.async_client
        if session is not None and await client.kvbranch_available():
            call = _Call({}, session, new, parent)
            with self._lock:
                self._state["forked"].add((session, new))
            try:
                await client.fork_branch(session, parent=parent, branch_id=new, messages=wire)
            except ConflictError:
                pass
            except NotFoundError:
                with self._lock:  # parent not on the server yet: fork at the first call
                    self._state["forked"].discard((session, new))
            except BadRequestError:  # messages the chat template cannot render (as fork)
                await self._afork_on_server(call, [{"role": "user", "content": ""}])
            except KVBranchError as exc:
                logger.warning("kvbranch: fork of %s/%s failed (%s)", session, new, exc)
        return forked

    def _require(self, config: RunnableConfig | None) -> tuple[str, str] | None:
        session, branch = self._ids_for(config)
        if session is None:
            raise ValueError("no kvbranch session: set session_id (or auto_session=True), or "
                             "pass a config with a thread_id / kvbranch_session_id")
        if not self.client.kvbranch_available():
            return None
        return session, branch

    def pin(self, ttl_s: float, *, config: RunnableConfig | None = None
            ) -> sdk.BranchInfo | None:
        """Keep this model's branch (or ``config``'s) in the server's host store for
        ``ttl_s`` seconds, renewed by each use. ``None`` on a server without kvbranch."""
        ids = self._require(config)
        return None if ids is None else self.client.pin_branch(*ids, ttl_s)

    def unpin(self, *, config: RunnableConfig | None = None) -> sdk.BranchInfo | None:
        ids = self._require(config)
        return None if ids is None else self.client.unpin_branch(*ids)

    def prefetch(self, *, config: RunnableConfig | None = None) -> sdk.PrefetchResult | None:
        """Ask the server to warm the device cache with the branch (returns at once)."""
        ids = self._require(config)
        return None if ids is None else self.client.prefetch_branch(*ids)

    def branch_info(self, *, config: RunnableConfig | None = None) -> sdk.BranchInfo | None:
        ids = self._require(config)
        return None if ids is None else self.client.get_branch(*ids)

    def delete_session(self, *, config: RunnableConfig | None = None) -> None:
        """Delete the session on the server (releases its pins)."""
        ids = self._require(config)
        if ids is not None:
            try:
                self.client.delete_session(ids[0])
            except NotFoundError:
                pass

    def close(self) -> None:
        """Close the sync client (async clients close with their event loop)."""
        if self._client is not None:
            self._client.close()
            self._client = None

