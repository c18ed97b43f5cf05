"""Pins as leases inside a byte budget: which branches hold host blocks against eviction, for
how long, and who gives way when a new pin does not fit.

Policy (documented in docs/architecture.md, "Pin policy"): pins are *leases*. Using a branch
renews its lease. The pin budget is a cap on the distinct blocks all pins hold; when a new or
growing pin does not fit, the oldest other leases are demoted to plain LRU retention
("degraded") until it fits. Only an explicit pin of a branch that alone exceeds the whole
budget (or its tenant's share) is refused (HTTP 409). A chat request never fails because of a
pin: its automatic pin degrades instead. Each tenant may hold a share of the budget; beyond it,
the tenant's own oldest leases degrade first.

Expiry never walks all branches: lease deadlines sit in a heap (stale entries are skipped and
compacted away).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable

from server.connector.core.block_index import HostBlockIndex
from server.connector.core.branches import Branch, Conflict, LeaseKey, SharedSeq


class PinLeases:
    def __init__(
        self,
        index: HostBlockIndex,
        *,
        block_bytes: int,
        pin_budget_bytes: int,
        tenant_pin_share: float,
        clock: Callable[[], float],
    ) -> None:
        self.index = index
        self.block_bytes = max(block_bytes, 1)
        self.pin_budget_blocks = min(pin_budget_bytes // self.block_bytes, index.num_slots)
        self.pin_budget_bytes = self.pin_budget_blocks * self.block_bytes
        self.tenant_pin_share = tenant_pin_share
        self.clock = clock
        # Lease deadlines: (expires_at, seq, lease key) in a heap; _live holds the live
        # deadline and branch of each lease, so a heap entry that disagrees is stale.
        self._heap: list[tuple[float, int, LeaseKey]] = []
        self._live: dict[LeaseKey, tuple[float, Branch]] = {}
        self._seq = 0
        # Branches that hold pins, oldest pin first: globally and per tenant.
        self._leases: OrderedDict[LeaseKey, Branch] = OrderedDict()
        self._tenant_leases: dict[str | None, OrderedDict[LeaseKey, Branch]] = {}
        # Per tenant: hash -> how many of its branches pin it (its share of the budget).
        self._tenant_pins: dict[str | None, dict[bytes, int]] = {}
        self.pins_degraded = 0
        self.pins_refused = 0

    def tenant_pin_blocks(self, owner: str | None) -> int:
        """Blocks one tenant's pins may hold (the whole budget on a server without keys)."""
        if owner is None or self.tenant_pin_share >= 1.0:
            return self.pin_budget_blocks
        return min(
            self.pin_budget_blocks, max(1, int(self.pin_budget_blocks * self.tenant_pin_share))
        )

    def pin(self, branch: Branch, ttl_s: float, *, explicit: bool) -> None:
        """Pin the branch's blocks (and tail) for ``ttl_s``, demoting older leases to fit;
        an explicit pin that cannot fit raises :class:`Conflict`, an automatic one degrades."""
        owner = branch.owner
        wanted = branch.wanted_pins()
        already = set(branch.pinned_hashes)
        new = [h for h in wanted if h not in already]
        tenant = self._tenant_pins.setdefault(owner, {})
        tenant_cap = self.tenant_pin_blocks(owner)

        def extra_global() -> int:
            return sum(1 for h in new if self.index.pin_count(h) == 0)

        def extra_tenant() -> int:
            return sum(1 for h in new if h not in tenant)

        too_big = None
        if len(wanted) > self.pin_budget_blocks:
            too_big = f"more than the whole pin budget of {self.pin_budget_bytes} bytes"
        elif len(wanted) > tenant_cap:
            too_big = (
                f"more than this key's share of the pin budget "
                f"({tenant_cap * self.block_bytes} bytes, --tenant-pin-share)"
            )
        if too_big is not None:
            if explicit:
                self.pins_refused += 1
                raise Conflict(
                    f"pin refused: branch {branch.branch_id!r} holds {len(wanted)} blocks "
                    f"({len(wanted) * self.block_bytes} bytes), {too_big}"
                )
            self.degrade(branch)
            return
        if tenant_cap < self.pin_budget_blocks:  # the tenant's own oldest leases go first
            self._make_room(
                self._tenant_leases.get(owner),
                branch,
                lambda: len(tenant) + extra_tenant() > tenant_cap,
            )
        self._make_room(
            self._leases,
            branch,
            lambda: self.index.pinned_hashes + extra_global() > self.pin_budget_blocks,
        )
        if (
            self.index.pinned_hashes + extra_global() > self.pin_budget_blocks
            or len(tenant) + extra_tenant() > tenant_cap
        ):
            # Could not free enough (all other pins share blocks with this one).
            if explicit:
                self.pins_refused += 1
                raise Conflict("pin refused: the pin budget is full")
            self.degrade(branch)
            return
        for h in new:
            self.index.pin(h)
            tenant[h] = tenant.get(h, 0) + 1
        wanted_set = set(wanted)
        for h in branch.pinned_hashes:
            if h not in wanted_set:
                self._unpin_hash(owner, h)
        branch.pinned_hashes = wanted
        now = self.clock()
        branch.pin_ttl_s = ttl_s
        branch.pin_expires_at = now + ttl_s
        branch.pinned_at = now
        branch.degraded = False
        self._set_deadline(branch)
        key = branch.lease_key
        self._leases[key] = branch
        self._leases.move_to_end(key)
        mine = self._tenant_leases.setdefault(owner, OrderedDict())
        mine[key] = branch
        mine.move_to_end(key)

    def _make_room(
        self, leases: OrderedDict[LeaseKey, Branch] | None, keep: Branch, over: Callable[[], bool]
    ) -> None:
        """Demote the oldest leases of ``leases`` (other than ``keep``) while ``over()``."""
        while leases and over():
            victim = next((b for b in leases.values() if b is not keep), None)
            if victim is None:
                return
            self.degrade(victim)

    def degrade(self, branch: Branch) -> None:
        self.unpin_all(branch)
        if not branch.degraded:  # count transitions: a branch that stays degraded counts once
            branch.degraded = True
            self.pins_degraded += 1

    def _unpin_hash(self, owner: str | None, block_hash: bytes) -> bool:
        tenant = self._tenant_pins.get(owner)
        if tenant is not None and block_hash in tenant:
            if tenant[block_hash] <= 1:
                del tenant[block_hash]
            else:
                tenant[block_hash] -= 1
        return self.index.unpin(block_hash)

    def unpin_all(self, branch: Branch) -> int:
        released = sum(1 for h in branch.pinned_hashes if self._unpin_hash(branch.owner, h))
        branch.pinned_hashes = SharedSeq()
        key = branch.lease_key
        self._leases.pop(key, None)
        mine = self._tenant_leases.get(branch.owner)
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self._tenant_leases[branch.owner]
        return released

    def _set_deadline(self, branch: Branch) -> None:
        assert branch.pin_expires_at is not None
        key = branch.lease_key
        self._live[key] = (branch.pin_expires_at, branch)
        self._seq += 1
        heapq.heappush(self._heap, (branch.pin_expires_at, self._seq, key))
        if len(self._heap) > 2 * len(self._live) + 64:  # renewals left stale entries
            self._heap = [(at, i, k) for i, (k, (at, _)) in enumerate(self._live.items())]
            heapq.heapify(self._heap)

    def release(self, branch: Branch) -> int:
        """Drop the branch's pins and its deadline (unpin, delete); returns the blocks whose
        last pin this was."""
        self._live.pop(branch.lease_key, None)
        return self.unpin_all(branch)

    def expire(self, now: float) -> int:
        """Release every lease whose TTL ran out by ``now``; touches only what is due."""
        expired = 0
        while self._heap and self._heap[0][0] <= now:
            at, _, key = heapq.heappop(self._heap)
            live = self._live.get(key)
            if live is None or live[0] != at:
                continue  # renewed, unpinned or deleted since
            del self._live[key]
            branch = live[1]
            self.unpin_all(branch)
            branch.pin_expires_at = None
            branch.degraded = False
            expired += 1
        return expired

    def release_all(self) -> int:
        """Drop every lease (a store reset): each pinned branch is unpinned, as by an expiry
        (not degraded: its next use pins it again); returns how many leases there were."""
        branches = {key: branch for key, (_, branch) in self._live.items()}
        branches.update(self._leases)
        for branch in branches.values():
            self.unpin_all(branch)
            branch.pin_expires_at = None
            branch.degraded = False
        self._heap.clear()
        self._live.clear()
        self._leases.clear()
        self._tenant_leases.clear()
        self._tenant_pins.clear()
        return len(branches)

    def heap_size(self) -> int:
        return len(self._heap)
