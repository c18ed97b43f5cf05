"""Which prefill instance a turn goes to: the cheapest one.

``cost(P) = tokens P still has to prefill + LOAD_TOKENS × requests in flight on P``

The prefill left is the branch's history minus the longest prefix of its chained block hashes
that P holds (its device cache or its host store, from the shared index's block entries; a host
block counts ``HOST_WEIGHT`` of a device block: it still has to be copied in). When D's hold was
claimed, every P is equally cheap — the pull brings the history to whichever P runs the turn —
so the choice is pure load balancing: the pull is what makes the P pool elastic. The load term
prices a request in flight like a cold prefill of ``LOAD_TOKENS`` (Dynamo's router weighs
prefill blocks against active blocks the same way). Ties go to the session's home P (where
its pins are), then to rendezvous hashing of (tenant, session) — so with nothing to tell them
apart, a session's turns keep going to the same P, and only a departing P's sessions move.

Without a shared index (the embedded backend: no heartbeats, no block entries) this reduces to
the rule the router always had: rendezvous for a session, least busy without one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Protocol, TypeVar

from server.index import BlockHits, Key

#: One request in flight weighs like a cold prefill of this many tokens.
LOAD_TOKENS = 512
#: A block in P's host store saves this much of a device block (it is copied back first).
HOST_WEIGHT = 0.8


class Candidate(Protocol):
    url: str
    instance_id: str | None

    @property
    def load(self) -> int: ...


_C = TypeVar("_C", bound=Candidate)


def rendezvous_weight(session: bytes, url: str) -> int:
    """Rendezvous (highest random weight) hashing: each (session, instance) pair gets a stable
    pseudo-random weight; a session goes to its heaviest live instance."""
    return int.from_bytes(hashlib.blake2b(session + url.encode(), digest_size=8).digest(), "big")


def held_tokens(hits: BlockHits | None, block_size: int) -> float:
    if hits is None:
        return 0.0
    return max(hits.device, HOST_WEIGHT * hits.host) * block_size


def prefill_cost(
    inst: Candidate,
    *,
    history_tokens: int,
    pulled: bool,
    hits: BlockHits | None,
    block_size: int,
) -> float:
    left = 0.0 if pulled else max(0.0, history_tokens - held_tokens(hits, block_size))
    return left + LOAD_TOKENS * inst.load


def choose(
    live: Sequence[_C],
    key: Key | None,
    *,
    history_tokens: int = 0,
    pulled: bool = False,
    hits: dict[str, BlockHits] | None = None,
    block_size: int = 0,
    home: str | None = None,
    scored: bool = True,
) -> _C:
    """The prefill instance for a turn (``live`` is not empty). ``scored`` False: the embedded
    rule (rendezvous for a session, least busy without)."""
    if key is None:
        return min(live, key=lambda i: i.load)
    session = f"{key[0]}/{key[1]}\0".encode()
    if not scored:
        return max(live, key=lambda i: rendezvous_weight(session, i.url))

    def rank(inst: _C) -> tuple[float, int, int]:
        cost = prefill_cost(
            inst,
            history_tokens=history_tokens,
            pulled=pulled,
            hits=(hits or {}).get(inst.instance_id or ""),
            block_size=block_size,
        )
        at_home = 1 if home is not None and inst.instance_id == home else 0
        return (cost, -at_home, -rendezvous_weight(session, inst.url))

    return min(live, key=rank)
