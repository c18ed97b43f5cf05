"""Real trace sets, read into one shape that a replay can send: conversations of steps.

Why one shape: the capacity sweep (:mod:`benchmarks.capacity`) replays agents over any trace
set, and the sets differ in everything else — BFCL's multi-turn traces
(:mod:`benchmarks.traces.bfcl`) carry message lists and no timing, Mooncake's production trace
(:mod:`benchmarks.traces.mooncake`) carries real arrival times and block hashes and no text.
Both become :class:`Conversation` objects whose :class:`Step` says what to send, how many
tokens to ask for, and how long the agent waits before sending it (the tool or user time: the
trace's own where it has one, a stated distribution where it has none). Licences and sources:
``benchmarks/traces.md``.

A step's request body is the same for every configuration of a run (the history is the
trace's, never the model's answer), so greedy answers can be compared across configurations.
"""

from __future__ import annotations

from typing import Any

from benchmarks.traces.shape import Conversation, Step

__all__ = ["SETS", "Conversation", "Step", "load"]

#: The trace sets :func:`load` knows, by the name the command line uses.
SETS = ("bfcl", "mooncake")


def load(name: str, n: int, **options: Any) -> list[Conversation]:
    """``n`` conversations of the named set (options: the set's own loader's keywords)."""
    if name == "bfcl":
        from benchmarks.traces import bfcl

        return bfcl.load(n, **options)
    if name == "mooncake":
        from benchmarks.traces import mooncake

        return mooncake.load(n, **options)
    raise ValueError(f"unknown trace set {name!r}; known: {', '.join(SETS)}")
