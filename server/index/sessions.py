"""The index's session role: what routers write and read about each conversation, so that the
next turn of a branch finds the KV the last one left.

Per (tenant, session, branch): D's hold — single-use: the transfer params that let a P pull the
conversation back —, a turn counter that orders turns without wall clocks (a late answer of an
older turn never replaces a newer one's hold), and the branch's chained block hashes (P's cost).
Per (tenant, session): the session's *home* prefill instance, and which instances have the
session (session routes go there instead of to every instance). They are one role, not two,
because a turn start reads the hold, the counter, the home and the chain in one round trip, and
a session delete drops holds, home and placement together.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Any

from sdk.contract import REMOTE_NUM_TOKENS
from server.index.base import IndexBackend

Key = tuple[str, str, str]  # (tenant, session id, branch id)

#: Default cap on holds a backend keeps: each is a few KB of params; 100k stay well under a GiB.
DEFAULT_MAX_HOLDS = 100_000
#: How long session-level records (turn counter, home, where the session is) outlive the last
#: turn that touched them: as long as an idle session keeps its pins on the instances.
DEFAULT_SESSION_TTL_S = 6 * 3600.0
#: Most instances one session is recorded on (pins and branches live there).
MAX_SESSION_INSTANCES = 64
#: Most branches of one session whose holds a session delete drops at once.
MAX_SESSION_BRANCHES = 256
#: How much sooner than its holder lets go of a hold's blocks the index stops offering it.
HOLD_OFFER_MARGIN_S = 5.0


def offered_hold_ttl_s(hold_ttl_s: float) -> float:
    """How long the index offers a hold whose blocks the holder keeps ``hold_ttl_s`` seconds
    (``--pd-hold-ttl-s``, vLLM's ``decoder_kv_blocks_ttl``): :data:`HOLD_OFFER_MARGIN_S` less,
    never under half, so a hold found in the index is one its instance surely still holds (a
    pull of blocks already let go waits for nothing that comes: docs/pd_notes.md, pitfall 7).
    One rule for whoever files holds: the P/D router offering D's, an aggregated replica its
    own."""
    return max(hold_ttl_s - HOLD_OFFER_MARGIN_S, hold_ttl_s / 2)


@dataclass
class Hold:
    """D's transfer params for one branch: what lets a P pull the conversation back."""

    decode_url: str
    instance_id: str | None
    params: dict[str, Any]
    #: The branch's turn that produced it (:meth:`SessionStore.begin_turn`): a hold of an older
    #: turn never replaces a newer one's.
    turn: int = 0
    #: Seconds left to live when read (backends keep their own clock).
    expires_in_s: float = 0.0

    @property
    def num_tokens(self) -> int:
        try:
            return int(self.params.get(REMOTE_NUM_TOKENS) or 0)
        except (TypeError, ValueError):
            return 0


@dataclass
class TurnStart:
    """What a router learns in the one round trip that starts a turn."""

    #: This turn's number for its branch (strictly increasing per branch).
    turn: int
    #: D's hold, taken (no other router can take it again); None when there was none.
    hold: Hold | None
    #: The instance id of the session's home prefill instance, when one was recorded.
    home: str | None
    #: The branch's last known chained block hashes (low 64 bits), for P's cost.
    chain: list[int] = field(default_factory=list)


@dataclass
class HoldCounts:
    """What this process did with holds, counted alike by every backend for ``counters()``
    (holds that expired unseen inside Redis are not counted there)."""

    stored: int = 0
    taken: int = 0
    expired: int = 0
    stale_dropped: int = 0


def snapshot_row(key: Key, hold: Hold, expires_in_s: float) -> dict[str, Any]:
    """One live hold as the stats route lists it (every backend's :meth:`SessionStore.snapshot`)."""
    return {
        "session_id": key[1],
        "branch_id": key[2],
        "decode": hold.decode_url,
        "tokens": hold.num_tokens,
        "expires_in_s": round(expires_in_s, 1),
    }


def chain_of(params: dict[str, Any]) -> list[int]:
    """The low 64 bits of each chained block hash D's handle carries (hex digests), the form
    vLLM's KV events use; [] when the params carry none or malformed ones."""
    hashes = params.get("kvbranch_block_hashes")
    if not isinstance(hashes, list):
        return []
    out: list[int] = []
    for h in hashes[:100_000]:
        if not isinstance(h, str):
            return []
        try:
            raw = bytes.fromhex(h)
        except ValueError:
            return []
        out.append(int.from_bytes(raw[-8:], "big"))
    return out


class SessionStore(IndexBackend):
    """Holds, turns, homes and placement of every session (routers only)."""

    def __init__(self, hold_ttl_s: float) -> None:
        self.hold_ttl_s = hold_ttl_s

    def offer_s(self, ttl_s: float | None) -> float:
        """How long a hold filed with ``ttl_s`` is offered: never past the store's hold TTL."""
        return self.hold_ttl_s if ttl_s is None else max(0.001, min(self.hold_ttl_s, ttl_s))

    @abc.abstractmethod
    async def begin_turn(self, key: Key) -> TurnStart:
        """Start a turn of ``key``'s branch: take its hold (atomic and single-use across every
        router: of two routers starting the same branch's turn at once, exactly one gets the
        hold), give the turn its number, read the session's home and the branch's chain."""

    @abc.abstractmethod
    async def put_hold(self, key: Key, hold: Hold, ttl_s: float | None = None) -> bool:
        """File D's hold for the branch's next turn, unless a newer turn (a larger
        ``hold.turn``) already filed one; True when filed. Also records the branch's chain.
        ``ttl_s``: offered for less than the store's hold TTL (a hold shared with a fork's new
        branch lives no longer than its parent's)."""

    @abc.abstractmethod
    async def peek_hold(self, key: Key) -> Hold | None:
        """The live hold of ``key`` without taking it (stats and tests)."""

    @abc.abstractmethod
    async def peek_home(self, tenant: str, session: str) -> str | None:
        """The session's home instance id without starting a turn (:meth:`begin_turn` numbers
        the turn and takes the hold): a router in front of aggregated replicas reads where a
        session lives and leaves the hold for the replica that serves the turn to take."""

    @abc.abstractmethod
    async def set_home(self, tenant: str, session: str, instance_id: str) -> None:
        """Record the session's home prefill instance (where its turns go while it is up)."""

    @abc.abstractmethod
    async def add_session_instances(
        self, tenant: str, session: str, instance_ids: list[str]
    ) -> None:
        """Record that these instances have the session (its pins, branches, host store)."""

    @abc.abstractmethod
    async def session_instances(self, tenant: str, session: str) -> set[str]:
        """The instances recorded as having the session (empty: none recorded)."""

    @abc.abstractmethod
    async def drop_session(self, tenant: str, session: str) -> int:
        """Forget a deleted session: its holds, home and placement; returns holds dropped."""

    @abc.abstractmethod
    async def drop_instance_holds(self, decode_url: str) -> int:
        """Forget the holds of a D that restarted (backends that cannot enumerate them without
        a scan return 0: readers compare the hold's instance id with the live one anyway)."""

    @abc.abstractmethod
    async def snapshot(self, tenant: str | None) -> list[dict[str, Any]]:
        """Live holds of one tenant (all when None) for the stats route, where the backend can
        list them without a scan (the Redis backend lists the ones this router filed)."""

    @property
    def sweep_interval_s(self) -> float:
        """Often enough that an expired hold lives at most about twice its ttl."""
        return min(max(self.hold_ttl_s, 1.0), 60.0)
