"""Which aggregated replica a turn goes to (pure: the caller reads the index and the pool).

An aggregated replica (``--role single --index URL``) prefills and decodes; after each turn it
files the branch's hold in the index, naming itself, and a turn that arrives at another replica
pulls the history from the holder. So the cheapest replica for a turn is the one that already
holds it, while it is not much busier than the rest; a move costs a pull, and a pull refused or
not worth it costs a recompute. In order:

1. **the holder** — the replica the branch's hold names (``Hold.instance_id``), when it is live
   and not overloaded;
2. **the session's home** — where the router last sent the session (a turn in flight has taken
   its hold, a fork's new branch has none yet, a hold expires before the session does), on the
   same conditions;
3. **rendezvous hashing** of (tenant, session) over the live replicas that are not overloaded:
   every router agrees without the index, and when a replica leaves only its own sessions move;
4. a request without a session: the least loaded replica (ties to the one that took fewer
   requests, so an idle fleet shares them).

*Overloaded*: more than ``LOAD_MARGIN`` requests in flight above the least loaded live replica
(the pool's load: this router's requests in flight there, or the replica's own count at its last
heartbeat when larger). Two, because an agent's turns come and go in bursts (a tool call returns,
the next turn is sent): a difference of one or two requests is noise that would make sessions
flap between replicas, each flap paying a pull, while a replica three requests deeper than
another makes a turn wait behind several prefills — longer than pulling its history.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from server.index import Key
from server.router.choice import rendezvous_weight

#: A replica keeps its sessions while it has at most this many more requests in flight than the
#: least loaded live replica (see the module docstring).
LOAD_MARGIN = 2


class Replica(Protocol):
    url: str
    instance_id: str | None
    requests: int

    @property
    def load(self) -> int: ...


_R = TypeVar("_R", bound=Replica)


@dataclass(frozen=True)
class ReplicaChoice(Generic[_R]):
    replica: _R
    #: The session had a place (the holder, else its home) and the turn goes elsewhere.
    moved: bool


def session_bytes(key: Key) -> bytes:
    """What rendezvous hashing weighs for a session: its tenant and id, not its branch (a
    session's branches share their history, so they go where the session is)."""
    return f"{key[0]}/{key[1]}\0".encode()


def choose_replica(
    live: Sequence[_R],
    key: Key | None,
    *,
    holder: str | None = None,
    home: str | None = None,
    margin: int = LOAD_MARGIN,
) -> ReplicaChoice[_R]:
    """The replica for a turn (``live`` is not empty); ``holder`` and ``home`` are instance
    ids as the index names them (None: not known)."""
    if key is None:
        return ReplicaChoice(min(live, key=lambda r: (r.load, r.requests)), moved=False)
    least = min(r.load for r in live)
    fit = [r for r in live if r.load <= least + margin]
    by_id = {r.instance_id: r for r in fit if r.instance_id is not None}
    placed = holder if holder is not None else home
    for iid in (holder, home):
        if iid is not None and iid in by_id:
            return ReplicaChoice(by_id[iid], moved=iid != placed)
    session = session_bytes(key)
    chosen = max(fit, key=lambda r: rendezvous_weight(session, r.url))
    return ReplicaChoice(chosen, moved=placed is not None and chosen.instance_id != placed)
