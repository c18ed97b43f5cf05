"""Typed results of chat completions: :class:`ChatResult` (a whole answer) and
:class:`ChatChunk` (one streamed delta), plus :class:`ChatAccumulator`, which folds chunks into a
result. The kvbranch models (``PromptSourceSplit``, ``SessionInfo``, ...) come from
:mod:`sdk.contract`, the single source of truth, and are re-exported by ``sdk``.
"""

from __future__ import annotations

import json
from dataclasses import KW_ONLY, dataclass, field
from typing import Any

from pydantic import ValidationError

from sdk.contract import RESPONSE_FIELD, PromptSourceSplit
from sdk.errors import APIResponseError

__all__ = ["Usage", "ToolCall", "ToolCallDelta", "ChatChunk", "ChatResult", "ChatAccumulator"]


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    cached_tokens: int | None = None
    """``usage.prompt_tokens_details.cached_tokens``: prompt tokens the engine did not
    compute (vLLM's device prefix-cache hits plus kvbranch host-store loads)."""

    @classmethod
    def from_openai(cls, usage: Any) -> Usage | None:
        if not isinstance(usage, dict):
            return None
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return cls(
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            total_tokens=int(usage.get("total_tokens") or 0),
            cached_tokens=None if cached is None else int(cached),
        )


@dataclass(frozen=True)
class ToolCall:
    """A complete tool call of an answer. ``arguments`` is the JSON text the model wrote."""

    id: str
    name: str
    arguments: str
    type: str = "function"

    def parsed_arguments(self) -> Any:
        """``arguments`` decoded from JSON (raises ``ValueError`` when the model wrote
        invalid JSON)."""
        return json.loads(self.arguments) if self.arguments else {}

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a streamed tool call. ``index`` identifies the call within the answer;
    ``id`` and ``name`` usually arrive once, ``arguments`` in pieces to concatenate."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str | None = None
    type: str | None = None


@dataclass(frozen=True)
class _Answer:
    """What a whole answer and a streamed piece of one both carry (choice 0); the fields
    after ``model`` are keyword-only."""

    id: str | None
    model: str | None
    _: KW_ONLY
    finish_reason: str | None = None
    usage: Usage | None = None
    split: PromptSourceSplit | None = None
    """Where the prompt's tokens came from (kvbranch servers only)."""
    reasoning: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


@dataclass(frozen=True)
class ChatChunk(_Answer):
    """One streamed event of a chat completion (choice 0). A chunk may carry any mix of a
    content delta, tool-call deltas, the finish reason, and — on the final usage chunk —
    ``usage`` and the kvbranch ``split``."""

    content: str | None = None
    tool_calls: tuple[ToolCallDelta, ...] = ()
    role: str | None = None

    @classmethod
    def from_openai(cls, data: Any) -> ChatChunk:
        if not isinstance(data, dict):
            raise APIResponseError(f"stream chunk is not a JSON object: {data!r:.200}")
        choices = data.get("choices") or []
        content = role = finish = reasoning = None
        deltas: list[ToolCallDelta] = []
        if choices:
            choice = choices[0] if isinstance(choices[0], dict) else {}
            delta = choice.get("delta") or {}
            content = delta.get("content")
            role = delta.get("role")
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            finish = choice.get("finish_reason")
            for position, tc in enumerate(delta.get("tool_calls") or []):
                fn = tc.get("function") or {}
                deltas.append(
                    ToolCallDelta(
                        index=int(tc.get("index", position)),
                        id=tc.get("id"),
                        name=fn.get("name"),
                        arguments=fn.get("arguments"),
                        type=tc.get("type"),
                    )
                )
        return cls(
            id=data.get("id"),
            model=data.get("model"),
            content=content,
            tool_calls=tuple(deltas),
            finish_reason=finish,
            role=role,
            usage=Usage.from_openai(data.get("usage")),
            split=_split(data),
            reasoning=reasoning,
            raw=data,
        )


@dataclass(frozen=True)
class ChatResult(_Answer):
    """A whole chat answer (choice 0).

    ``ttft_s`` is the time to the first content (or tool-call) delta of a stream;
    ``latency_s`` the time to the whole answer.
    """

    text: str
    tool_calls: tuple[ToolCall, ...] = ()
    ttft_s: float | None = None
    latency_s: float | None = None

    @property
    def cached_tokens(self) -> int | None:
        return self.usage.cached_tokens if self.usage else None

    @property
    def message(self) -> dict[str, Any]:
        """The assistant message to append to the conversation history."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.text}
        if self.tool_calls:
            msg["tool_calls"] = [tc.to_openai() for tc in self.tool_calls]
            if not self.text:
                msg["content"] = None
        return msg

    @classmethod
    def from_openai(cls, data: Any, *, latency_s: float | None = None) -> ChatResult:
        if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
            raise APIResponseError(f"not a chat completion: {data!r:.300}")
        if not data["choices"]:
            raise APIResponseError("chat completion without choices")
        choice = data["choices"][0]
        message = choice.get("message") or {}
        calls = []
        for tc in message.get("tool_calls") or []:
            fn = tc.get("function") or {}
            calls.append(
                ToolCall(
                    id=tc.get("id") or "",
                    name=fn.get("name") or "",
                    arguments=fn.get("arguments") or "",
                    type=tc.get("type") or "function",
                )
            )
        return cls(
            id=data.get("id"),
            model=data.get("model"),
            text=message.get("content") or "",
            tool_calls=tuple(calls),
            finish_reason=choice.get("finish_reason"),
            usage=Usage.from_openai(data.get("usage")),
            split=_split(data),
            reasoning=message.get("reasoning_content") or message.get("reasoning"),
            latency_s=latency_s,
            raw=data,
        )


def _split(data: dict[str, Any]) -> PromptSourceSplit | None:
    """The response's kvbranch split: ``None`` when absent (a plain OpenAI-compatible
    server); a field that is there but does not match the contract is an
    :class:`~sdk.errors.APIResponseError`, not a silent ``None`` (client and server drifted)."""
    value = data.get(RESPONSE_FIELD)
    if value is None:
        return None
    try:
        return PromptSourceSplit.model_validate(value)
    except ValidationError as exc:
        raise APIResponseError(
            f"the server's {RESPONSE_FIELD!r} field does not match the sdk's "
            f"contract (PromptSourceSplit): {exc}"
        ) from exc


class ChatAccumulator:
    """Folds :class:`ChatChunk`\\ s into a :class:`ChatResult`."""

    def __init__(self) -> None:
        self.id: str | None = None
        self.model: str | None = None
        self.text: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.finish_reason: str | None = None
        self.usage: Usage | None = None
        self.split: PromptSourceSplit | None = None
        self.chunks = 0

    def add(self, chunk: ChatChunk) -> None:
        self.chunks += 1
        self.id = self.id or chunk.id
        self.model = self.model or chunk.model
        if chunk.content:
            self.text.append(chunk.content)
        if chunk.reasoning:
            self.reasoning.append(chunk.reasoning)
        for d in chunk.tool_calls:
            call = self.calls.setdefault(
                d.index, {"id": "", "name": "", "arguments": [], "type": "function"}
            )
            if d.id:
                call["id"] = d.id
            if d.name:
                call["name"] += d.name if call["name"] != d.name else ""
            if d.arguments:
                call["arguments"].append(d.arguments)
            if d.type:
                call["type"] = d.type
        if chunk.finish_reason:
            self.finish_reason = chunk.finish_reason
        if chunk.usage is not None:
            self.usage = chunk.usage
        if chunk.split is not None:
            self.split = chunk.split

    def result(self, *, ttft_s: float | None = None, latency_s: float | None = None) -> ChatResult:
        calls = tuple(
            ToolCall(id=c["id"], name=c["name"], arguments="".join(c["arguments"]), type=c["type"])
            for _, c in sorted(self.calls.items())
        )
        return ChatResult(
            id=self.id,
            model=self.model,
            text="".join(self.text),
            tool_calls=calls,
            finish_reason=self.finish_reason,
            usage=self.usage,
            split=self.split,
            reasoning="".join(self.reasoning) if self.reasoning else None,
            ttft_s=ttft_s,
            latency_s=latency_s,
        )
