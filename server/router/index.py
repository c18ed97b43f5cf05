"""The router's cluster index: which decode instance holds which branch's KV, and the transfer
params that let a prefill instance pull it back.

Fed by the engines themselves: every decode response carries the transfer params its
connector returned (block ids, the token ids those blocks encode, the peer's address), and the
router files them here under (tenant, session, branch). An entry is single-use — once P has
read D's blocks, D frees them — so :meth:`ClusterIndex.take` removes it; it also expires a
margin before D's own hold ends (docs/pd_notes.md pitfall 7), and it is void when D restarted since.

The index is bounded two ways, so state a client can create stays bounded however many
sessions come and go unread: expired entries are swept on a timer (the router's lifespan runs
:meth:`ClusterIndex.sweep` every ``sweep_interval_s``; reads alone would leave abandoned
sessions' entries forever), and ``max_entries`` evicts the oldest entry when full (an evicted
entry costs its next turn a recompute on P, never a wrong answer).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from sdk.contract import REMOTE_NUM_TOKENS

Key = tuple[str, str, str]  # (tenant, session id, branch id)

#: Default cap: each entry is a few KB of params; 100k entries stay well under a GiB.
DEFAULT_MAX_ENTRIES = 100_000


@dataclass
class Holding:
    decode_url: str
    instance_id: str | None
    params: dict[str, Any]
    num_tokens: int
    expires_at: float
    #: When the turn that produced it started (router clock): a late answer from an older
    #: turn never replaces the entry of a newer one.
    started: float = 0.0

    def expired(self, now: float | None = None) -> bool:
        return (now if now is not None else time.monotonic()) >= self.expires_at


class ClusterIndex:
    def __init__(self, ttl_s: float, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        #: Insertion-ordered: the first entry is the oldest (``put`` re-inserts at the end).
        self._entries: dict[Key, Holding] = {}
        self._lock = threading.Lock()
        self.stored = 0
        self.taken = 0
        self.expired = 0
        self.stale_dropped = 0
        self.evicted = 0

    @property
    def sweep_interval_s(self) -> float:
        """Often enough that an expired entry lives at most about twice the ttl."""
        return min(max(self.ttl_s, 1.0), 60.0)

    def put(
        self,
        key: Key,
        decode_url: str,
        instance_id: str | None,
        params: dict[str, Any],
        started: float | None = None,
    ) -> Holding:
        holding = Holding(
            decode_url,
            instance_id,
            params,
            int(params.get(REMOTE_NUM_TOKENS) or 0),
            time.monotonic() + self.ttl_s,
            time.monotonic() if started is None else started,
        )
        with self._lock:
            current = self._entries.get(key)
            if current is not None and current.started > holding.started:
                self.stale_dropped += 1
                return current
            self._entries.pop(key, None)  # a newer turn's entry is the youngest
            while len(self._entries) >= self.max_entries:
                del self._entries[next(iter(self._entries))]
                self.evicted += 1
            self._entries[key] = holding
            self.stored += 1
        return holding

    def take(self, key: Key) -> Holding | None:
        """Remove and return a live entry (None when absent or expired)."""
        with self._lock:
            holding = self._entries.pop(key, None)
            if holding is None:
                return None
            if holding.expired():
                self.expired += 1
                return None
            self.taken += 1
            return holding

    def peek(self, key: Key) -> Holding | None:
        with self._lock:
            holding = self._entries.get(key)
            return None if holding is None or holding.expired() else holding

    def drop_session(self, tenant: str, session_id: str) -> int:
        with self._lock:
            keys = [k for k in self._entries if k[0] == tenant and k[1] == session_id]
            for k in keys:
                del self._entries[k]
            return len(keys)

    def drop_instance(self, decode_url: str) -> int:
        with self._lock:
            keys = [k for k, h in self._entries.items() if h.decode_url == decode_url]
            for k in keys:
                del self._entries[k]
            return len(keys)

    def sweep(self) -> int:
        """Drop expired entries; returns how many."""
        now = time.monotonic()
        with self._lock:
            keys = [k for k, h in self._entries.items() if h.expired(now)]
            for k in keys:
                del self._entries[k]
            self.expired += len(keys)
            return len(keys)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def snapshot(self, tenant: str | None) -> list[dict[str, Any]]:
        """Entries of one tenant (all when ``tenant`` is None), for the stats route."""
        self.sweep()
        now = time.monotonic()
        with self._lock:
            return [
                {
                    "session_id": k[1],
                    "branch_id": k[2],
                    "decode": h.decode_url,
                    "tokens": h.num_tokens,
                    "expires_in_s": round(h.expires_at - now, 1),
                }
                for k, h in self._entries.items()
                if tenant is None or k[0] == tenant
            ]

    def counters(self) -> dict[str, int]:
        with self._lock:
            return {
                "entries": len(self._entries),
                "max_entries": self.max_entries,
                "stored": self.stored,
                "taken": self.taken,
                "expired": self.expired,
                "evicted": self.evicted,
                "stale_dropped": self.stale_dropped,
            }
