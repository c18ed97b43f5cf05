"""Reading one streamed answer of the unmodified ``openai`` client, as the trace replays time it:
the first content (or tool-call) piece is the TTFT, the last chunk's usage the token counts,
and kvbranch's split (plain vLLM has none: its prompt minus its cached tokens) what was
recomputed."""

from __future__ import annotations

import time
from typing import Any

from sdk.contract import RESPONSE_FIELD


def piece(choice: Any, chat: bool) -> str:
    """The text a choice of one chunk adds: content, or a tool call's name/arguments."""
    if not chat:
        return choice.text or ""
    delta = choice.delta
    calls = "".join(
        (tc.function.arguments or tc.function.name or "") if tc.function else ""
        for tc in delta.tool_calls or []
    )
    return (delta.content or "") + calls


async def read_stream(stream: Any, t0: float, *, chat: bool = True) -> dict[str, Any]:
    """``ttft_s``, ``total_s`` (from ``t0``, ``time.perf_counter``), prompt, completion and
    recomputed tokens, and the ``answer`` text of ``stream``."""
    ttft, pieces, usage, split = None, [], None, None
    async for chunk in stream:
        for choice in chunk.choices:
            text = piece(choice, chat)
            if text:
                ttft = ttft if ttft is not None else time.perf_counter() - t0
                pieces.append(text)
        if chunk.usage is not None:
            usage = chunk.usage
        split = (chunk.model_extra or {}).get(RESPONSE_FIELD) or split
    total = time.perf_counter() - t0
    prompt = usage.prompt_tokens if usage else 0
    details = getattr(usage, "prompt_tokens_details", None) if usage else None
    cached = (details.cached_tokens or 0) if details else 0
    return {
        "ttft_s": ttft if ttft is not None else total,
        "total_s": total,
        "prompt_tokens": prompt,
        "completion_tokens": usage.completion_tokens if usage else 0,
        "recomputed_tokens": split["recomputed_tokens"] if split else prompt - cached,
        "answer": "".join(pieces),
    }
