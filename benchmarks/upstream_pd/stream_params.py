"""D's ``kv_transfer_params`` in the final usage chunk of a streamed answer, as vLLM PR #40186
proposes (open against vLLM 0.32).

vLLM 0.32 returns ``kv_transfer_params`` only on non-streaming responses (docs/pd_notes.md
pitfall 2). A proxy that streams D's answer to the client, as every P/D proxy does to keep the
time to first token, never learns the block ids D holds, and the bidirectional pull never
happens. Without this, upstream's bidirectional P/D cannot run on a streamed workload at all;
it changes nothing else (the chunk gains one field, only when the engine returned params).

Installed in the upstream baseline's API server process before vLLM serves
(:mod:`benchmarks.upstream_pd.instance`): the chat and text-completion stream generators are
wrapped so that the final ``RequestOutput``'s params are remembered as the engine's outputs go
by, and added to the usage chunk (``"choices": []`` with ``"usage"``) on the way out.
Pinned to vLLM 0.32's ``chat_completion_stream_generator`` and
``completion_stream_generator`` (a ``result_generator`` argument, ``data: {json}`` lines).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

FIELD = "kv_transfer_params"
#: (module, class, method) of vLLM 0.32's stream generators.
TARGETS = (
    (
        "vllm.entrypoints.openai.chat_completion.serving",
        "OpenAIServingChat",
        "chat_completion_stream_generator",
    ),
    (
        "vllm.entrypoints.openai.completion.serving",
        "OpenAIServingCompletion",
        "completion_stream_generator",
    ),
)


def with_params(piece: str, params: dict[str, Any] | None) -> str:
    """``piece`` (one ``data: {...}`` event) with ``params`` added when it is the usage chunk."""
    if params is None or not piece.startswith("data: {"):
        return piece
    try:
        chunk = json.loads(piece[len("data: ") :])
    except ValueError:
        return piece
    if chunk.get("choices") or "usage" not in chunk:
        return piece
    chunk[FIELD] = params
    return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"


def _output_of(item: Any) -> Any:
    """A chat stream yields ``RequestOutput``; a text-completion stream ``(index, output)``."""
    return item[1] if isinstance(item, tuple) else item


def wrap(generator: Callable[..., AsyncIterator[str]]) -> Callable[..., AsyncIterator[str]]:
    signature = inspect.signature(generator)

    @functools.wraps(generator)
    async def stream(*args: Any, **kwargs: Any) -> AsyncIterator[str]:
        bound = signature.bind(*args, **kwargs)
        outputs = bound.arguments["result_generator"]
        seen: dict[str, Any] = {}

        async def tap() -> AsyncIterator[Any]:
            async for item in outputs:
                params = getattr(_output_of(item), FIELD, None)
                if params is not None:
                    seen["params"] = params
                yield item

        bound.arguments["result_generator"] = tap()
        async for piece in generator(*bound.args, **bound.kwargs):
            yield with_params(piece, seen.get("params"))

    stream.__kvbranch_wrapped__ = True  # type: ignore[attr-defined]
    return stream


def install() -> None:
    for module_name, class_name, method in TARGETS:
        cls = getattr(importlib.import_module(module_name), class_name)
        original = getattr(cls, method)
        if not getattr(original, "__kvbranch_wrapped__", False):
            setattr(cls, method, wrap(original))
