"""The index's roles together, for the backends that serve them all and the callers that need
them all.

Every backend (:mod:`server.index.memory` in the router's own process, the default;
:mod:`server.index.redis_store` in a Redis every router and instance shares; the circuit
breaker of :mod:`server.index.guarded` in front of it) implements :class:`IndexStore`. A caller
types what it is handed by the narrowest role it uses: a turn's flow and the session routes a
:class:`~server.index.sessions.SessionStore`, the pool and an instance's publisher an
:class:`InstanceIndex`; only the router that owns the backend holds the whole store.
"""

from __future__ import annotations

from server.index.blocks import BlockIndex
from server.index.membership import Membership
from server.index.sessions import SessionStore


class InstanceIndex(Membership, BlockIndex):
    """What each instance writes about itself and a router reads to pick one: which instances
    are up, and which blocks each holds (a block lookup is asked of the live members only)."""


class IndexStore(SessionStore, InstanceIndex):
    """The whole cluster index: sessions, membership and blocks in one backend."""
