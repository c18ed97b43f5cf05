"""The cluster index's one interface: what every router and instance reads and writes, whatever
backend keeps it (:mod:`server.index.memory` in the router's own process, the default;
:mod:`server.index.redis_store` in a Redis every router and instance shares).

The index is *advisory* (docs/cluster.md): nothing read from it is trusted. A hold it offers is
claimed on D and checked by P's connector (seal, expiry, claim, once, token prefix, chained block
hashes) before one block moves; an instance it lists counts only when the record's seal
verifies under the cluster secret, and is probed before a turn goes there; a block it says P
holds is only a cost estimate (vLLM and the host store check token ids locally). So a stale,
lost, evicted or tampered entry can cost a recompute, never a wrong answer nor traffic sent to
a URL no instance of the cluster vouched for — which is why every backend may forget anything
at any time (TTLs, caps, a Redis restart).

Three kinds of record:

* **session level**, written by routers: D's hold per (tenant, session, branch) — single-use —, a
  turn counter per branch that orders turns without wall clocks (a late answer of an older turn
  never replaces a newer one's hold), the session's *home* prefill instance, and which instances
  have the session (session routes go there instead of to every instance);
* **instance level**, written by each instance about itself only: its record (URL, role, model,
  block size, NIXL side channel, load) under its identity, refreshed by a heartbeat with a TTL
  and sealed with the cluster secret — the one thing routers read from the index that decides
  where traffic goes, so a record whose seal fails is never listed (:mod:`.record_seal`);
* **block level**, written by each instance about itself only: which block hashes it holds, per
  tier (device cache, host store), stamped with its identity and *generation*. A restart (new
  identity) or a bumped generation (a lost event stream, a cleared cache) makes every older entry
  invisible at once, without a scan.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from sdk.contract import REMOTE_NUM_TOKENS

Key = tuple[str, str, str]  # (tenant, session id, branch id)
Role = Literal["prefill", "decode", "both"]
Tier = Literal["device", "host"]
TIERS: tuple[Tier, ...] = ("device", "host")

#: Default cap on holds a backend keeps: each is a few KB of params; 100k stay well under a GiB.
DEFAULT_MAX_HOLDS = 100_000
#: How long session-level records (turn counter, home, where the session is) outlive the last
#: turn that touched them: as long as an idle session keeps its pins on the instances.
DEFAULT_SESSION_TTL_S = 6 * 3600.0
#: An instance's record expires this long after its last heartbeat: then no router picks it.
DEFAULT_HEARTBEAT_TTL_S = 10.0
#: Block entries expire this long after they were last stored (a lost "removed" event costs at
#: most this long of wrong cost estimates, never a wrong answer).
DEFAULT_BLOCK_TTL_S = 600.0
#: Most instances one session is recorded on (pins and branches live there).
MAX_SESSION_INSTANCES = 64
#: Most branches of one session whose holds a session delete drops at once.
MAX_SESSION_BRANCHES = 256


@dataclass
class Hold:
    """D's transfer params for one branch: what lets a P pull the conversation back."""

    decode_url: str
    instance_id: str | None
    params: dict[str, Any]
    #: The branch's turn that produced it (:meth:`IndexStore.begin_turn`): a hold of an older
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
class InstanceRecord:
    """One instance, as it describes itself in its heartbeat."""

    instance_id: str
    url: str
    role: Role
    model: str = ""
    block_size: int = 0
    #: NIXL side channel (host:port) for P/D pulls, "" when the instance has none.
    nixl: str = ""
    #: Generation of its block entries: entries stamped with another are invisible.
    generation: int = 0
    #: Requests in flight (running + waiting) at the last heartbeat.
    load: int = 0
    #: Device KV cache use in [0, 1] at the last heartbeat.
    kv_usage: float = 0.0
    #: Data-parallel engines behind this URL.
    engines: int = 1
    started_at: float = field(default_factory=time.time)
    #: The instance's seal over every field above (:mod:`server.index.record_seal`): routers
    #: list only records whose seal verifies under the cluster secret.
    mac: str = ""


@dataclass
class BlockHits:
    """How much of a hash chain one instance holds: the longest prefix, in blocks, per tier."""

    device: int = 0
    host: int = 0

    @property
    def best(self) -> int:
        return max(self.device, self.host)


@dataclass(frozen=True)
class BlockBatch:
    """One batch of an instance's block events, as every backend applies it: the hashes its
    ``tier`` stored and removed (low 64 bits, as vLLM's KV events carry them), under its
    identity and generation."""

    instance_id: str
    generation: int
    tier: Tier
    stored: list[int]
    removed: list[int]


@dataclass
class HoldCounts:
    """What this process did with holds, counted alike by every backend for ``counters()``
    (holds that expired unseen inside Redis are not counted there)."""

    stored: int = 0
    taken: int = 0
    expired: int = 0
    stale_dropped: int = 0


def snapshot_row(key: Key, hold: Hold, expires_in_s: float) -> dict[str, Any]:
    """One live hold as the stats route lists it (every backend's :meth:`IndexStore.snapshot`)."""
    return {
        "session_id": key[1],
        "branch_id": key[2],
        "decode": hold.decode_url,
        "tokens": hold.num_tokens,
        "expires_in_s": round(expires_in_s, 1),
    }


class IndexUnavailable(Exception):
    """The backend could not be reached or answered out of schema. Routers catch it and go on
    on affinity alone (no pulls); instances retry their heartbeat."""


class IndexStore(abc.ABC):
    """The cluster index. Every method is safe to call from many routers at once; the ones that
    must be atomic across routers say so."""

    #: "memory" or "redis", for logs and stats.
    kind: str = ""

    def __init__(self, hold_ttl_s: float) -> None:
        self.hold_ttl_s = hold_ttl_s

    # --- session level (routers) ---------------------------------------------------------

    @abc.abstractmethod
    async def begin_turn(self, key: Key) -> TurnStart:
        """Start a turn of ``key``'s branch: take its hold (atomic and single-use across every
        router: of two routers starting the same branch's turn at once, exactly one gets the
        hold), give the turn its number, read the session's home and the branch's chain."""

    @abc.abstractmethod
    async def put_hold(self, key: Key, hold: Hold) -> bool:
        """File D's hold for the branch's next turn, unless a newer turn (a larger
        ``hold.turn``) already filed one; True when filed. Also records the branch's chain."""

    @abc.abstractmethod
    async def peek_hold(self, key: Key) -> Hold | None:
        """The live hold of ``key`` without taking it (stats and tests)."""

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

    # --- instance level (each instance about itself) -------------------------------------

    @abc.abstractmethod
    async def heartbeat(self, record: InstanceRecord, ttl_s: float) -> None:
        """Register or refresh ``record``; it disappears ``ttl_s`` after the last heartbeat."""

    @abc.abstractmethod
    async def deregister(self, instance_id: str) -> None:
        """Leave the cluster now (a clean shutdown)."""

    @abc.abstractmethod
    async def members(self) -> list[InstanceRecord]:
        """The instances whose heartbeat has not expired."""

    # --- block level (each instance about itself) ----------------------------------------

    async def publish_blocks(
        self,
        instance_id: str,
        generation: int,
        tier: Tier,
        stored: list[int],
        removed: list[int],
    ) -> None:
        """Apply one batch of the instance's block events (hashes: low 64 bits, as vLLM's
        KV events carry them) under its identity and generation. An empty batch costs no
        backend work (a Redis round trip)."""
        if stored or removed:
            await self.apply_blocks(BlockBatch(instance_id, generation, tier, stored, removed))

    @abc.abstractmethod
    async def apply_blocks(self, batch: BlockBatch) -> None:
        """The backend's half of :meth:`publish_blocks`: write a non-empty batch (the removed
        first, then the stored, so a hash in both ends up stored)."""

    @abc.abstractmethod
    async def block_hits(
        self, chain: list[int], members: list[InstanceRecord]
    ) -> dict[str, BlockHits]:
        """For each of ``members``, the longest prefix of ``chain`` it holds per tier; only
        entries stamped with the member's current identity and generation count."""

    # --- housekeeping --------------------------------------------------------------------

    async def sweep(self) -> int:
        """Drop expired records kept in process memory; backends with native TTLs do nothing."""
        return 0

    @property
    def sweep_interval_s(self) -> float:
        """Often enough that an expired hold lives at most about twice its ttl."""
        return min(max(self.hold_ttl_s, 1.0), 60.0)

    @abc.abstractmethod
    async def snapshot(self, tenant: str | None) -> list[dict[str, Any]]:
        """Live holds of one tenant (all when None) for the stats route, where the backend can
        list them without a scan (the Redis backend lists the ones this router filed)."""

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
