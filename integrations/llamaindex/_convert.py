"""Conversions between LlamaIndex's chat types and the OpenAI wire format the sdk speaks, and
the lenient reading of tool-call arguments. Pure functions (no I/O), unit-tested directly."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    AudioBlock,
    ChatMessage,
    DocumentBlock,
    ImageBlock,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.llms.utils import parse_partial_json

from sdk.types import ChatResult, ToolCall

__all__ = [
    "to_openai_message",
    "to_openai_messages",
    "to_chat_message",
    "tool_kwargs",
    "resolve_tool_choice",
    "tool_schemas",
    "with_strict",
    "openai_tool_calls",
]

logger = logging.getLogger("kvbranch.llamaindex")

_ROLES = {
    MessageRole.SYSTEM: "system",
    MessageRole.DEVELOPER: "system",
    MessageRole.USER: "user",
    MessageRole.ASSISTANT: "assistant",
    MessageRole.CHATBOT: "assistant",
    MessageRole.MODEL: "assistant",
    MessageRole.TOOL: "tool",
    MessageRole.FUNCTION: "tool",
}


def _arguments_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value if value is not None else {}, ensure_ascii=False)


def openai_tool_calls(message: ChatMessage) -> list[dict[str, Any]]:
    """The tool calls of an assistant message in OpenAI form: from
    ``additional_kwargs["tool_calls"]`` (the model's own argument text, as this LLM stores it;
    dicts or OpenAI SDK objects), else from its ``ToolCallBlock``\\ s."""
    out: list[dict[str, Any]] = []
    raw = message.additional_kwargs.get("tool_calls")
    if raw:
        for i, tc in enumerate(raw):
            if hasattr(tc, "model_dump"):
                tc = tc.model_dump()
            if not isinstance(tc, Mapping):
                continue
            fn = tc.get("function") or {}
            out.append(
                {
                    "id": tc.get("id") or f"call_{i}",
                    "type": tc.get("type") or "function",
                    "function": {
                        "name": fn.get("name") or "",
                        "arguments": _arguments_text(fn.get("arguments")),
                    },
                }
            )
        return out
    for i, block in enumerate(b for b in message.blocks if isinstance(b, ToolCallBlock)):
        out.append(
            {
                "id": block.tool_call_id or f"call_{i}",
                "type": "function",
                "function": {
                    "name": block.tool_name,
                    "arguments": _arguments_text(block.tool_kwargs),
                },
            }
        )
    return out


def _content(message: ChatMessage) -> str | list[dict[str, Any]] | None:
    """Text only: a string. With images: OpenAI content parts. Thinking, tool-call and
    cache-control blocks are not content."""
    parts: list[dict[str, Any]] = []
    has_media = False
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ImageBlock):
            has_media = True
            if block.url is not None:
                url = str(block.url)
            else:
                data = block.resolve_image(as_base64=True).read().decode("ascii")
                url = f"data:{block.image_mimetype or 'image/png'};base64,{data}"
            part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
            if block.detail:
                part["image_url"]["detail"] = block.detail
            parts.append(part)
        elif isinstance(block, (AudioBlock, DocumentBlock)):
            raise ValueError(
                f"{type(block).__name__} is not supported by KVBranchLLM (text and images only)"
            )
        elif not isinstance(block, (ThinkingBlock, ToolCallBlock)):
            logger.debug("kvbranch: dropping a %s from a chat message", type(block).__name__)
    if has_media:
        return parts
    texts = [p["text"] for p in parts]
    return "\n".join(texts) if texts else None


def to_openai_message(message: ChatMessage) -> dict[str, Any]:
    """One LlamaIndex message as an OpenAI chat message."""
    role = _ROLES.get(
        message.role, message.role.value if hasattr(message.role, "value") else str(message.role)
    )
    content = _content(message)
    out: dict[str, Any] = {"role": role, "content": content if content is not None else ""}
    kw = message.additional_kwargs
    if role == "assistant":
        calls = openai_tool_calls(message)
        if calls:
            # "" rather than null: chat templates that concatenate the content (SmolLM2's,
            # for one) cannot render null when the server forks a branch at these messages.
            out["tool_calls"] = calls
    elif role == "tool":
        call_id = kw.get("tool_call_id")
        if call_id:
            out["tool_call_id"] = str(call_id)
        name = kw.get("name") or kw.get("tool_name")
        if name:
            out["name"] = str(name)
    return out


def to_openai_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    return [to_openai_message(m) for m in messages]


def _single_parameter(schema: Mapping[str, Any] | None) -> str | None:
    """The parameter a bare argument value belongs to: the only required one, else the only
    one."""
    if not isinstance(schema, Mapping):
        return None
    required = schema.get("required") or []
    if len(required) == 1 and isinstance(required[0], str):
        return required[0]
    properties = schema.get("properties") or {}
    if isinstance(properties, Mapping) and len(properties) == 1:
        return str(next(iter(properties)))
    return None


def tool_kwargs(
    arguments: str | None, schema: Mapping[str, Any] | None = None, *, partial: bool = False
) -> dict[str, Any]:
    """The keyword arguments of a tool call from the model's argument text.

    A JSON object is used as it is. Anything else a model may write — a bare JSON value
    (``"Paris"``), plain text (``Paris``), or an object whose only key is not a parameter —
    is mapped onto the tool's single (required) parameter when ``schema`` has exactly one;
    otherwise the call gets no arguments (and the tool reports what is missing). ``partial``:
    the text is a prefix of a streamed call (incomplete JSON is closed, never raises).
    """
    text = (arguments or "").strip()
    if not text:
        return {}
    try:
        value: Any = json.loads(text)
    except ValueError:
        try:
            value = parse_partial_json(text)
        except (ValueError, TypeError, IndexError):
            value = text
    param = _single_parameter(schema)
    if isinstance(value, dict):
        properties = (schema or {}).get("properties") if isinstance(schema, Mapping) else None
        if (
            param is not None
            and len(value) == 1
            and isinstance(properties, Mapping)
            and param not in value
            and next(iter(value)) not in properties
        ):
            return {param: next(iter(value.values()))}
        return value
    if param is not None:
        return {param: value}
    if not partial:
        logger.warning(
            "kvbranch: tool arguments %r are not a JSON object and the tool has no "
            "single parameter to map them to; calling it without arguments",
            text[:200],
        )
    return {}


def tool_schemas(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, Mapping[str, Any]]:
    """``{tool name: parameters schema}`` of OpenAI tool specs."""
    out: dict[str, Mapping[str, Any]] = {}
    for tool in tools or ():
        fn = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            params = fn.get("parameters")
            out[fn["name"]] = params if isinstance(params, Mapping) else {}
    return out


def to_chat_message(
    result: ChatResult,
    schemas: Mapping[str, Mapping[str, Any]] | None = None,
    *,
    partial: bool = False,
) -> ChatMessage:
    """The assistant ``ChatMessage`` of an sdk result: text, reasoning (``ThinkingBlock``),
    tool calls as ``ToolCallBlock``\\ s (arguments read with :func:`tool_kwargs`) and, in
    ``additional_kwargs["tool_calls"]``, as the model wrote them (OpenAI form)."""
    blocks: list[Any] = []
    if result.reasoning:
        blocks.append(ThinkingBlock(content=result.reasoning))
    if result.text or not result.tool_calls:
        blocks.append(TextBlock(text=result.text))
    additional: dict[str, Any] = {}
    calls: list[ToolCall] = [tc for tc in result.tool_calls if tc.name or not partial]
    for i, tc in enumerate(calls):
        blocks.append(
            ToolCallBlock(
                tool_call_id=tc.id or f"call_{i}",
                tool_name=tc.name,
                tool_kwargs=tool_kwargs(
                    tc.arguments, (schemas or {}).get(tc.name), partial=partial
                ),
            )
        )
    if calls:
        additional["tool_calls"] = [
            {
                "id": tc.id or f"call_{i}",
                "type": tc.type or "function",
                "function": {"name": tc.name, "arguments": tc.arguments},
            }
            for i, tc in enumerate(calls)
        ]
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks, additional_kwargs=additional)


def resolve_tool_choice(tool_choice: Any, tool_required: bool) -> Any:
    """OpenAI ``tool_choice``: ``None`` → ``"required"`` if ``tool_required`` else
    ``"auto"``; ``"auto"``/``"none"``/``"required"`` as they are; any other string names a
    function; a dict is passed through."""
    if tool_choice is None:
        return "required" if tool_required else "auto"
    if isinstance(tool_choice, str):
        if tool_choice in ("auto", "none", "required"):
            return tool_choice
        return {"type": "function", "function": {"name": tool_choice}}
    return tool_choice


def with_strict(spec: dict[str, Any], strict: bool | None) -> dict[str, Any]:
    """An OpenAI tool spec with its function's ``strict`` set (a copy; ``None``: as it is, so
    a spec that says ``strict`` itself keeps it)."""
    function = spec.get("function")
    if strict is None or not isinstance(function, dict):
        return spec
    return {**spec, "function": {**function, "strict": strict}}
