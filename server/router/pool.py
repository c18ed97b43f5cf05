"""The router's instance pool: which prefill and decode instances are up, and which one a turn
goes to.

Health is probed lazily (at most once per ``PROBE_MAX_AGE_S`` per instance, when a turn or a
health check needs it; callers that find a probe of the same instance in flight wait for it, so
a flood of ``/health`` requests costs no more probes than one) and an instance that could not be
reached is marked down at once; it comes back on the next probe that answers 200. Probes go
through their own HTTP client (``probe_client``: the router builds one with its own small
connection pool), never the turns' pool: a tenant that holds every pooled connection must not
make probes time out and mark the instances down for everyone. Each probe also reads the
instance's ``instance_id``: a changed id means the instance restarted and lost the blocks it
held, so ``on_restart`` drops its index entries.

Ejection (a circuit breaker, as vllm-router has one): an instance whose health check answers
but whose requests fail (unreachable or 5xx) ``EJECT_AFTER_FAILURES`` times in a row is left out
for ``EJECT_S`` whatever its health check says; then it gets one request again, and one more
failure ejects it again. A success resets the count. Without this, every turn would pay a
failed leg on it before falling back.

Membership: the instances named by ``--prefill``/``--decode`` (seeds), plus — with a shared
index (:mod:`server.index`) — every instance whose heartbeat is live there, refreshed at most
once per ``MEMBERS_MAX_AGE_S``, and only when the record's seal verifies under the cluster secret
(:mod:`server.index.record_seal`): a record anyone else wrote into the index is ignored, counted
(``kvbranch_router_index_records_refused_total``) and logged (at most once per
``REFUSED_LOG_INTERVAL_S``), so a writer of the index can never point turns at a URL. An
instance the index lists is chosen only while its heartbeat lives: once its record expires, no
turn is aimed at it, whatever this router last saw — except for one heartbeat TTL after the
index was unreachable or lost its records, while the instances re-register
(:meth:`Pool.refresh_members`).

Aggregated replicas (``--replica``, or index records of role "both") are a third group: while
the router knows replicas and no prefill or decode instance, each turn goes to one replica
(:mod:`server.router.replicas` chooses it, :mod:`server.router.replica_turn` relays it).

Choice (:mod:`server.router.choice` scores it): a decode instance is the one that holds the
branch's KV when it is up, else the least busy. A prefill instance is the cheapest: the prefill
left to do given what each P holds (a claimable hold makes every P equally cheap: the pull brings
the history) plus a load term; ties go to the session's home, then to rendezvous hashing of
(tenant, session) over the live prefill instances — when one leaves, only its own sessions move,
and when it comes back they return. Without a shared index that is today's rule: a session's
turns go to its rendezvous P, a turn without a session to the least busy one.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import CollectorRegistry, Counter

from sdk.contract import HEALTH_PATH, InstanceInfo
from server.common.cluster_auth import ROUTER_PROOF_HEADER, sign
from server.connector.pd.transfer_auth import load_cluster_secret
from server.index import (
    BlockHits,
    IndexUnavailable,
    InstanceIndex,
    InstanceRecord,
    Key,
    TurnStart,
    record_seal,
)
from server.index.membership import DEFAULT_HEARTBEAT_TTL_S
from server.router import choice
from server.router.replicas import ReplicaChoice, choose_replica

logger = logging.getLogger("kvbranch.router")

PROBE_MAX_AGE_S = 1.0
#: Routing policies: the cache-aware default, and the baseline with no index at all.
CACHE_AWARE, ROUND_ROBIN = "cache-aware", "round-robin"
#: Every turn of a held branch through P then D (the pull): ``cache-aware`` without D's local
#: turns (:meth:`Pool.serves_locally`), for the A/B of ``benchmarks/pd_turns``.
ALWAYS_SPLIT = "always-split"
POLICIES = (CACHE_AWARE, ROUND_ROBIN)
#: The role of an aggregated replica, as its record in the index names it.
REPLICA = "both"
#: The pool's list for each role an index record may have.
_GROUP_OF = {"prefill": "prefills", "decode": "decodes", REPLICA: "replicas"}
#: An instance the index stopped listing this long ago is forgotten (it may come back: then
#: it is learnt again).
FORGET_UNLISTED_S = 60.0
#: How stale this router's copy of the index's membership may be.
MEMBERS_MAX_AGE_S = 1.0
PROBE_TIMEOUT_S = 3.0
#: Connections the probes' own client keeps (one probe per instance at a time; more instances
#: than this wait their turn, still never behind client traffic).
PROBE_MAX_CONNECTIONS = 32
#: A refused index record is logged at most this often (the metric counts every one).
REFUSED_LOG_INTERVAL_S = 60.0
#: Failed requests in a row (unreachable or 5xx) after which an instance is left out ...
EJECT_AFTER_FAILURES = 3
#: ... for this long, whatever its health check says (vllm-router's breaker waits 30 s too).
EJECT_S = 30.0


@dataclass
class Instance:
    url: str
    role: str
    alive: bool = False
    instance_id: str | None = None
    checked_at: float = 0.0
    inflight: int = 0
    #: Of those, the ones whose prompt it is computing: a P leg until its answer, a turn it
    #: serves alone until the first bytes of its answer (a D's decode leg computes no prompt).
    prefilling: int = 0
    requests: int = 0
    failures: int = 0
    #: Failed requests in a row; a success resets it.
    consecutive_failures: int = 0
    #: Left out until then (router clock), see ``EJECT_S``.
    ejected_until: float = 0.0
    #: The instance's record in the shared index (None: a seed the index does not list).
    record: InstanceRecord | None = None
    #: A seed (``--prefill``/``--decode``): chosen on its probe alone. An instance learnt from
    #: the index is chosen only while the index lists it.
    seed: bool = True
    #: Listed by the index's membership at the last refresh.
    listed: bool = True
    #: When the index stopped listing it (router clock; None while listed).
    unlisted_since: float | None = None
    #: The probe in flight, which concurrent callers wait for instead of sending their own.
    probing: asyncio.Future[bool] | None = field(default=None, repr=False, compare=False)
    #: The instance's health body as its last successful probe read it.
    health: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)
    #: Its health route answered 404 (no kvbranch plugin: plain vLLM), already logged.
    not_kvbranch: bool = field(default=False, repr=False, compare=False)

    @property
    def eligible(self) -> bool:
        """A seed always; an instance learnt from the index only while the index lists it."""
        return self.seed or self.listed

    @property
    def load(self) -> int:
        """Requests this router has in flight there, or the instance's own count at its last
        heartbeat when larger (other routers' requests)."""
        return max(self.inflight, self.record.load if self.record is not None else 0)

    def info(self) -> dict[str, Any]:
        """As health and stats report it (:class:`InstanceInfo`): the fields it shares with
        this record, read by name, except ``listed``, which there means eligible (a seed, or
        listed by the index)."""
        info = InstanceInfo.model_validate(self, from_attributes=True)
        return {**info.model_dump(), "listed": self.eligible}


class Pool:
    """The instances, their health, and the one HTTP client the router talks to them with."""

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        *,
        client: httpx.AsyncClient,
        replica_urls: Sequence[str] = (),
        probe_client: httpx.AsyncClient | None = None,
        api_key: str | None = None,
        on_restart: Callable[[str], object] | None = None,
        secret: bytes | None = None,
        store: InstanceIndex | None = None,
        policy: str = CACHE_AWARE,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if store is None and not replica_urls and (not prefill_urls or not decode_urls):
            raise ValueError(
                "a router needs at least one prefill and one decode instance, or replicas"
            )
        #: The router clock every age and deadline here is read from (a test moves its own).
        self.clock = clock
        self.prefills = [Instance(u.rstrip("/"), "prefill") for u in prefill_urls]
        self.decodes = [Instance(u.rstrip("/"), "decode") for u in decode_urls]
        #: Aggregated replicas (``--replica``, or records of role "both" in the index): each
        #: serves a whole turn (:mod:`server.router.replica_turn`).
        self.replicas = [Instance(u.rstrip("/"), REPLICA) for u in replica_urls]
        self.client = client
        #: Health probes' own client (its own connections); the turns' client when not given
        #: (tests with one fake transport). The router gives it one of its own.
        self.probe_client = probe_client if probe_client is not None else client
        self.api_key = api_key
        self._on_restart = on_restart
        #: Run when a probe finds an instance up that was not: False keeps it down (the router's
        #: admin sends it the deletes it missed, :mod:`server.router.pending_deletes`).
        self.before_up: Callable[[Instance], Awaitable[bool]] | None = None
        #: The shared index whose membership this pool follows (None: seeds only).
        self.store = store
        #: ``cache-aware`` (the default) or ``round-robin``: the no-index baseline the cluster
        #: benchmark measures against (P and D in turn, nothing filed, nothing pulled).
        self.policy = policy
        self._turns_routed = 0
        self._members_at = -1e9
        self._members_seen_at = -1e9
        #: The last membership read that failed, and the last read that listed anyone before
        #: one that found nobody (router clock): for one heartbeat TTL after either, an
        #: instance the index stops listing stays listed — the instances are re-registering.
        self._failed_read_at = -1e9
        self._lost_after = -1e9
        self.members_failures = 0
        #: The cluster secret: it signs the requests that carry transfer params or claims,
        #: and verifies the instances' records in the index.
        self.secret = secret if secret is not None else load_cluster_secret()
        self.records_refused = 0
        self._refused_metric = Counter(
            "kvbranch_router_index_records_refused",
            "Instance records read from the index whose seal did not verify (ignored)",
            registry=registry,
        )
        self._refused_logged_at = -1e9
        self._refused_unlogged = 0

    @property
    def all(self) -> list[Instance]:
        return self.prefills + self.decodes + self.replicas

    @property
    def aggregated(self) -> bool:
        """Turns go to one replica each: the router knows replicas and no prefill or decode
        instance. One index serves one topology (``--cluster-name`` keeps two apart); a P or D
        listed beside replicas keeps the router in P/D mode, as it always was."""
        return any(i.eligible for i in self.replicas) and not any(
            i.eligible for i in self.prefills + self.decodes
        )

    @property
    def front(self) -> list[Instance]:
        """The instances a session's reads, creates and health go to: the prefill instances,
        or the replicas in aggregated mode."""
        return self.replicas if self.aggregated else self.prefills

    def infos(self) -> list[dict[str, Any]]:
        return [i.info() for i in self.all]

    def auth_headers(self) -> dict[str, str]:
        """The router's own key, for the calls it makes itself (probes, claims)."""
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def proof(self, method: str, path: str, content: bytes) -> dict[str, str]:
        """The header that tells an instance this request is the router's own
        (:mod:`server.common.cluster_auth`): the only way transfer params or a claim are
        accepted."""
        return {ROUTER_PROOF_HEADER: sign(self.secret, method, path, content)}

    async def probe(self, inst: Instance, max_age: float = PROBE_MAX_AGE_S) -> bool:
        """Whether ``inst`` is up: its last probe when younger than ``max_age``, else the probe
        in flight if there is one, else a new probe. The probe runs on its own (shielded): a
        caller that goes away does not cancel it for the others."""
        now = self.clock()
        if now < inst.ejected_until:
            return False
        if now - inst.checked_at < max_age:
            return inst.alive
        if inst.probing is None:
            inst.probing = asyncio.ensure_future(self._probe_now(inst))
            inst.probing.add_done_callback(lambda _: setattr(inst, "probing", None))
        return await asyncio.shield(inst.probing)

    async def _probe_now(self, inst: Instance) -> bool:
        try:
            r = await self.probe_client.get(
                inst.url + HEALTH_PATH, headers=self.auth_headers(), timeout=PROBE_TIMEOUT_S
            )
            alive = r.status_code == 200
            if r.status_code == 404 and not inst.not_kvbranch:
                inst.not_kvbranch = True  # said once: the probe repeats every few seconds
                logger.warning(
                    "%s %s answers 404 on %s: it is not a kvbranch instance (plain vLLM?); "
                    "the router sends it nothing (start it with python -m server)",
                    inst.role,
                    inst.url,
                    HEALTH_PATH,
                )
            body = r.json() if alive else None
            reported = body.get("instance_id") if isinstance(body, dict) else inst.instance_id
        except (httpx.HTTPError, ValueError):
            alive, reported, body = False, inst.instance_id, None
        if isinstance(body, dict):
            inst.health = body  # the router's own /health shows it: no second request
        if alive and inst.instance_id and reported != inst.instance_id:
            if self._on_restart:
                self._on_restart(inst.url)
            logger.warning(
                "%s %s restarted (instance %s, was %s): its holds are void",
                inst.role,
                inst.url,
                reported,
                inst.instance_id,
            )  # a restart lost D's blocks
        if alive and not inst.alive and self.before_up is not None:
            alive = await self.before_up(inst)  # what it missed while down, first
        if alive != inst.alive:
            logger.warning("%s %s is %s", inst.role, inst.url, "up" if alive else "DOWN")
        inst.alive, inst.instance_id, inst.checked_at = alive, reported, self.clock()
        return alive

    def mark_down(self, inst: Instance) -> None:
        """``inst`` could not be reached: skip it until a probe finds it up again."""
        inst.alive, inst.checked_at = False, self.clock()
        inst.failures += 1

    def failed(self, inst: Instance, *, reachable: bool = True) -> None:
        """A turn's request to ``inst`` failed (5xx, or unreachable: then it is also marked
        down); enough in a row eject it. Only turns count: a session route fanned out to an
        instance that is down anyway must not keep it out once it is back."""
        if reachable:
            inst.failures += 1
        else:
            self.mark_down(inst)
        inst.consecutive_failures += 1
        if inst.consecutive_failures >= EJECT_AFTER_FAILURES:
            inst.alive, inst.ejected_until = False, self.clock() + EJECT_S
            logger.warning(
                "%s %s failed %d requests in a row: left out for %.0f s",
                inst.role,
                inst.url,
                inst.consecutive_failures,
                EJECT_S,
            )

    def succeeded(self, inst: Instance) -> None:
        """A request to ``inst`` was answered (any status under 500)."""
        inst.consecutive_failures = 0

    async def probe_all(self) -> None:
        """Every instance as health reports it. An instance up as of ``PROBE_MAX_AGE_S`` ago is
        not asked again, so a flood of health checks costs a live instance at most one probe per
        ``PROBE_MAX_AGE_S``. One last seen down is probed now (joining a probe in flight, so
        still one at a time): a background probe that saw it down just before it came back must
        not make health say degraded about an instance that answers (a restarted decode
        instance did, docs/pd_notes.md)."""
        await asyncio.gather(
            *(self.probe(i, PROBE_MAX_AGE_S if i.alive else 0.0) for i in self.all)
        )

    def trusted(self, record: InstanceRecord) -> bool:
        """``record`` was sealed by an instance holding the cluster secret, recently; else it is
        counted, logged at most once per ``REFUSED_LOG_INTERVAL_S`` and False."""
        if record_seal.verify(record, self.secret):
            return True
        self.records_refused += 1
        self._refused_metric.inc()
        self._refused_unlogged += 1
        now = self.clock()
        if now - self._refused_logged_at >= REFUSED_LOG_INTERVAL_S:
            logger.warning(
                "ignored %d index record(s) whose seal does not verify, the last for instance "
                "%.80r at %.200r: a process without this cluster's secret (or with another "
                "KVBRANCH_CLUSTER_SECRET) writes to the index",
                self._refused_unlogged,
                record.instance_id,
                record.url,
            )
            self._refused_logged_at, self._refused_unlogged = now, 0
        return False

    async def refresh_members(self, max_age: float = MEMBERS_MAX_AGE_S) -> None:
        """Follow the shared index's membership: learn new instances, leave out the ones whose
        heartbeat expired. The index unreachable: keep the last view — routers go on serving on
        affinity alone, and an instance that died meanwhile fails its probe."""
        if self.store is None or self.clock() - self._members_at < max_age:
            return
        self._members_at = self.clock()
        try:
            records = [r for r in await self.store.members() if self.trusted(r)]
        except IndexUnavailable as exc:
            # The last view is kept through the outage and for one heartbeat TTL after it:
            # a Redis that restarted comes back empty, and the instances re-register one by
            # one over their heartbeat backoff (up to 5 s apart), not all at once.
            self._failed_read_at = self._members_at
            self.members_failures += 1
            if self.members_failures == 1:
                logger.warning("index unreachable, routing on affinity alone: %s", exc)
            return
        if self.members_failures:
            logger.warning("index reachable again (%d failed reads)", self.members_failures)
            self.members_failures = 0
        now = self.clock()
        if not records and any(i.listed and not i.seed for i in self.all):
            # Everyone gone at once, without a failed read in between: the index lost its
            # records (a fast failover), not the fleet. Keep the last view for one heartbeat
            # TTL from the last read that listed anyone.
            self._lost_after = max(self._lost_after, self._members_seen_at)
        if records:
            self._members_seen_at = now
        # While the view is kept, an instance missing from the index stays listed (instead of
        # the router answering 503 until every instance has re-registered); one that died
        # meanwhile fails its probe anyway.
        keep = now - max(self._failed_read_at, self._lost_after) < DEFAULT_HEARTBEAT_TTL_S
        by_url = {r.url.rstrip("/"): r for r in records if r.role in _GROUP_OF}
        for inst in self.all:
            rec = by_url.pop(inst.url, None)
            if rec is None and keep:
                continue
            inst.listed = rec is not None and rec.role == inst.role
            if inst.listed:
                inst.record, inst.unlisted_since = rec, None
            elif not inst.seed:
                inst.record = None
                if inst.unlisted_since is None:
                    inst.unlisted_since = now
        # Forget instances the index stopped listing long ago (a fleet whose instances come
        # and go at new URLs would otherwise grow these lists forever).
        for group in (self.prefills, self.decodes, self.replicas):
            group[:] = [
                i
                for i in group
                if i.seed
                or i.unlisted_since is None
                or i.inflight
                or now - i.unlisted_since < FORGET_UNLISTED_S
            ]
        for url, rec in by_url.items():
            inst = Instance(url, rec.role, seed=False, record=rec)
            getattr(self, _GROUP_OF[rec.role]).append(inst)
            logger.info("%s %s joined (instance %s)", rec.role, url, rec.instance_id)

    @staticmethod
    def usable(inst: Instance, now: float) -> bool:
        """``inst`` gets turns as last probed: eligible, up and not ejected."""
        return inst.eligible and inst.alive and now >= inst.ejected_until

    def routable(self, instances: list[Instance]) -> bool:
        """Some instance of ``instances`` would get a turn now (as last probed). Health reports
        this, so it says degraded whenever turns would get 503."""
        now = self.clock()
        return any(self.usable(i, now) for i in instances)

    def fresh(self, inst: Instance, now: float) -> bool:
        """``inst``'s last probe is recent enough to go by (or it is ejected)."""
        return now < inst.ejected_until or now - inst.checked_at < PROBE_MAX_AGE_S

    async def live(self, instances: list[Instance]) -> list[Instance]:
        """The eligible instances that are up. Only stale ones are probed here; the router's
        background refresh (:meth:`keep_fresh`) keeps them fresh, so a turn rarely waits."""
        await self.refresh_members()
        candidates = [i for i in instances if i.eligible]
        now = self.clock()
        stale = [i for i in candidates if not self.fresh(i, now)]
        if stale:
            await asyncio.gather(*(self.probe(i) for i in stale))
        now = self.clock()
        return [i for i in candidates if self.usable(i, now)]

    async def keep_fresh(self) -> None:
        """Refresh membership and probe what is about to go stale, off the turns' path (the
        router's lifespan runs it): otherwise the turn that finds every probe expired at once
        pays for all of them — 50 probes and the membership read at 100 instances."""
        while True:
            try:
                await self.refresh_members(max_age=MEMBERS_MAX_AGE_S * 0.9)  # about once a second
                soon = self.clock() + PROBE_MAX_AGE_S / 2
                due = [i for i in self.all if i.eligible and not self.fresh(i, soon)]
                if due:
                    await asyncio.gather(*(self.probe(i, PROBE_MAX_AGE_S / 2) for i in due))
            except Exception:  # noqa: BLE001 - a refresh must never end the loop
                logger.exception("background refresh failed")
            await asyncio.sleep(PROBE_MAX_AGE_S / 2)

    def serves_locally(self, decode: Instance, prefill: Instance | None) -> bool:
        """Whether the D that holds a branch serves its next turn alone: it has the history
        (device or host store) and computes only the turn's new tokens, with no P leg and no
        pull either way. Where that D computes no more prompts than the P the turn would take
        (P's requests are all prompts; D's decode legs only decode): a resumed turn's prefill
        is short, and waiting behind other turns' prefills on P is most of its time when
        several agents resume at once, while D only decodes. Turns that resume together are
        shared between P and D instead of all queueing on P (docs/pd.md)."""
        if self.policy != CACHE_AWARE or prefill is None:
            return False  # no P at all: the turn's fallback says so (decode-only)
        return decode.prefilling <= prefill.load

    def by_instance_id(self, instance_id: str | None) -> Instance | None:
        if instance_id is None:
            return None
        return next((i for i in self.all if i.instance_id == instance_id), None)

    async def choose_replica(
        self,
        key: Key | None,
        *,
        holder: str | None = None,
        home: str | None = None,
        skip: Collection[str] = (),
    ) -> ReplicaChoice[Instance] | None:
        """The replica for a turn (:mod:`server.router.replicas`): the holder or the home while
        live and not overloaded, else rendezvous; None when no replica is live (but the ones
        at the URLs in ``skip``: this turn could not connect to them)."""
        live = [i for i in await self.live(self.replicas) if i.url not in skip]
        if not live:
            return None
        if self.policy == ROUND_ROBIN:  # the baseline front: replicas in turn, no affinity
            self._turns_routed += 1
            return ReplicaChoice(live[self._turns_routed % len(live)], moved=False)
        return choose_replica(live, key, holder=holder, home=home)

    async def choose_front(self, key: Key | None) -> Instance | None:
        """Where a session's first request goes (a create, a prefetch): its P, or in aggregated
        mode its replica."""
        if not self.aggregated:
            return await self.choose_prefill(key)
        chosen = await self.choose_replica(key)
        return chosen.replica if chosen is not None else None

    async def choose_prefill(
        self, key: Key | None, start: TurnStart | None = None, *, pulled: bool = False
    ) -> Instance | None:
        """The cheapest live P for this turn (:mod:`server.router.choice`); without the index's
        records (the embedded backend), a session's rendezvous P."""
        live = await self.live(self.prefills)
        if not live:
            return None
        if self.policy == ROUND_ROBIN:
            self._turns_routed += 1
            return live[self._turns_routed % len(live)]
        scored = any(i.record is not None for i in live)
        if not scored or start is None or key is None:
            return choice.choose(live, key, scored=scored)
        block_size = max((i.record.block_size for i in live if i.record), default=0)
        hits: dict[str, BlockHits] = {}
        if start.chain and not pulled and len(live) > 1 and self.store is not None:
            records = [i.record for i in live if i.record is not None]
            try:
                hits = await self.store.block_hits(start.chain, records)
            except IndexUnavailable:
                hits = {}
        return choice.choose(
            live,
            key,
            history_tokens=len(start.chain) * block_size,
            pulled=pulled,
            hits=hits,
            block_size=block_size,
            home=start.home,
        )

    async def choose_decode(
        self, held_on: str | None, held_by: str | None = None, key: Key | None = None
    ) -> Instance | None:
        """The D that holds the branch's KV when it is up (same URL, and the same instance id
        when the hold names one), else the least busy — ties broken by rendezvous hashing of
        the branch, so new branches spread over idle D's instead of all landing on the first."""
        live = await self.live(self.decodes)
        if not live:
            return None
        if self.policy == ROUND_ROBIN:
            return live[self._turns_routed % len(live)]
        for inst in live:
            if inst.url == held_on and (held_by is None or inst.instance_id == held_by):
                return inst
        branch = "/".join(key).encode() if key is not None else os.urandom(8)
        return min(live, key=lambda i: (i.load, -choice.rendezvous_weight(branch, i.url)))
