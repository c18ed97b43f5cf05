"""The Berkeley Function Calling Leaderboard's multi-turn traces as :class:`Conversation` objects.

The conversations themselves are :mod:`benchmarks.bfcl_traces`' (the ``bfcl-eval`` wheel from
PyPI, Apache-2.0; the tool outputs are the real outputs of the set's own backends). This module
only adds what that set does not have: the time each tool takes. BFCL records no timing, so
the pause before every step after the first is drawn from a stated distribution — ``fixed``
(always ``tool_s``) or ``exp`` (exponential with mean ``tool_s``, seeded by the conversation
and step, so every configuration of a run waits the same) — and the distribution is printed
with the results.
"""

from __future__ import annotations

import random
import zlib

from benchmarks import bfcl_traces
from benchmarks.traces.shape import Conversation, Step

TOOL_DISTRIBUTIONS = ("fixed", "exp")


def tool_pause(dist: str, mean_s: float, seed: int, conv_id: str, step: int) -> float:
    """The tool time before ``step`` of conversation ``conv_id`` (0 before the first)."""
    if step == 0 or mean_s <= 0:
        return 0.0
    if dist == "fixed":
        return mean_s
    if dist == "exp":
        rng = random.Random(zlib.crc32(f"{seed}:{conv_id}:{step}".encode()))
        return rng.expovariate(1.0 / mean_s)
    raise ValueError(f"unknown tool-time distribution {dist!r}; known: {TOOL_DISTRIBUTIONS}")


def load(
    n: int,
    max_turns: int = 2,
    skip: int = 0,
    max_chars: int = 14000,
    max_tokens: int = 8,
    tool_s: float = 2.0,
    tool_dist: str = "fixed",
    seed: int = 0,
) -> list[Conversation]:
    """``n`` conversations of :func:`benchmarks.bfcl_traces.load`, with tool times."""
    out = []
    for conv in bfcl_traces.load(n, max_turns, skip, max_chars):
        steps = tuple(
            Step(
                body={"messages": messages},
                max_tokens=max_tokens,
                pause_s=tool_pause(tool_dist, tool_s, seed, conv["id"], pos),
            )
            for pos, messages in enumerate(conv["steps"])
        )
        out.append(Conversation(id=str(conv["id"]), steps=steps))
    return out
