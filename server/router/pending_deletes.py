"""Session and branch deletes an instance missed because it could not be reached, delivered
when it answers again.

A client's ``DELETE`` is fanned out to every instance that has the session; one that is down
cannot apply it, yet the client must get its answer now (the delete succeeded for what is
reachable) and the instance, once back, must not keep serving the deleted session's pins. So
the router keeps the missed delete here and sends it again before it counts that instance as up
(:attr:`server.router.pool.Pool.before_up`). The kept request is the client's own (its path and
``Authorization``): the instance scopes sessions by the key's tenant, and the router's own key
is another tenant. Bounded per tenant and in all, and forgotten after the session's TTL: a
delete that no longer fits is dropped (counted), and the instance's pins of that session end
with their own TTL, as they would without the delete.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from server.index.sessions import DEFAULT_SESSION_TTL_S

logger = logging.getLogger("kvbranch.router")

#: Most missed deletes kept for one tenant (all instances together).
MAX_PER_TENANT = 1_000
#: Most missed deletes kept in all.
MAX_TOTAL = 10_000


@dataclass
class MissedDelete:
    """One delete an instance did not get: what to send it again."""

    tenant: str
    path: str
    headers: dict[str, str]
    expires_at: float


#: Sends one missed delete to an instance: its status, or None when it could not be reached.
Send = Callable[[str, MissedDelete], Awaitable[int | None]]


class PendingDeletes:
    """The deletes each instance (by URL) missed, oldest first."""

    def __init__(
        self,
        *,
        max_per_tenant: int = MAX_PER_TENANT,
        max_total: int = MAX_TOTAL,
        ttl_s: float = DEFAULT_SESSION_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_per_tenant = max_per_tenant
        self.max_total = max_total
        self.ttl_s = ttl_s
        self.clock = clock
        self._by_url: dict[str, dict[tuple[str, str], MissedDelete]] = {}
        self._per_tenant: Counter[str] = Counter()
        self.counts: Counter[str] = Counter()

    def __len__(self) -> int:
        return sum(len(m) for m in self._by_url.values())

    def missed(self, url: str) -> list[str]:
        """The paths ``url`` has still to be sent (tests and logs)."""
        return [d.path for d in self._by_url.get(url, {}).values()]

    def add(self, url: str, tenant: str, path: str, headers: dict[str, str]) -> bool:
        """Keep the delete of ``path`` that ``url`` missed; False when it does not fit."""
        missed = self._by_url.setdefault(url, {})
        key = (tenant, path)
        if key in missed:  # the same delete missed again: one send covers both
            missed[key].expires_at = self.clock() + self.ttl_s
            return True
        if self._per_tenant[tenant] >= self.max_per_tenant or len(self) >= self.max_total:
            self.counts["dropped"] += 1
            return False
        missed[key] = MissedDelete(tenant, path, dict(headers), self.clock() + self.ttl_s)
        self._per_tenant[tenant] += 1
        self.counts["kept"] += 1
        return True

    def _forget(self, url: str, key: tuple[str, str]) -> None:
        missed = self._by_url.get(url, {})
        if missed.pop(key, None) is not None:
            self._per_tenant[key[0]] -= 1
            if self._per_tenant[key[0]] <= 0:
                del self._per_tenant[key[0]]
        if not missed:
            self._by_url.pop(url, None)

    async def deliver(self, url: str, send: Send) -> bool:
        """Send ``url`` every delete it missed, oldest first; False when it could not be
        reached (the rest stay kept, and it is not up yet). An answer of 2xx or 404 (already
        gone) delivers it; any other answer is logged and the delete given up: sending it again
        would get the same."""
        now = self.clock()
        for key, missed in list(self._by_url.get(url, {}).items()):
            if missed.expires_at <= now:
                self._forget(url, key)
                self.counts["expired"] += 1
                continue
            status = await send(url, missed)
            if status is None:
                return False
            self._forget(url, key)
            if 200 <= status < 300 or status == 404:
                self.counts["delivered"] += 1
            else:
                self.counts["refused"] += 1
                logger.warning(
                    "%s answered %d to the delete of %s it had missed: given up",
                    url,
                    status,
                    missed.path,
                )
        return True
