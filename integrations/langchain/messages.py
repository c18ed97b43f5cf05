"""LangChain messages and outputs <-> the OpenAI wire format the sdk speaks. Pure functions (no
I/O): messages to send, an sdk answer (whole or streamed) as an ``AIMessage``/chunk with
``usage_metadata`` and the kvbranch ``response_metadata``."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, cast

from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    InvalidToolCall,
    ToolCall,
    ToolCallChunk,
)
from langchain_core.messages.ai import InputTokenDetails, UsageMetadata
from langchain_core.messages.tool import invalid_tool_call, tool_call
from langchain_core.messages.utils import convert_to_openai_messages
from langchain_core.outputs import ChatGeneration, ChatGenerationChunk, ChatResult

from sdk import DEFAULT_BRANCH, ChatChunk, Usage
from sdk import ChatResult as SdkResult
from sdk.conversation import BranchRef

__all__ = [
    "to_wire_messages",
    "tool_calls_of",
    "usage_metadata",
    "response_metadata",
    "to_chat_result",
    "to_chunk",
    "final_chunk",
]


def to_wire_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """LangChain messages -> OpenAI chat messages (text content as plain strings)."""
    out = convert_to_openai_messages(list(messages), text_format="string")
    for message in out:
        content = message.get("content")
        if message.get("role") in ("assistant", "tool", "system") and isinstance(content, list):
            # v1 content blocks: keep the text; tool calls travel in ``tool_calls``
            message["content"] = "".join(
                b if isinstance(b, str) else (b.get("text") or "")
                for b in content
                if isinstance(b, str) or b.get("type") == "text"
            )
        if (
            message.get("role") == "assistant"
            and message.get("tool_calls")
            and not message.get("content")
        ):
            message["content"] = None
    return out


def tool_calls_of(result: SdkResult) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    """The answer's tool calls; arguments that are not a JSON object make an invalid call."""
    calls: list[ToolCall] = []
    invalid: list[InvalidToolCall] = []
    for tc in result.tool_calls:
        try:
            args: Any = json.loads(tc.arguments) if tc.arguments.strip() else {}
            error = None
        except ValueError as exc:
            args, error = None, f"arguments are not valid JSON: {exc}"
        if isinstance(args, dict):
            calls.append(tool_call(name=tc.name, args=args, id=tc.id or None))
            continue
        error = error or f"arguments must be a JSON object, got {type(args).__name__}"
        invalid.append(
            invalid_tool_call(name=tc.name, args=tc.arguments, id=tc.id or None, error=error)
        )
    return calls, invalid


def usage_metadata(usage: Usage | None) -> UsageMetadata | None:
    """LangChain usage; ``cached_tokens`` becomes ``input_token_details["cache_read"]``."""
    if usage is None:
        return None
    meta: dict[str, Any] = {
        "input_tokens": usage.prompt_tokens,
        "output_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens or usage.prompt_tokens + usage.completion_tokens,
    }
    if usage.cached_tokens is not None:
        meta["input_token_details"] = InputTokenDetails(cache_read=usage.cached_tokens)
    return cast(UsageMetadata, meta)


def response_metadata(result: SdkResult, ref: BranchRef, *, streamed: bool) -> dict[str, Any]:
    """``model_name``, ``finish_reason``, ``id``, ``token_usage`` (OpenAI's shape), the
    call's ``session_id``/``branch_id``, the prompt-source split (``kvbranch``) and
    ``ttft_s`` (streams) or ``latency_s`` (whole answers)."""
    meta: dict[str, Any] = {
        "model_provider": "kvbranch",
        "model_name": result.model,
        "finish_reason": result.finish_reason,
    }
    if result.id:
        meta["id"] = result.id
    usage = result.usage
    if usage is not None:
        raw: dict[str, Any] = {
            "prompt_tokens": usage.prompt_tokens,
            "completion_tokens": usage.completion_tokens,
            "total_tokens": usage.total_tokens,
        }
        if usage.cached_tokens is not None:
            raw["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
        meta["token_usage"] = raw
    if ref.session_id:
        meta["session_id"] = ref.session_id
        meta["branch_id"] = ref.branch_id or DEFAULT_BRANCH
    if result.split is not None:
        meta["kvbranch"] = result.split.model_dump()
    timing = result.ttft_s if streamed else result.latency_s
    if timing is not None:
        meta["ttft_s" if streamed else "latency_s"] = timing
    return meta


def to_chat_result(result: SdkResult, ref: BranchRef) -> ChatResult:
    """A whole sdk answer as LangChain's ``ChatResult``."""
    calls, invalid = tool_calls_of(result)
    additional: dict[str, Any] = {}
    if result.reasoning:
        additional["reasoning_content"] = result.reasoning
    meta = response_metadata(result, ref, streamed=False)
    message = AIMessage(
        content=result.text,
        tool_calls=calls,
        invalid_tool_calls=invalid,
        additional_kwargs=additional,
        response_metadata=meta,
        usage_metadata=usage_metadata(result.usage),
    )
    return ChatResult(
        generations=[
            ChatGeneration(message=message, generation_info={"finish_reason": result.finish_reason})
        ],
        llm_output={"model_name": result.model, "token_usage": meta.get("token_usage")},
    )


def to_chunk(chunk: ChatChunk) -> ChatGenerationChunk | None:
    """A content/tool-call/reasoning delta as a LangChain chunk (``None`` when it has none)."""
    tool_chunks = [
        ToolCallChunk(name=d.name, args=d.arguments, id=d.id, index=d.index, type="tool_call_chunk")
        for d in chunk.tool_calls
    ]
    additional = {"reasoning_content": chunk.reasoning} if chunk.reasoning else {}
    if not (chunk.content or tool_chunks or additional):
        return None
    return ChatGenerationChunk(
        message=AIMessageChunk(
            content=chunk.content or "", tool_call_chunks=tool_chunks, additional_kwargs=additional
        )
    )


def final_chunk(result: SdkResult, ref: BranchRef) -> ChatGenerationChunk:
    """The last chunk of a stream: model name, finish reason, kvbranch split and usage (each
    carried by exactly one chunk of the stream, as langchain-tests checks)."""
    return ChatGenerationChunk(
        message=AIMessageChunk(
            content="",
            response_metadata=response_metadata(result, ref, streamed=True),
            usage_metadata=usage_metadata(result.usage),
            chunk_position="last",
        ),
        generation_info={"finish_reason": result.finish_reason, "model_name": result.model},
    )
