"""How :class:`~integrations.llamaindex.KVBranchLLM` turns LlamaIndex call kwargs into sdk chat
parameters, and sdk answers (whole or streamed) into ``ChatResponse``\\ s carrying what the
server reported. Pure functions and one small per-call object; no I/O."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    CompletionResponse,
    ToolCallBlock,
)

from integrations.llamaindex._convert import to_chat_message, to_openai_messages, tool_schemas
from sdk import ChatChunk, ChatResult
from sdk.types import ChatAccumulator

__all__ = ["Turn", "chat_params", "to_completion", "keep_first_tool_call"]

# Keyword arguments LlamaIndex may hand to chat() that are not request parameters.
_NOT_PARAMS = frozenset(
    {
        "verbose",
        "allow_parallel_tool_calls",
        "tool_required",
        "error_on_no_tool_call",
        "error_on_tool_error",
        "formatted",
    }
)
_PARAMS = ("temperature", "max_tokens", "stop", "top_p", "seed", "tools", "tool_choice")


def chat_params(
    kwargs: Mapping[str, Any],
    *,
    defaults: Mapping[str, Any],
    additional: Mapping[str, Any],
    model: str | None,
) -> dict[str, Any]:
    """sdk chat parameters: the named ones (``defaults`` fill ``temperature``/``max_tokens``),
    ``extra_body`` (the LLM's ``additional_kwargs``, then the call's ``extra_body``, then any
    other call kwarg, e.g. ``response_format``) and ``extra_headers``."""
    kw = dict(kwargs)
    params: dict[str, Any] = {}
    for name in _PARAMS:
        value = kw.pop(name, None)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            params[name] = value
    if not params.get("tools"):
        params.pop("tools", None)
        params.pop("tool_choice", None)
    extra = {**additional, **(kw.pop("extra_body", None) or {})}
    headers = kw.pop("extra_headers", None)
    for name in _NOT_PARAMS:
        kw.pop(name, None)
    extra.update(kw)
    if extra:
        params["extra_body"] = extra
    if headers:
        params["extra_headers"] = headers
    if model:
        params["model"] = model
    return params


class Turn:
    """One call: the messages in OpenAI form, the chat parameters, and (streams) the partial
    answer so far, so that every streamed response carries the whole message up to then."""

    def __init__(self, messages: Sequence[ChatMessage], params: dict[str, Any]) -> None:
        self.messages = to_openai_messages(messages)
        self.params = params
        self.schemas = tool_schemas(params.get("tools"))
        self._acc = ChatAccumulator()
        self._last_raw: Any = None

    def partial(self, chunk: ChatChunk) -> list[ChatResponse]:
        """The response for a streamed chunk (none for a chunk without content, tool-call or
        reasoning deltas)."""
        self._acc.add(chunk)
        self._last_raw = chunk.raw
        if not (chunk.content or chunk.tool_calls or chunk.reasoning):
            return []
        extra: dict[str, Any] = {"thinking_delta": chunk.reasoning} if chunk.reasoning else {}
        message = to_chat_message(self._acc.result(), self.schemas, partial=True)
        return [
            ChatResponse(
                message=message, raw=chunk.raw, delta=chunk.content or "", additional_kwargs=extra
            )
        ]

    def response(
        self, result: ChatResult, ids: Mapping[str, str], *, streamed: bool = False
    ) -> ChatResponse:
        """The whole answer, with the usage, the kvbranch split and timings in
        ``additional_kwargs``; a stream's last response has ``delta=""`` and the last chunk
        as ``raw``."""
        return ChatResponse(
            message=to_chat_message(result, self.schemas),
            raw=self._last_raw if streamed else result.raw,
            delta="" if streamed else None,
            additional_kwargs=_info(result, ids),
        )


def _info(result: ChatResult, ids: Mapping[str, str]) -> dict[str, Any]:
    usage = result.usage
    return {
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


def to_completion(response: ChatResponse) -> CompletionResponse:
    return CompletionResponse(
        text=response.message.content or "",
        delta=response.delta,
        raw=response.raw,
        additional_kwargs=response.additional_kwargs,
    )


def keep_first_tool_call(response: ChatResponse) -> None:
    """Cut a response to its first tool call (LlamaIndex's ``allow_parallel_tool_calls``)."""
    message = response.message
    calls = [b for b in message.blocks if isinstance(b, ToolCallBlock)]
    if len(calls) > 1:
        message.blocks = [
            b for b in message.blocks if not isinstance(b, ToolCallBlock) or b is calls[0]
        ]
    raw = message.additional_kwargs.get("tool_calls")
    if isinstance(raw, list) and len(raw) > 1:
        message.additional_kwargs["tool_calls"] = raw[:1]
