"""The trace replays' stream reader (benchmarks/openai_stream.py) on chunks shaped as the openai
client yields them: TTFT at the first piece that carries text, usage from the last chunk, the
recomputed tokens from kvbranch's split or, without one, prompt minus cached."""

from __future__ import annotations

import time
from types import SimpleNamespace as NS

from benchmarks.openai_stream import read_stream


def _chat_chunk(content=None, call_args=None, usage=None, split=None):
    calls = [NS(function=NS(name=None, arguments=call_args))] if call_args else None
    delta = NS(content=content, tool_calls=calls)
    choices = [NS(delta=delta)] if content is not None or calls else []
    return NS(choices=choices, usage=usage, model_extra={"kvbranch": split} if split else {})


async def _stream(chunks, marks):
    for chunk in chunks:
        marks.append(time.perf_counter())
        yield chunk


async def test_ttft_is_the_first_piece_with_text_and_the_split_decides_recomputed():
    usage = NS(prompt_tokens=100, completion_tokens=3, prompt_tokens_details=NS(cached_tokens=64))
    chunks = [
        _chat_chunk(content=""),  # a role-only first chunk: no text yet
        _chat_chunk(call_args='{"a": '),
        _chat_chunk(content="1}"),
        _chat_chunk(usage=usage, split={"recomputed_tokens": 7}),
    ]
    marks: list[float] = []
    t0 = time.perf_counter()
    out = await read_stream(_stream(chunks, marks), t0)
    assert out["answer"] == '{"a": 1}'
    assert marks[1] - t0 <= out["ttft_s"] < marks[2] - t0  # at the second chunk, not the first
    assert out["prompt_tokens"] == 100 and out["completion_tokens"] == 3
    assert out["recomputed_tokens"] == 7  # kvbranch's split, not 100 - 64


async def test_without_a_split_recomputed_is_prompt_minus_cached_and_text_chunks_read():
    usage = NS(prompt_tokens=50, completion_tokens=2, prompt_tokens_details=NS(cached_tokens=32))
    chunks = [
        NS(choices=[NS(text="ab")], usage=None, model_extra={}),
        NS(choices=[], usage=usage, model_extra={}),
    ]
    out = await read_stream(_stream(chunks, []), time.perf_counter(), chat=False)
    assert out["answer"] == "ab"
    assert out["recomputed_tokens"] == 18
