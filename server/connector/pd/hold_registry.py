"""D's holds: the blocks of a finished turn that D keeps for P's next pull, as a lease that
yields to new work (split out of :mod:`server.connector.pd.verified_nixl`, which uses it).

The router claims a hold (control thread) right before P pulls; the scheduler thread releases
the oldest unclaimed holds when new work needs D's device blocks. One lock orders the two.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

#: A pull starts only while the claim has at least this much time left (the read itself
#: takes milliseconds; upstream's worker checks D's deadline again right before reading).
CLAIM_MARGIN_S = 6.0


@dataclass
class Hold:
    """D's blocks kept after a turn for P's next pull: a lease that yields to new work."""

    request_id: str
    handle: str
    num_blocks: int
    created: float = field(default_factory=time.monotonic)
    claimed_until: float = 0.0  # wall clock
    releasing: bool = False


class HoldRegistry:
    """D's holds, oldest first. Claimed by the router (control thread), released under
    pressure by the scheduler thread: one lock orders the two, so a claimed hold is never
    released before its claim ends and a released hold can never be claimed."""

    def __init__(self, claim_ttl_s: float) -> None:
        self.claim_ttl_s = claim_ttl_s
        self._holds: OrderedDict[str, Hold] = OrderedDict()
        self._lock = threading.Lock()
        self.placed = 0
        self.released_for_pressure = 0
        self.claims = 0
        self.claims_refused = 0

    def add(self, hold: Hold) -> None:
        with self._lock:
            self._holds[hold.request_id] = hold
            self.placed += 1

    def done(self, request_id: str) -> None:
        with self._lock:
            self._holds.pop(request_id, None)

    def claim(self, request_id: str, handle: str, hold_expires_wall: float) -> float | None:
        """The claim's deadline (wall clock), or None if the hold is gone or being released."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None or hold.releasing or hold.handle != handle or hold.claimed_until:
                self.claims_refused += 1
                return None
            hold.claimed_until = min(time.time() + self.claim_ttl_s, hold_expires_wall)
            self.claims += 1
            return hold.claimed_until

    def release_oldest(self, need_blocks: int) -> list[str]:
        """Mark the oldest unclaimed holds (or claims past their deadline) for release until
        ``need_blocks`` blocks are covered; returns their request ids."""
        out: list[str] = []
        freed = 0
        now = time.time()
        with self._lock:
            for hold in self._holds.values():
                if freed >= need_blocks:
                    break
                if hold.releasing or (
                    hold.claimed_until and hold.claimed_until + CLAIM_MARGIN_S > now
                ):
                    continue
                hold.releasing = True
                out.append(hold.request_id)
                freed += hold.num_blocks
            self.released_for_pressure += len(out)
        return out

    def held_blocks(self) -> int:
        with self._lock:
            return sum(h.num_blocks for h in self._holds.values() if not h.releasing)

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)
