"""The embedded index: the :class:`~server.index.store.IndexStore` in the router's own process.

The default (``--index memory``): one router, no service to run. Instances cannot reach it, so
it holds no membership or block entries unless something in the same process writes them (the
index simulation does; a router takes its instances from ``--prefill``/``--decode``).

Bounded two ways, so state a client can create stays bounded however many sessions come and go
unread: expired records are swept on a timer (the router's lifespan runs :meth:`sweep`; reads
alone would leave abandoned sessions' records forever), and every map is capped, evicting its
oldest record when full (an evicted hold costs its next turn a recompute on P, never a wrong
answer).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import asdict
from typing import Any, Generic, TypeVar

from server.index.blocks import DEFAULT_BLOCK_TTL_S, TIERS, BlockBatch, BlockHits
from server.index.membership import InstanceRecord, generation_of
from server.index.sessions import (
    DEFAULT_MAX_HOLDS,
    DEFAULT_SESSION_TTL_S,
    MAX_SESSION_INSTANCES,
    Hold,
    HoldCounts,
    Key,
    TurnStart,
    chain_of,
    snapshot_row,
)
from server.index.store import IndexStore

_V = TypeVar("_V")


class _Expiring(Generic[_V]):
    """An insertion-ordered map whose values expire, capped at ``cap`` (oldest out first)."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.items: OrderedDict[Any, tuple[float, _V]] = OrderedDict()
        self.evicted = 0

    def get(self, key: Any, now: float) -> _V | None:
        item = self.items.get(key)
        if item is None:
            return None
        if item[0] <= now:
            del self.items[key]
            return None
        return item[1]

    def pop(self, key: Any) -> tuple[float, _V] | None:
        return self.items.pop(key, None)

    def set(self, key: Any, value: _V, expires_at: float) -> None:
        self.items.pop(key, None)  # re-inserted: the youngest
        while len(self.items) >= self.cap:
            self.items.popitem(last=False)
            self.evicted += 1
        self.items[key] = (expires_at, value)

    def sweep(self, now: float) -> int:
        dead = [k for k, (at, _) in self.items.items() if at <= now]
        for k in dead:
            del self.items[k]
        return len(dead)


class MemoryIndexStore(IndexStore):
    kind = "memory"

    def __init__(
        self,
        hold_ttl_s: float,
        max_holds: int = DEFAULT_MAX_HOLDS,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
        block_ttl_s: float = DEFAULT_BLOCK_TTL_S,
        max_blocks: int = 1_000_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_holds < 1:
            raise ValueError("max_holds must be at least 1")
        super().__init__(hold_ttl_s)
        #: The clock every TTL here runs on (a test moves its own instead of sleeping).
        self.clock = clock
        self.max_holds = max_holds
        self.session_ttl_s = session_ttl_s
        self.block_ttl_s = block_ttl_s
        self._lock = threading.Lock()
        self._holds: _Expiring[Hold] = _Expiring(max_holds)
        self._turns: _Expiring[int] = _Expiring(max_holds)
        self._chains: _Expiring[list[int]] = _Expiring(max_holds)
        self._homes: _Expiring[str] = _Expiring(max_holds)
        self._placement: _Expiring[set[str]] = _Expiring(max_holds)
        self._members: _Expiring[InstanceRecord] = _Expiring(100_000)
        #: block hash -> {(instance id, tier): generation}
        self._blocks: _Expiring[dict[tuple[str, str], int]] = _Expiring(max_blocks)
        self.hold_counts = HoldCounts()

    # --- session level (SessionStore) ------------------------------------------------------

    async def begin_turn(self, key: Key) -> TurnStart:
        now = self.clock()
        with self._lock:
            item = self._holds.pop(key)
            hold: Hold | None = None
            if item is not None:
                if item[0] <= now:
                    self.hold_counts.expired += 1
                else:
                    hold = item[1]
                    hold.expires_in_s = item[0] - now
                    self.hold_counts.taken += 1
            turn = (self._turns.get(key, now) or 0) + 1
            self._turns.set(key, turn, now + self.session_ttl_s)
            home = self._homes.get(key[:2], now)
            chain = self._chains.get(key, now) or []
        return TurnStart(turn=turn, hold=hold, home=home, chain=list(chain))

    async def put_hold(self, key: Key, hold: Hold, ttl_s: float | None = None) -> bool:
        now = self.clock()
        with self._lock:
            current = self._holds.get(key, now)
            if current is not None and current.turn > hold.turn:
                self.hold_counts.stale_dropped += 1
                return False
            self._holds.set(key, hold, now + self.offer_s(ttl_s))
            chain = chain_of(hold.params)
            if chain:
                self._chains.set(key, chain, now + self.session_ttl_s)
            self.hold_counts.stored += 1
            return True

    async def peek_hold(self, key: Key) -> Hold | None:
        now = self.clock()
        with self._lock:
            item = self._holds.items.get(key)
            if item is None or item[0] <= now:
                return None
            item[1].expires_in_s = item[0] - now
            return item[1]

    async def peek_home(self, tenant: str, session: str) -> str | None:
        with self._lock:
            return self._homes.get((tenant, session), self.clock())

    async def set_home(self, tenant: str, session: str, instance_id: str) -> None:
        with self._lock:
            self._homes.set((tenant, session), instance_id, self.clock() + self.session_ttl_s)

    async def add_session_instances(
        self, tenant: str, session: str, instance_ids: list[str]
    ) -> None:
        now = self.clock()
        with self._lock:
            have = set(self._placement.get((tenant, session), now) or ())
            for iid in instance_ids:
                if len(have) >= MAX_SESSION_INSTANCES:
                    break
                have.add(iid)
            self._placement.set((tenant, session), have, now + self.session_ttl_s)

    async def session_instances(self, tenant: str, session: str) -> set[str]:
        with self._lock:
            return set(self._placement.get((tenant, session), self.clock()) or ())

    async def drop_session(self, tenant: str, session: str) -> int:
        with self._lock:
            keys = [k for k in self._holds.items if k[0] == tenant and k[1] == session]
            for k in keys:
                self._holds.pop(k)
                self._chains.pop(k)
            self._homes.pop((tenant, session))
            self._placement.pop((tenant, session))
            return len(keys)

    async def drop_instance_holds(self, decode_url: str) -> int:
        with self._lock:
            keys = [k for k, (_, h) in self._holds.items.items() if h.decode_url == decode_url]
            for k in keys:
                self._holds.pop(k)
            return len(keys)

    # --- instance level (Membership) -------------------------------------------------------

    async def heartbeat(self, record: InstanceRecord, ttl_s: float) -> None:
        with self._lock:
            self._members.set(record.instance_id, record, self.clock() + ttl_s)

    async def deregister(self, instance_id: str) -> None:
        with self._lock:
            self._members.pop(instance_id)

    async def members(self) -> list[InstanceRecord]:
        now = self.clock()
        with self._lock:
            self._members.sweep(now)
            return [r for _, r in self._members.items.values()]

    # --- block level (BlockIndex) ----------------------------------------------------------

    async def apply_blocks(self, batch: BlockBatch) -> None:
        now = self.clock()
        owner = (batch.instance_id, batch.tier)
        with self._lock:
            for h in batch.removed:
                holders = self._blocks.get(h, now)
                if holders is not None:
                    holders.pop(owner, None)
            for h in batch.stored:
                holders = self._blocks.get(h, now) or {}
                holders[owner] = batch.generation
                self._blocks.set(h, holders, now + self.block_ttl_s)

    async def block_hits(
        self, chain: list[int], members: list[InstanceRecord]
    ) -> dict[str, BlockHits]:
        now = self.clock()
        hits = {m.instance_id: BlockHits() for m in members}
        gens = {(m.instance_id, t): generation_of(m, t) for m in members for t in TIERS}
        open_ = set(gens)
        with self._lock:
            for i, h in enumerate(chain):
                if not open_:
                    break
                holders = self._blocks.get(h, now) or {}
                for owner in list(open_):
                    if holders.get(owner) == gens[owner]:
                        setattr(hits[owner[0]], owner[1], i + 1)
                    else:
                        open_.discard(owner)  # the prefix ends here for this instance and tier
        return hits

    # --- housekeeping ----------------------------------------------------------------------

    async def sweep(self) -> int:
        now = self.clock()
        with self._lock:
            dropped = self._holds.sweep(now)
            self.hold_counts.expired += dropped
            for m in (self._turns, self._chains, self._homes, self._placement, self._blocks):
                m.sweep(now)
            return dropped

    def __len__(self) -> int:
        return len(self._holds.items)

    async def snapshot(self, tenant: str | None) -> list[dict[str, Any]]:
        await self.sweep()
        now = self.clock()
        with self._lock:
            return [
                snapshot_row(k, h, at - now)
                for k, (at, h) in self._holds.items.items()
                if tenant is None or k[0] == tenant
            ]

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._holds.items),
                "max_entries": self.max_holds,
                **asdict(self.hold_counts),
                "evicted": self._holds.evicted,
            }
