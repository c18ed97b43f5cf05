"""The index's block role: which block hashes each instance holds, per tier, so a router can
estimate what a turn would cost on each prefill instance.

Each instance writes about itself only, from vLLM's KV events (:mod:`server.index.events`):
the hashes its device cache and its host store stored and removed, stamped with its identity
and *generation*. A restart (new identity) or a bumped generation (a lost event stream, a
cleared cache) makes every older entry invisible at once, without a scan. An entry is only a
cost estimate: vLLM and the host store check token ids locally.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Literal

from server.index.base import IndexBackend
from server.index.membership import InstanceRecord

Tier = Literal["device", "host"]
TIERS: tuple[Tier, ...] = ("device", "host")

#: Block entries expire this long after they were last stored (a lost "removed" event costs at
#: most this long of wrong cost estimates, never a wrong answer).
DEFAULT_BLOCK_TTL_S = 600.0


@dataclass
class BlockHits:
    """How much of a hash chain one instance holds: the longest prefix, in blocks, per tier."""

    device: int = 0
    host: int = 0

    @property
    def best(self) -> int:
        return max(self.device, self.host)


@dataclass(frozen=True)
class BlockBatch:
    """One batch of an instance's block events, as every backend applies it: the hashes its
    ``tier`` stored and removed (low 64 bits, as vLLM's KV events carry them), under its
    identity and generation."""

    instance_id: str
    generation: int
    tier: Tier
    stored: list[int]
    removed: list[int]


class BlockIndex(IndexBackend):
    """Block lookup: instances add and evict their own hashes, routers look up a chain."""

    async def publish_blocks(
        self,
        instance_id: str,
        generation: int,
        tier: Tier,
        stored: list[int],
        removed: list[int],
    ) -> None:
        """Apply one batch of the instance's block events (hashes: low 64 bits, as vLLM's
        KV events carry them) under its identity and generation. An empty batch costs no
        backend work (a Redis round trip)."""
        if stored or removed:
            await self.apply_blocks(BlockBatch(instance_id, generation, tier, stored, removed))

    @abc.abstractmethod
    async def apply_blocks(self, batch: BlockBatch) -> None:
        """The backend's half of :meth:`publish_blocks`: write a non-empty batch (the removed
        first, then the stored, so a hash in both ends up stored)."""

    @abc.abstractmethod
    async def block_hits(
        self, chain: list[int], members: list[InstanceRecord]
    ) -> dict[str, BlockHits]:
        """For each of ``members``, the longest prefix of ``chain`` it holds per tier; only
        entries stamped with the member's current identity and generation count."""
