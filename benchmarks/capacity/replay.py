"""Agents replaying trace conversations against one server: the timed half of the sweep.

Each agent is a closed loop, as an agent is: it sends a step, reads the whole answer, waits the
step's tool time (the trace's, or the stated distribution's), sends the next. Requests go
through the unmodified ``openai`` client (what users arrive with): chat steps to chat
completions, token-id steps to text completions. With ``sessions`` each request carries
``prompt_cache_key`` = its conversation (kvbranch's session; plain vLLM ignores it); a
sessionless trace sends none, so only the host tier can help there. Every request carries a
``cache_salt`` of its agent count and copy, so nothing a previous count left in a cache
matches (vLLM's own salt: plain vLLM honours it too). Greedy decoding throughout, so that
answers compare across configurations.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from benchmarks.capacity.sweep import Turn, assign
from benchmarks.openai_stream import read_stream
from benchmarks.traces import Conversation, Step


async def send(
    oai: Any, model: str, step: Step, salt: str, cache_key: str | None
) -> dict[str, Any]:
    """One streamed request: TTFT to the first content (or tool-call) piece, usage, and the
    recomputed prompt tokens (kvbranch's split; plain vLLM: prompt minus cached)."""
    extra: dict[str, Any] = {"cache_salt": salt}
    kwargs: dict[str, Any] = {
        "model": model,
        "max_tokens": step.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "extra_body": extra,
    }
    if cache_key is not None:
        kwargs["prompt_cache_key"] = cache_key
    t0 = time.perf_counter()
    if step.chat:
        stream = await oai.chat.completions.create(messages=step.body["messages"], **kwargs)
    else:
        if cache_key is not None:  # the completions method has no such parameter
            extra["prompt_cache_key"] = kwargs.pop("prompt_cache_key")
        stream = await oai.completions.create(prompt=step.body["prompt"], **kwargs)
    return await read_stream(stream, t0, chat=step.chat)


def start_delay(agent: int, stagger_s: float) -> float:
    """When agent ``agent`` starts, in seconds after the first. With 0 (the default) every agent
    opens its first conversation at once, so every cold first prompt of the count is in the
    first seconds and the resumed turns queue behind that burst (what bent the BFCL curves:
    docs in benchmarks/README.md); a fleet of agents arrives over time instead."""
    if stagger_s < 0:
        raise ValueError(f"--stagger-s must be >= 0, not {stagger_s}")
    return agent * stagger_s


async def run_agents(
    oai: Any,
    model: str,
    convs: list[Conversation],
    agents: int,
    per_agent: int,
    salt: str,
    sessions: bool,
    stagger_s: float = 0.0,
) -> tuple[list[Turn], float]:
    """``agents`` agents, each through its own conversations; (turns, wall seconds). Agent
    ``a`` sends its first request ``a * stagger_s`` after the first's (:func:`start_delay`)."""
    turns: list[Turn] = []

    async def agent(a: int, items: list[tuple[int, int]]) -> None:
        await asyncio.sleep(start_delay(a, stagger_s))
        for index, copy in items:
            conv = convs[index]
            for pos, step in enumerate(conv.steps):
                if pos and step.pause_s > 0:
                    await asyncio.sleep(step.pause_s)
                key = f"{salt}-{copy}-{conv.id}" if sessions else None
                got = await send(oai, model, step, f"{salt}-c{copy}", key)
                turns.append(Turn(agent=a, conv=conv.id, copy=copy, step=pos, **got))

    t0 = time.perf_counter()
    await asyncio.gather(
        *(agent(a, items) for a, items in enumerate(assign(convs, agents, per_agent)))
    )
    return turns, time.perf_counter() - t0
