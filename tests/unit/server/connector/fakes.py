"""Shared by the connector's unit tests: one real planner over a small host index, with
4-token blocks, a 1-byte block and a frozen clock so that counts and leases are exact; a fake
engine request; vLLM-like chained block hashes. One copy each, so the tests cannot drift apart
on what a request or a hash chain looks like."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from server.connector.core.block_index import HostBlockIndex
from server.connector.core.planner import Planner
from server.connector.core.sessions import SessionRegistry

BS = 4


def make_planner(
    num_slots: int = 32,
    budget_blocks: int = 16,
    *,
    index: HostBlockIndex | None = None,
    ttl_s: float = 60.0,
    clock: Callable[[], float] = lambda: 0.0,
    block_size: int = BS,
    state_groups: frozenset[int] = frozenset(),
    num_groups: int = 1,
):
    """(planner, index, registry) over ``index`` (default: a fresh one of ``num_slots``);
    ``state_groups``: the KV cache groups holding recurrent states (a hybrid model)."""
    if index is None:  # a hybrid model's states get a part pool as large as the slots
        index = HostBlockIndex(num_slots, state_slots=num_slots if state_groups else 0)
    registry = SessionRegistry(
        index,
        block_size=block_size,
        block_bytes=1,
        pin_budget_bytes=budget_blocks,
        default_ttl_s=ttl_s,
        clock=clock,
    )
    planner = Planner(index, registry, block_size, state_groups=state_groups, num_groups=num_groups)
    return planner, index, registry


def chained_hashes(tokens: list[int], salt: str | None = None) -> list[bytes]:
    """A chained SHA-256 per full block, like vLLM's (the salt in the first block's keys): the
    P/D handle tests seal and check these."""
    out, parent = [], (salt or "").encode()
    for i in range(len(tokens) // BS):
        parent = hashlib.sha256(parent + repr(tokens[i * BS : (i + 1) * BS]).encode()).digest()
        out.append(parent)
    return out


@dataclass
class FakeRequest:
    """The engine request's fields the scheduler side and the tail code read (duck-typed like
    vLLM's ``Request``); its block hashes are derived from its tokens and salt."""

    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    num_computed_tokens: int = 0
    session_id: str | None = None
    cache_salt: str | None = None
    mm_features: list | None = None
    sampling_params: Any = field(default_factory=lambda: SimpleNamespace(extra_args=None))

    @property
    def block_hashes(self) -> list[bytes]:
        """Chained like vLLM's: each hash names the whole prefix and the salt."""
        toks = self.all_token_ids
        return [
            repr((self.cache_salt, toks[: (k + 1) * BS])).encode() for k in range(len(toks) // BS)
        ]
