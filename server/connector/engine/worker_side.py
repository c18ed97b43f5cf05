"""The connector's worker role: runs the block copies the scheduler side planned.

Loads run before the forward that reads them (``start_load``), saves after the forward that
computed them (``save``). On CUDA the ordering lives on the GPU (``HostKVPool``); a step in
which a peer connector (NIXL, in P/D) writes KV blocks outside any CUDA stream first waits on
the host for the pending save (``fence_for``). Requests whose tail copy ran are reported back
through ``finished`` so that vLLM frees the blocks it kept for the copy.
"""

from __future__ import annotations

import logging
import time

import torch

from server.connector.core.metadata import KVBranchMetadata
from server.connector.engine.host_pool import HostKVPool, async_saves_from_env, prefault_from_env
from server.connector.engine.stats import KVBranchTransferStats

logger = logging.getLogger("kvbranch.connector")


class KVBranchWorker:
    def __init__(
        self,
        num_slots: int,
        block_bytes: int,
        pool: HostKVPool | None = None,
        groups: list[list[str]] | None = None,
        pools: list[tuple[frozenset[int], int]] | None = None,
    ) -> None:
        self.num_slots = num_slots
        #: Groups with part slots of their own: (groups, part slots) per pool
        #: (``core/part_pool.py``: windowed groups, state groups).
        self.pools = pools or []
        self.block_bytes = block_bytes
        self.pool = pool
        #: The layers of each KV cache group (``None``: one group of every layer).
        self.groups = groups
        self.transfer_stats = KVBranchTransferStats()
        #: Requests whose tail copy ran, for the next ``finished``.
        self._finished_saves: set[str] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor], num_blocks: int) -> None:
        if self.num_slots == 0:
            return
        self.pool = HostKVPool(
            kv_caches,
            num_blocks,
            self.num_slots,
            async_saves=async_saves_from_env(),
            prefault=prefault_from_env(),
            groups=self.groups,
            pools=self.pools,
        )
        if self.pool.block_bytes != self.block_bytes:
            logger.warning(
                "kvbranch: worker block bytes %d differ from planned %d",
                self.pool.block_bytes,
                self.block_bytes,
            )
        logger.info(
            "kvbranch connector (worker): %d host slots (+ parts %s) on %s, %s copies",
            self.num_slots,
            [n for _, n in self.pools],
            self.pool.device,
            "CUDA stream"
            if self.pool.cuda
            else "CPU (async saves)"
            if self.pool.async_cpu
            else "CPU",
        )

    def fence_for(self, meta: object) -> None:
        """Wait on the host for the previous step's save when a peer connector writes KV
        blocks this step: its writes (NIXL/UCX) are not ordered by any CUDA stream, and a block
        freed after the save was planned may be one of them. Writes on the compute stream need
        no wait here: ``HostKVPool.save`` orders that stream after the save on the GPU, so the
        host is not stalled (async scheduling keeps overlapping)."""
        if self.pool is None or not isinstance(meta, KVBranchMetadata):
            return
        # CPU async saves: every step, before anything writes a block the save may still read.
        if meta.host_fence or getattr(self.pool, "async_cpu", False):
            self.pool.fence()

    def start_load(self, meta: object) -> None:
        if self.pool is None or not isinstance(meta, KVBranchMetadata) or not meta.load_slots:
            return
        started = time.perf_counter()
        self.pool.load(meta.load_slots, meta.load_blocks)
        self.transfer_stats.record("load", time.perf_counter() - started, len(meta.load_slots))

    def save(self, meta: object) -> None:
        if not isinstance(meta, KVBranchMetadata):
            return
        if self.pool is not None and meta.save_blocks:
            started = time.perf_counter()
            self.pool.save(meta.save_blocks, meta.save_slots)  # on CUDA: time to enqueue
            self.transfer_stats.record("save", time.perf_counter() - started, len(meta.save_blocks))
        # The tails are copied (CPU) or ordered before any later write to their blocks on the
        # compute stream (CUDA: HostKVPool.save's fence; peer writes wait in fence_for): vLLM
        # may free those blocks now. Reported even without a pool, or the blocks would leak.
        self._finished_saves.update(meta.finished_saves)

    def finished(self) -> set[str] | None:
        """Requests whose kept blocks vLLM may free (``get_finished``'s sending set)."""
        done, self._finished_saves = self._finished_saves, set()
        return done or None

    def take_stats(self) -> KVBranchTransferStats | None:
        if self.transfer_stats.is_empty():
            return None
        stats, self.transfer_stats = self.transfer_stats, KVBranchTransferStats()
        return stats
