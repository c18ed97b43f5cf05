"""Shared by the planner, tail and dialect tests: one real planner over a small host index,
with 4-token blocks, a 1-byte block and a frozen clock so that counts and leases are exact."""

from __future__ import annotations

from server.connector.core.block_index import HostBlockIndex
from server.connector.core.planner import Planner
from server.connector.core.sessions import SessionRegistry

BS = 4


def make_planner(num_slots: int = 32, budget_blocks: int = 16):
    index = HostBlockIndex(num_slots)
    registry = SessionRegistry(
        index,
        block_size=BS,
        block_bytes=1,
        pin_budget_bytes=budget_blocks,
        default_ttl_s=60.0,
        clock=lambda: 0.0,
    )
    return Planner(index, registry, BS), index, registry
