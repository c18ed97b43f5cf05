"""The one shape every trace set is read into (:mod:`benchmarks.traces`): conversations of steps.
A module of its own so that the loaders import it without importing the package that
dispatches to them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Step:
    """One request of a conversation: ``body`` holds either ``messages`` (chat completions) or
    ``prompt`` (a list of token ids, text completions); ``pause_s`` is the wait before it is
    sent (0 for a conversation's first step)."""

    body: dict[str, Any]
    max_tokens: int
    pause_s: float = 0.0

    @property
    def chat(self) -> bool:
        return "messages" in self.body


@dataclass(frozen=True)
class Conversation:
    """A conversation of a trace set: its first step is cold, every later one resumes it."""

    id: str
    steps: tuple[Step, ...]
