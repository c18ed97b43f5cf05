"""The router's process (reads, memory backend) and each instance's API server (publisher).
May import server.common, connector.pd.transfer_auth and vllm_compat; never plugin or router.

The cluster index (the global cache manager): where each conversation's KV lives across
every instance, shared by every router.

* the three roles it plays, one module each, with their records:
  :mod:`server.index.sessions` (:class:`SessionStore`: holds, turns, homes, placement),
  :mod:`server.index.membership` (:class:`Membership`: which instances are up) and
  :mod:`server.index.blocks` (:class:`BlockIndex`: which blocks each instance holds);
  :mod:`server.index.base` what they share, :mod:`server.index.store` them together
  (:class:`IndexStore`, and :class:`InstanceIndex`: membership and blocks);
* :mod:`server.index.memory` — the embedded backend, in the router's process (the default);
* :mod:`server.index.redis_store` — the Redis backend every router and instance shares
  (``--index redis://…`` or ``unix://…``); its key schema is in docs/index_redis.md;
* :mod:`server.index.guarded` — a circuit breaker in front of a shared backend (fail fast
  while it is down);
* :func:`open_store` — the backend an ``--index`` value names.
"""

from __future__ import annotations

from server.index.base import IndexUnavailable
from server.index.blocks import BlockBatch, BlockHits, BlockIndex
from server.index.membership import InstanceRecord, Membership, member_id
from server.index.memory import MemoryIndexStore
from server.index.sessions import Hold, Key, SessionStore, TurnStart
from server.index.store import IndexStore, InstanceIndex

# The roles and their records under the package's name, where callers import them from.
__all__ = [
    "BlockBatch",
    "BlockHits",
    "BlockIndex",
    "Hold",
    "IndexStore",
    "IndexUnavailable",
    "InstanceIndex",
    "InstanceRecord",
    "Key",
    "Membership",
    "MemoryIndexStore",
    "SessionStore",
    "TurnStart",
    "member_id",
    "open_store",
]

#: URL schemes of the Redis backend (``unix://`` is a unix socket path).
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def open_store(url: str | None, *, hold_ttl_s: float, cluster: str = "default") -> IndexStore:
    """The backend ``url`` names: ``memory`` (or nothing) for the embedded one, a Redis URL for
    the shared one. ``cluster`` namespaces the Redis keys (several clusters, one Redis)."""
    if not url or url == "memory":
        return MemoryIndexStore(hold_ttl_s)
    if url.startswith(REDIS_SCHEMES):
        from server.index.guarded import GuardedStore
        from server.index.redis_store import RedisIndexStore

        return GuardedStore(RedisIndexStore.from_url(url, hold_ttl_s=hold_ttl_s, cluster=cluster))
    raise ValueError(
        f"--index {url!r}: expected 'memory', redis://host:port/db, rediss://… or unix:///path"
    )
