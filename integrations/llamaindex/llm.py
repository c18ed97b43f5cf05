"""``KVBranchLLM``: a LlamaIndex ``FunctionCallingLLM`` over the kvbranch sdk.

(Over 400 lines because LlamaIndex wants its whole surface on the class: 17 documented fields,
chat/stream/complete in sync and async, the tool-calling hooks, forks and lifecycle. Each is a
few lines; request and response shaping is in ``_responses``, conversions in ``_convert``,
server facts in ``_facts``, and ids, forks and prefetch in :mod:`sdk.conversation`.)

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
call sends the messages LlamaIndex gives it, as they are, on that branch: LlamaIndex keeps the
history. The LLM and its forks share one :class:`sdk.conversation.Conversation`, which keeps
the ids, each branch's last exchange (the last request's messages plus the answer:
:attr:`KVBranchLLM.history`, where :meth:`KVBranchLLM.fork` cuts and what the sdk re-creates
the branch from if the server lost it) and the background prefetches. ``fork()``/``afork()``
return a new ``KVBranchLLM`` bound to a new branch of the same session (server-side fork: the
common prefix's blocks are shared, not copied). When an answer contains a tool call, the
branch is prefetched in the background (``prefetch_on_tool_call``), so the turn carrying the
tool result starts warm; a failed prefetch is logged, never raised.

What the server reports comes back on every ``ChatResponse``/``CompletionResponse``:
``additional_kwargs`` holds ``prompt_tokens``, ``completion_tokens``, ``total_tokens``,
``cached_tokens`` (dropped by ``OpenAILike``), ``kvbranch`` (where the prompt's tokens came from:
``device_hit_tokens``, ``host_hit_tokens``, ``recomputed_tokens``), ``ttft_s`` (streams) and
``latency_s``; ``raw`` is the server's JSON (the last chunk, for streams).

Tool calls: ``tools``/``tool_choice`` are OpenAI's; ``tool_required=True`` sends
``tool_choice="required"`` and a tool name forces that tool. ``strict_tools`` (or a call's
``strict``) sets each tool spec's ``strict``: ``None`` (default) sends none, and a kvbranch
server then marks the tools ``strict`` itself, so vLLM constrains the arguments by the tool's
JSON schema; ``True`` asks for that from any OpenAI-compatible server (plain vLLM included);
``False`` opts out (free-form arguments). Arguments are read leniently (see
:func:`integrations.llamaindex._convert.tool_kwargs`): a model that writes a bare value instead
of a JSON object gets it mapped onto the tool's single parameter.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import TYPE_CHECKING, Any

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

from integrations.llamaindex._convert import (
    openai_tool_calls,
    resolve_tool_choice,
    tool_kwargs,
    with_strict,
)
from integrations.llamaindex._facts import ServerFacts
from integrations.llamaindex._responses import (
    Turn,
    chat_params,
    keep_first_tool_call,
    to_completion,
)
from sdk import (
    DEFAULT_BRANCH,
    AsyncBranch,
    Branch,
    RetryPolicy,
    Session,
)
from sdk._common import resolve_base_url
from sdk.contract import check_id
from sdk.conversation import BranchRef, ClientSet, Conversation, SessionSettings

if TYPE_CHECKING:
    from llama_index.core.tools.types import BaseTool

__all__ = ["KVBranchLLM"]

logger = logging.getLogger("kvbranch.llamaindex")


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
        strict_tools: ``strict`` of every tool spec (a call's ``strict`` overrides it);
            ``None``: left out (a kvbranch server marks the tools strict), ``True``: the
            arguments constrained by the tool's schema on any vLLM, ``False``: free-form.
        additional_kwargs: extra request-body parameters of every request.
        transport: an httpx transport for the sdk clients (tests: ``FakeKVBranchServer``).
    """

    model: str | None = Field(
        default=None, description="Model name; default: the server's first model."
    )
    base_url: str = Field(
        default_factory=lambda: resolve_base_url(None),
        description="kvbranch (or OpenAI-compatible) server root.",
    )
    api_key: str | None = Field(default=None, exclude=True, repr=False)
    temperature: float | None = Field(default=None, ge=0.0)
    max_tokens: int | None = Field(default=None, gt=0)
    context_window: int | None = Field(
        default=None, gt=0, description="Default: the server's max_model_len."
    )
    timeout: float = Field(default=600.0, gt=0)
    max_retries: int = Field(default=3, ge=0)
    session_id: str | None = Field(
        default=None, description="kvbranch session id (default: a new unique one)."
    )
    branch_id: str = Field(
        default=DEFAULT_BRANCH, description="The branch this instance is bound to."
    )
    auto_pin: bool = True
    pin_ttl_s: float | None = Field(default=None, gt=0)
    prefetch_on_tool_call: bool = True
    strict_tools: bool | None = Field(
        default=None,
        description="strict of every tool spec; None: left to the server (kvbranch: strict).",
    )
    is_function_calling_model: bool = True
    additional_kwargs: dict[str, Any] = Field(default_factory=dict)
    default_headers: dict[str, str] | None = None

    _conversation: Conversation = PrivateAttr()
    _facts: ServerFacts = PrivateAttr()

    def __init__(
        self,
        *,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.base_url = resolve_base_url(self.base_url)
        if self.session_id is None:
            self.session_id = f"li-{secrets.token_hex(8)}"
        check_id(self.session_id, "session_id")
        check_id(self.branch_id, "branch_id")
        headers = dict(self.default_headers or {})
        clients = ClientSet(
            self.base_url,
            api_key=self.api_key,
            model=self.model,
            timeout=self.timeout,
            retry=RetryPolicy(max_attempts=self.max_retries + 1),
            default_headers=headers,
            transport=transport if isinstance(transport, httpx.BaseTransport) else None,
            async_transport=transport if isinstance(transport, httpx.AsyncBaseTransport) else None,
        )
        settings = SessionSettings(self.session_id, self.auto_pin, self.pin_ttl_s)
        # shared with every fork: clients, the session, branches' last exchanges, prefetches
        self._conversation = Conversation(clients, session=settings, logger=logger)
        self._facts = ServerFacts(self.model, headers, transport)

    @classmethod
    def class_name(cls) -> str:
        return "KVBranchLLM"

    # --- metadata -------------------------------------------------------------------------
    @property
    def metadata(self) -> LLMMetadata:
        window = (
            self.context_window
            or self._facts.probe(self.base_url, self.api_key)
            or DEFAULT_CONTEXT_WINDOW
        )
        return LLMMetadata(
            context_window=window,
            num_output=self.max_tokens or DEFAULT_NUM_OUTPUTS,
            is_chat_model=True,
            is_function_calling_model=self.is_function_calling_model,
            model_name=self.model or self._facts.model_name or "unknown",
        )

    # --- sessions and branches ------------------------------------------------------------
    @property
    def _ref(self) -> BranchRef:
        return BranchRef(self.session_id, self.branch_id)

    @property
    def session(self) -> Session:
        """The sdk :class:`~sdk.Session` of this LLM and its forks (created on the server on
        first use)."""
        return self._conversation.session()

    @property
    def branch(self) -> Branch:
        """The sdk :class:`~sdk.Branch` this LLM is bound to, with its history (``pin``,
        ``unpin``, ``prefetch``, ``info``)."""
        return self._conversation.branch(self.branch_id)

    async def abranch(self) -> AsyncBranch:
        """:attr:`branch` as an :class:`~sdk.AsyncBranch`."""
        return await self._conversation.abranch(self.branch_id)

    @property
    def history(self) -> list[dict[str, Any]]:
        """The branch's history (OpenAI messages): the last request's messages and its
        answer, or what the branch forked with."""
        return self._conversation.last_exchange(self.branch_id)

    def fork(self, at_message: int | None = None, *, branch_id: str | None = None) -> KVBranchLLM:
        """A ``KVBranchLLM`` bound to a new branch of this session whose history is this
        branch's ``history[:at_message]`` (default all of it). The server forks its cache at
        the same point. The new instance shares this one's clients and session."""
        child = self._conversation.fork_owned(self._ref, at_message, branch_id=branch_id)
        return self.model_copy(update={"branch_id": child.branch_id})

    async def afork(
        self, at_message: int | None = None, *, branch_id: str | None = None
    ) -> KVBranchLLM:
        """:meth:`fork` over the async client."""
        child = await self._conversation.afork_owned(self._ref, at_message, branch_id=branch_id)
        return self.model_copy(update={"branch_id": child.branch_id})

    def wait_for_prefetch(self, timeout: float | None = 30.0) -> None:
        """Wait for background prefetches started by sync calls."""
        self._conversation.wait_prefetches(timeout)

    async def await_prefetch(self, timeout: float | None = 30.0) -> None:
        """Wait for background prefetches started by async calls in this event loop."""
        await self._conversation.await_prefetches(timeout)

    def delete_session(self) -> None:
        """Delete the session on the server (releasing its pins and blocks)."""
        assert self.session_id is not None
        self._conversation.delete_session(self.session_id)

    def close(self) -> None:
        """Close the sync client (shared with forks)."""
        self._conversation.close()

    async def aclose(self) -> None:
        """Wait for pending prefetches, then close the clients (shared with forks)."""
        await self._conversation.aclose()

    # --- chat -----------------------------------------------------------------------------
    def _turn(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> Turn:
        defaults = {"temperature": self.temperature, "max_tokens": self.max_tokens}
        return Turn(
            messages,
            chat_params(
                kwargs, defaults=defaults, additional=self.additional_kwargs, model=self.model
            ),
        )

    def _chat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        turn = self._turn(messages, kwargs)
        result, ids = self._conversation.chat(
            self._ref,
            turn.messages,
            prefetch_on_tool_call=self.prefetch_on_tool_call,
            **turn.params,
        )
        self._facts.saw(result)
        return turn.response(result, ids)

    def _stream(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> Iterator[ChatResponse]:
        turn = self._turn(messages, kwargs)
        stream, ids = self._conversation.chat_stream(
            self._ref,
            turn.messages,
            prefetch_on_tool_call=self.prefetch_on_tool_call,
            **turn.params,
        )
        with stream:
            for chunk in stream:
                yield from turn.partial(chunk)
        self._facts.saw(stream.result)
        yield turn.response(stream.result, ids, streamed=True)

    async def _achat(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> ChatResponse:
        turn = self._turn(messages, kwargs)
        on_tool_call = self.prefetch_on_tool_call
        result, ids = await self._conversation.achat(
            self._ref, turn.messages, prefetch_on_tool_call=on_tool_call, **turn.params
        )
        self._facts.saw(result)
        return turn.response(result, ids)

    async def _astream(
        self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]
    ) -> AsyncIterator[ChatResponse]:
        turn = self._turn(messages, kwargs)
        on_tool_call = self.prefetch_on_tool_call
        stream, ids = await self._conversation.achat_stream(
            self._ref, turn.messages, prefetch_on_tool_call=on_tool_call, **turn.params
        )
        async with stream:
            async for chunk in stream:
                for response in turn.partial(chunk):
                    yield response
        self._facts.saw(stream.result)
        yield turn.response(stream.result, ids, streamed=True)

    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, kwargs)

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream(messages, kwargs)  # type: ignore[return-value]

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return to_completion(
            self._chat([ChatMessage(role=MessageRole.USER, content=prompt)], kwargs)
        )

    @llm_completion_callback()
    def stream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseGen:
        responses = self._stream([ChatMessage(role=MessageRole.USER, content=prompt)], kwargs)
        return (to_completion(r) for r in responses)

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await self._achat(messages, kwargs)

    @llm_chat_callback()
    async def astream_chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> ChatResponseAsyncGen:
        return self._astream(messages, kwargs)  # type: ignore[return-value]

    @llm_completion_callback()
    async def acomplete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponse:
        response = await self._achat([ChatMessage(role=MessageRole.USER, content=prompt)], kwargs)
        return to_completion(response)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        responses = self._astream([ChatMessage(role=MessageRole.USER, content=prompt)], kwargs)

        async def gen() -> CompletionResponseAsyncGen:
            async for response in responses:
                yield to_completion(response)

        return gen()

    # --- tools ----------------------------------------------------------------------------
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        tool_choice: Any = None,
        strict: bool | None = None,
        **kwargs: Any,
    ) -> dict[str, Any]:
        """``{"messages", "tools", "tool_choice", ...}`` for :meth:`chat`: OpenAI tool specs;
        ``tool_choice`` a tool name (forces it), ``"auto"``/``"required"``/``"none"`` or an
        OpenAI dict; ``tool_required`` without ``tool_choice`` means ``"required"``;
        ``strict`` (default :attr:`strict_tools`) each spec's ``strict`` when not ``None``."""
        strict = self.strict_tools if strict is None else strict
        specs = [
            with_strict(tool.metadata.to_openai_tool(skip_length_check=True), strict)
            for tool in tools
        ]
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(
                ChatMessage(role=MessageRole.USER, content=user_msg)
                if isinstance(user_msg, str)
                else user_msg
            )
        out: dict[str, Any] = {"messages": messages, **kwargs}
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
            keep_first_tool_call(response)
        return response

    def get_tool_calls_from_response(
        self,
        response: ChatResponse,
        error_on_no_tool_call: bool = True,
        **kwargs: Any,
    ) -> list[ToolSelection]:
        """The tool calls of a response (its ``ToolCallBlock``\\ s, else OpenAI-style
        ``additional_kwargs["tool_calls"]``), with arguments as dicts."""
        selections: list[ToolSelection] = []
        blocks = [b for b in response.message.blocks if isinstance(b, ToolCallBlock)]
        if blocks:
            for i, block in enumerate(blocks):
                kwargs_ = block.tool_kwargs
                if not isinstance(kwargs_, dict):
                    kwargs_ = tool_kwargs(kwargs_, partial=True)
                selections.append(
                    ToolSelection(
                        tool_id=block.tool_call_id or f"call_{i}",
                        tool_name=block.tool_name,
                        tool_kwargs=kwargs_,
                    )
                )
        else:
            for call in openai_tool_calls(response.message):
                fn = call["function"]
                selections.append(
                    ToolSelection(
                        tool_id=call["id"],
                        tool_name=fn["name"],
                        tool_kwargs=tool_kwargs(fn["arguments"], partial=True),
                    )
                )
        if not selections and error_on_no_tool_call:
            raise ValueError("Expected at least one tool call, but got 0 tool calls.")
        return selections
