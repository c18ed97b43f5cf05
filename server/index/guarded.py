"""A circuit breaker in front of a shared index: while it is unreachable, calls fail at once.

A router whose Redis is down must keep serving on affinity alone (docs/cluster.md). Without
this, every turn would pay each index call's timeout before going on without it — a few
hundred milliseconds per call against a host that does not answer. After a failure the breaker
stays open for a backoff (doubling up to ``MAX_BACKOFF_S``); the first call after it is the
probe: success closes the breaker, another failure opens it again. Reads and writes are both
optional to a turn, so failing fast loses only cache hits, never a request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from server.index.base import IndexUnavailable
from server.index.blocks import BlockBatch, BlockHits
from server.index.membership import InstanceRecord
from server.index.sessions import Hold, Key, TurnStart
from server.index.store import IndexStore

logger = logging.getLogger("kvbranch.index")

_T = TypeVar("_T")

FIRST_BACKOFF_S = 0.5
MAX_BACKOFF_S = 2.0


class GuardedStore(IndexStore):
    """``inner`` behind a circuit breaker; same interface."""

    def __init__(self, inner: IndexStore, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(inner.hold_ttl_s)
        self.inner = inner
        self.kind = inner.kind
        self._clock = clock
        self._open_until = 0.0
        self._backoff = FIRST_BACKOFF_S
        self.failures = 0
        self.short_circuited = 0

    @property
    def available(self) -> bool:
        return self._clock() >= self._open_until

    async def _call(self, op: Callable[[], Awaitable[_T]]) -> _T:
        if not self.available:
            self.short_circuited += 1
            raise IndexUnavailable("index unreachable (retrying shortly)")
        try:
            result = await op()
        except IndexUnavailable as exc:
            self.failures += 1
            if self._backoff == FIRST_BACKOFF_S:  # the first failure of an outage
                logger.warning("index unreachable: %s (failing fast while it is down)", exc)
            self._open_until = self._clock() + self._backoff
            self._backoff = min(self._backoff * 2, MAX_BACKOFF_S)
            raise
        if self._backoff != FIRST_BACKOFF_S:
            logger.warning("index reachable again")
        self._backoff = FIRST_BACKOFF_S
        self._open_until = 0.0
        return result

    async def begin_turn(self, key: Key) -> TurnStart:
        return await self._call(lambda: self.inner.begin_turn(key))

    async def put_hold(self, key: Key, hold: Hold, ttl_s: float | None = None) -> bool:
        return await self._call(lambda: self.inner.put_hold(key, hold, ttl_s))

    async def peek_hold(self, key: Key) -> Hold | None:
        return await self._call(lambda: self.inner.peek_hold(key))

    async def peek_home(self, tenant: str, session: str) -> str | None:
        return await self._call(lambda: self.inner.peek_home(tenant, session))

    async def set_home(self, tenant: str, session: str, instance_id: str) -> None:
        await self._call(lambda: self.inner.set_home(tenant, session, instance_id))

    async def add_session_instances(
        self, tenant: str, session: str, instance_ids: list[str]
    ) -> None:
        await self._call(lambda: self.inner.add_session_instances(tenant, session, instance_ids))

    async def session_instances(self, tenant: str, session: str) -> set[str]:
        return await self._call(lambda: self.inner.session_instances(tenant, session))

    async def drop_session(self, tenant: str, session: str) -> int:
        return await self._call(lambda: self.inner.drop_session(tenant, session))

    async def drop_instance_holds(self, decode_url: str) -> int:
        return await self._call(lambda: self.inner.drop_instance_holds(decode_url))

    async def heartbeat(self, record: InstanceRecord, ttl_s: float) -> None:
        await self._call(lambda: self.inner.heartbeat(record, ttl_s))

    async def deregister(self, instance_id: str) -> None:
        await self._call(lambda: self.inner.deregister(instance_id))

    async def members(self) -> list[InstanceRecord]:
        return await self._call(self.inner.members)

    async def apply_blocks(self, batch: BlockBatch) -> None:
        await self._call(lambda: self.inner.apply_blocks(batch))

    async def block_hits(
        self, chain: list[int], members: list[InstanceRecord]
    ) -> dict[str, BlockHits]:
        return await self._call(lambda: self.inner.block_hits(chain, members))

    async def sweep(self) -> int:
        return await self.inner.sweep()

    @property
    def sweep_interval_s(self) -> float:
        return self.inner.sweep_interval_s

    async def snapshot(self, tenant: str | None) -> list[dict[str, Any]]:
        if not self.available:
            return []
        try:
            return await self._call(lambda: self.inner.snapshot(tenant))
        except IndexUnavailable:
            return []

    def counters(self) -> dict[str, int]:
        return {
            **self.inner.counters(),
            "unavailable": self.failures,
            "short_circuited": self.short_circuited,
        }

    async def ping(self) -> None:
        await self.inner.ping()

    async def close(self) -> None:
        await self.inner.close()
