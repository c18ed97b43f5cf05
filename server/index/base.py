"""What every role of the cluster index shares: the backend's life (its kind, counters, sweep,
ping and close) and its one error.

The index plays three roles, each in its own module and each with its own contract suite:

* :mod:`server.index.sessions` — :class:`~server.index.sessions.SessionStore`, written and read
  by routers: D's hold per branch, the turn counter, the session's home and placement;
* :mod:`server.index.membership` — :class:`~server.index.membership.Membership`, written by
  each instance about itself and read by routers: which instances are up;
* :mod:`server.index.blocks` — :class:`~server.index.blocks.BlockIndex`, written by each
  instance about itself and read by routers: which block hashes each instance holds.

:mod:`server.index.store` puts them together (:class:`~server.index.store.IndexStore`) for the
backends, which serve all three, and for the callers that need all three; every other caller
takes the narrowest role it uses.

The index is *advisory* (docs/cluster.md): nothing read from it is trusted. A hold it offers is
claimed on D and checked by P's connector (seal, expiry, claim, once, token prefix, chained block
hashes) before one block moves; an instance it lists counts only when the record's seal
verifies under the cluster secret, and is probed before a turn goes there; a block it says P
holds is only a cost estimate (vLLM and the host store check token ids locally). So a stale,
lost, evicted or tampered entry can cost a recompute, never a wrong answer nor traffic sent to
a URL no instance of the cluster vouched for — which is why every backend may forget anything
at any time (TTLs, caps, a Redis restart).
"""

from __future__ import annotations

import abc


class IndexUnavailable(Exception):
    """The backend could not be reached or answered out of schema. Routers catch it and go on
    on affinity alone (no pulls); instances retry their heartbeat."""


class IndexBackend(abc.ABC):
    """The part of every role that is about the backend rather than the records: one backend
    object serves every role it implements, so these are written once for all of them. Every
    method of every role is safe to call from many routers at once; the ones that must be
    atomic across routers say so."""

    #: "memory" or "redis", for logs and stats.
    kind: str = ""

    async def sweep(self) -> int:
        """Drop expired records kept in process memory; backends with native TTLs do nothing."""
        return 0

    @abc.abstractmethod
    def counters(self) -> dict[str, int]:
        """This process's view: holds stored, taken, expired, stale dropped, evicted..."""

    async def ping(self) -> None:
        """Raise :class:`IndexUnavailable` when the backend cannot be reached or speaks another
        schema (start-up calls it to fail with one clear line). The embedded backend is
        always there."""
        return None

    async def close(self) -> None:
        """Release connections (the embedded backend has none)."""
        return None
