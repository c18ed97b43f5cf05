"""A pull given up is not a pull stopped: its blocks stay out of the free pool until NIXL says
the read ended.

Releasing a NIXL transfer that is still in flight returns at once and does *not* stop it: two
NIXL agents on one box (UCX over TCP, and over TCP with shared memory), a read posted to a peer
that did not progress, released (NIXL answered "ok"), then wrote all of its 6 MiB into the
reader's buffer as soon as the peer progressed; removing the peer's agent did not stop it
either (``tests/unit/server/connector/test_nixl_late_write.py`` keeps that measured). So a pull
given up — the synchronous wait's deadline, or ``pull_timeout_s`` for a read in flight — can
still write its blocks later. vLLM recomputes those blocks at once; a late write there brings
the same tokens' KV (verified, and the peer holds its blocks until the read's notification),
but a block freed meanwhile — the request finished, or was preempted — may hold another
request's KV by then, and the late bytes would overwrite it: wrong tokens for someone else.

* **Worker** (:class:`LateReads`): a read given up while in flight leaves upstream's tracking
  *unreleased* (upstream reports the request failed; vLLM recomputes) and is polled here every
  step until NIXL says its transfers ended (done or failed); they are released then. Each
  step's output carries a :class:`ReadReport`: the reads given up in flight this step (their
  blocks) and those that ended.
* **Scheduler** (:class:`PinnedReads`): pins a reported read's blocks — one more reference in
  vLLM's block pool, the use vLLM's connector API names for ``bind_gpu_block_pool`` — so that
  neither its request's end nor a preemption returns them to the free queue, and drops the pin
  once every worker reported the read ended. A read that never ends keeps its blocks: memory
  lost until the peer's connection fails, never a wrong token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from server.connector.vllm_compat import (
    KVConnectorWorkerMetadata,
    detach_read,
    pin_blocks,
    release_transfers,
    transfers_ended,
    unpin_blocks,
)

logger = logging.getLogger("kvbranch.pd")


@dataclass
class ReadReport(KVConnectorWorkerMetadata):
    """Workers → scheduler, one step: reads given up while in flight, reads that ended, and
    whether the step's synchronous reads landed."""

    #: request id -> (the blocks the read writes, how many workers gave it up in flight)
    given_up: dict[str, tuple[list[int], int]] = field(default_factory=dict)
    #: request id -> how many workers saw their given-up read end
    ended: dict[str, int] = field(default_factory=dict)
    #: request id -> whether its synchronous read landed (on every worker)
    sync_landed: dict[str, bool] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> ReadReport:
        """Several workers (tensor parallel) each report their own reads of a request."""
        if not isinstance(other, ReadReport):
            return self
        given_up = dict(self.given_up)
        for request_id, (blocks, workers) in other.given_up.items():
            mine = given_up.get(request_id)
            given_up[request_id] = (
                (sorted({*mine[0], *blocks}), mine[1] + workers) if mine else (blocks, workers)
            )
        ended = dict(self.ended)
        for request_id, workers in other.ended.items():
            ended[request_id] = ended.get(request_id, 0) + workers
        landed = dict(self.sync_landed)
        for request_id, ok in other.sync_landed.items():
            landed[request_id] = landed.get(request_id, True) and ok
        return ReadReport(given_up, ended, landed)


class LateReads:
    """Worker: the reads given up while NIXL still had them in flight."""

    def __init__(self) -> None:
        self._in_flight: dict[str, list[int]] = {}  # request id -> transfer handles
        self._given_up: dict[str, tuple[list[int], int]] = {}
        self._ended: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._in_flight)

    def give_up(self, worker: Any, request_id: str, block_ids: list[int]) -> None:
        """``request_id``'s read is failed now (vLLM recomputes its blocks); transfers still in
        flight are kept and polled, and their blocks reported to the scheduler to pin."""
        handles = detach_read(worker, request_id)
        if transfers_ended(worker, handles):
            release_transfers(worker, handles)
            return
        self._in_flight[request_id] = handles
        self._given_up[request_id] = (list(block_ids), 1)
        logger.warning(
            "kvbranch: request %s: a pull given up is still in flight: its %d blocks stay "
            "out of the free pool until NIXL reports it ended",
            request_id,
            len(block_ids),
        )

    def poll(self, worker: Any) -> None:
        """Release the given-up reads NIXL reports ended."""
        for request_id, handles in list(self._in_flight.items()):
            if transfers_ended(worker, handles):
                release_transfers(worker, handles)
                del self._in_flight[request_id]
                self._ended[request_id] = 1

    def report(self) -> ReadReport | None:
        """This step's news for the scheduler, once (None: nothing to say)."""
        if not self._given_up and not self._ended:
            return None
        report = ReadReport(self._given_up, self._ended)
        self._given_up, self._ended = {}, {}
        return report


class PinnedReads:
    """Scheduler: the blocks of reads given up in flight, pinned until they ended."""

    def __init__(self) -> None:
        self.block_pool: Any = None
        self._pins: dict[str, tuple[list[Any], int]] = {}  # request id -> (blocks, workers)
        self.reads_reported = 0  # reads the workers gave up in flight

    @property
    def blocks_pinned(self) -> int:
        return sum(len(blocks) for blocks, _ in self._pins.values())

    def apply(self, report: ReadReport) -> None:
        pool = self.block_pool
        self.reads_reported += len(report.given_up)
        for request_id, (block_ids, workers) in report.given_up.items():
            if pool is None:
                logger.error(
                    "kvbranch: request %s: a late pull's blocks cannot be pinned (vLLM bound "
                    "no block pool to the connector)",
                    request_id,
                )
                continue
            pinned, before = self._pins.get(request_id, ([], 0))
            if not pinned:
                pinned = pin_blocks(pool, block_ids)
            self._pins[request_id] = (pinned, before + workers)
        for request_id, workers in report.ended.items():
            entry = self._pins.get(request_id)
            if entry is None:
                continue
            pinned, left = entry[0], entry[1] - workers
            if left > 0:
                self._pins[request_id] = (pinned, left)
                continue
            del self._pins[request_id]
            unpin_blocks(pool, pinned)


__all__ = ["ReadReport", "LateReads", "PinnedReads"]
