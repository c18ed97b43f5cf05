"""The cluster index at scale: 100 simulated instances × 10k agent sessions through the REAL index
backends (:mod:`server.index`: the in-process one and a real ``redis-server``) and the REAL
routing code (:class:`server.router.pool.Pool` and :class:`server.router.turn.TurnFlow`), with 1,
2 and 4 router replicas (docs: /work/shared/CLUSTER_NOTES.md §6.3).

Run: ``python -m benchmarks.history.index_sim [--quick] [--backends memory,redis] [--routers 1,2,4]
[--no-results]``.

What is real and what is simulated:

* **Real**: every index call (``begin_turn``, ``put_hold``, ``set_home``,
  ``add_session_instances``, ``heartbeat``, ``members``, ``publish_blocks``, ``block_hits``), in
  the order ``_Turn.run`` makes them: ``TurnFlow.begin`` → ``Pool.choose_decode`` → (claim) →
  ``Pool.choose_prefill(key, start, pulled=…)`` → ``TurnFlow.place`` → … →
  ``TurnFlow.file_hold``. Each router replica is its own ``Pool`` + ``TurnFlow`` with its own
  store client (its own Redis connections); its health probes go through an
  ``httpx.MockTransport`` that answers for live instances and refuses for killed ones. No
  choice logic is reimplemented here.
* **Simulated**: the instances. Each P has a device cache (an LRU of ``--cache-blocks`` blocks,
  touched tail first so a prefix is evicted last, as vLLM frees blocks) and a host store (an LRU
  the device's evictions fall into); it publishes each turn's stored/evicted blocks with
  ``publish_blocks`` (device and host tiers). Each D keeps holds in an LRU of blocks
  (``--d-hold-blocks``, default a P's device + host); the claim (an HTTP call on D in the real
  router) succeeds when D is live and still has the hold. Load is requests in flight counted on
  a turn clock (P busy for 2 turns, D for 40),
  reported in the heartbeats.
* **Clock**: wall time. The index backends and the Pool keep their own clocks (``time.monotonic``
  and Redis ``TIME``: heartbeat TTLs, probe ages, membership refresh), so the simulation runs in
  real time and heartbeats are sent every ``--heartbeat-s`` of wall time (staggered over the
  instances, as independent processes would send them).

Workload: ``--sessions`` agent sessions, each on one of 16 shared system prompts (4–8 blocks),
taking turns in rounds (each round a random permutation of the sessions; ``--turns`` defaults to
two rounds); a turn adds 1–3 blocks of prompt and one block of answer. 5% of turns fork a new
branch from the current one; 2% are run twice at once through two routers (``asyncio.gather``):
the race that must not take a hold twice. At ``--kill-at`` of the turns, 10% of P and 10% of D
stop heartbeating and refuse probes.

Hit rate: over the turns whose history goes beyond the shared system prompt, the fraction of
that history (everything before the new blocks) that was pulled
from D's claimed hold or held by the chosen P (device or host), against an oracle that pulls
whenever a claimable hold exists and else picks the P holding the longest prefix. Duplicate
turns are left out of hit rates (they are the race test).

Baselines in the same run: **round robin** (no index: P and D in turn, no pulls) and
**embedded** (the default one-router deployment: the in-process backend with no heartbeats or
block events, so P by rendezvous, with D's holds and pulls).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import logging
import os
import random
import shutil
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple

import httpx
from prometheus_client import CollectorRegistry

from benchmarks import cli, reporting
from benchmarks.records import Record, result
from sdk.contract import HEALTH_PATH
from server.index import IndexStore, InstanceRecord, Key, MemoryIndexStore, open_store
from server.index.record_seal import seal
from server.router.pool import Instance, Pool
from server.router.turn import TurnFlow

#: The simulated cluster's secret: routers sign with it, instance records are sealed with it.
NAME = "index_sim"
DESCRIPTION = (
    "the cluster index at scale: 100 simulated instances x 10k sessions through the real index "
    "backends and routing code, 1/2/4 routers"
)
SIM_SECRET = b"sim"

TENANT = "sim"
SIM_HOLD_FIELD = "kvbranch_sim_hold"
#: Turns of the turn clock a request keeps P / D busy (the load the heartbeats report).
P_BUSY_TURNS = 2
D_BUSY_TURNS = 40
SYSTEM_PROMPTS = 16
#: Targets (the brief of issue "index simulation").
TARGET_P99_MS = 2.0
TARGET_ROUND_TRIPS = 5.0
TARGET_HIT_VS_ONE_ROUTER = 0.90
TARGET_HIT_VS_RR = 1.25


@dataclass
class SimConfig:
    instances: int = 100
    sessions: int = 10_000
    turns: int = 0  # 0: two rounds of the sessions
    routers: tuple[int, ...] = (1, 2, 4)
    backends: tuple[str, ...] = ("memory", "redis")
    cache_blocks: int = 2000
    host_blocks: int = 4000
    #: D keeps holds up to this many blocks (0: device + host of a P), oldest out first
    d_hold_blocks: int = 0
    block_size: int = 128
    heartbeat_s: float = 2.0
    heartbeat_ttl_s: float = 10.0
    hold_ttl_s: float = 600.0
    kill_frac: float = 0.10
    kill_at: float = 0.5
    fork_p: float = 0.05
    dup_p: float = 0.02
    seed: int = 0
    baselines: bool = True
    #: the tail of turns lasts until the kill is this long past the heartbeat TTL
    tail_s: float = 1.0
    redis_url: str | None = None  # None: start a redis-server (tests/redis_server.py)

    @property
    def total_turns(self) -> int:
        return self.turns or 2 * self.sessions


# --- simulated instances ---------------------------------------------------------------------
def _touch(lru: OrderedDict[int, None], h: int) -> bool:
    """Make block ``h`` the most recently used of ``lru``; True when it was not there (stored
    now), as the device cache and the host store both keep their blocks."""
    if h in lru:
        lru.move_to_end(h)
        return False
    lru[h] = None
    return True


class SimInstance:
    def __init__(self, n: int, role: str, cfg: SimConfig) -> None:
        self.role = role
        self.iid = f"{role[0]}{n:03d}-{os.getpid():x}"
        self.url = f"http://{role[0]}{n}.sim:8000"
        self.alive = True
        self.generation = 1
        self.cap, self.host_cap = cfg.cache_blocks, cfg.host_blocks
        self.hold_cap = cfg.d_hold_blocks or cfg.cache_blocks + cfg.host_blocks
        self.block_size = cfg.block_size
        self.device: OrderedDict[int, None] = OrderedDict()
        self.host: OrderedDict[int, None] = OrderedDict()
        #: D: hold id -> blocks, oldest first (evicted when over ``cap`` blocks)
        self.holds: OrderedDict[str, int] = OrderedDict()
        self.held_blocks = 0
        self.busy_until: list[int] = []
        self.started_at = time.time()

    def load(self, clock: int) -> int:
        self.busy_until = [t for t in self.busy_until if t > clock]
        return len(self.busy_until)

    def record(self, clock: int) -> InstanceRecord:
        """Its heartbeat record, sealed as an instance seals it (routers list no other)."""
        return seal(self._record(clock), SIM_SECRET)

    def _record(self, clock: int) -> InstanceRecord:
        return InstanceRecord(
            instance_id=self.iid,
            url=self.url,
            role="prefill" if self.role == "prefill" else "decode",
            model="sim",
            block_size=self.block_size,
            generation=self.generation,
            load=self.load(clock),
            kv_usage=len(self.device) / self.cap if self.role == "prefill" else 0.0,
            started_at=self.started_at,
        )

    def prefix(self, chain: list[int]) -> int:
        """Blocks of ``chain``'s prefix this P holds (device or host)."""
        best = 0
        for cache in (self.device, self.host):
            n = 0
            for h in chain:
                if h not in cache:
                    break
                n += 1
            best = max(best, n)
        return best

    def compute(self, blocks: list[int]) -> tuple[list[int], list[int], list[int], list[int]]:
        """P ran (or pulled) ``blocks``: they are in its device cache; evictions go to host.
        Returns (device stored, device removed, host stored, host removed)."""
        stored, removed, h_stored, h_removed = [], [], [], []
        for h in reversed(blocks):  # the tail first: the prefix is the most recent
            if _touch(self.device, h):
                stored.append(h)
        while len(self.device) > self.cap:
            h, _ = self.device.popitem(last=False)
            removed.append(h)
            if _touch(self.host, h):
                h_stored.append(h)
        while len(self.host) > self.host_cap:
            h_removed.append(self.host.popitem(last=False)[0])
        return (
            stored,
            [h for h in removed if h not in self.device],
            [h for h in h_stored if h in self.host],
            [h for h in h_removed if h not in self.host],
        )

    def keep_hold(self, hold_id: str, blocks: int) -> None:
        self.holds[hold_id] = blocks
        self.held_blocks += blocks
        while self.held_blocks > self.hold_cap and len(self.holds) > 1:
            _, n = self.holds.popitem(last=False)
            self.held_blocks -= n

    def claim(self, hold_id: str) -> bool:
        """D's side of a claim: still held (the real one is ``HOLD_CLAIM_PATH`` on D)."""
        if not self.alive or hold_id not in self.holds:
            return False
        self.held_blocks -= self.holds.pop(hold_id)
        return True


class Fleet:
    """The simulated instances and the probe endpoint the routers' Pools reach them through."""

    def __init__(self, cfg: SimConfig) -> None:
        half = cfg.instances // 2
        self.prefills = [SimInstance(i, "prefill", cfg) for i in range(half)]
        self.decodes = [SimInstance(i, "decode", cfg) for i in range(cfg.instances - half)]
        self.by_url = {i.url: i for i in self.all}
        self.probes = 0

    @property
    def all(self) -> list[SimInstance]:
        return self.prefills + self.decodes

    def handler(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        inst = self.by_url.get(base)
        self.probes += 1
        if request.url.path != HEALTH_PATH or inst is None or not inst.alive:
            raise httpx.ConnectError("connection refused", request=request)
        return httpx.Response(200, json={"instance_id": inst.iid})


# --- sessions --------------------------------------------------------------------------------
@dataclass
class Branch:
    key: Key
    chain: list[int] = field(default_factory=list)
    hexes: list[str] = field(default_factory=list)


class Workload:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        self.serial = 0
        self.system: list[tuple[list[int], list[str]]] = []
        for k in range(SYSTEM_PROMPTS):
            chain, hexes = self.extend([], [], f"sys{k}", self.rng.randint(4, 8))
            self.system.append((chain, hexes))
        self.sessions: list[list[Branch]] = []
        for s in range(cfg.sessions):
            chain, hexes = self.system[s % SYSTEM_PROMPTS]
            self.sessions.append([Branch((TENANT, f"s{s}", "main"), list(chain), list(hexes))])

    def extend(
        self, chain: list[int], hexes: list[str], salt: str, n: int
    ) -> tuple[list[int], list[str]]:
        """``n`` more chained block hashes (32-byte digests; the index keeps the low 64 bits)."""
        chain, hexes = list(chain), list(hexes)
        parent = bytes.fromhex(hexes[-1]) if hexes else b""
        for _ in range(n):
            self.serial += 1
            parent = hashlib.blake2b(parent + f"{salt}/{self.serial}".encode(), digest_size=32)
            parent = parent.digest()
            hexes.append(parent.hex())
            chain.append(int.from_bytes(parent[-8:], "big"))
        return chain, hexes

    def order(self) -> list[int]:
        """Session of each turn: rounds, each a random permutation of the sessions."""
        out: list[int] = []
        while len(out) < self.cfg.total_turns:
            rnd = list(range(self.cfg.sessions))
            self.rng.shuffle(rnd)
            out += rnd
        return out[: self.cfg.total_turns]


# --- one configuration -----------------------------------------------------------------------
@dataclass
class Router:
    pool: Pool
    flow: TurnFlow
    store: IndexStore


@dataclass
class Stats:
    name: str
    backend: str
    routers: int
    turns: int = 0
    dups: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    steady_ms: list[float] = field(default_factory=list)
    history_blocks: int = 0
    hit_blocks: int = 0
    oracle_blocks: int = 0
    pulls: int = 0
    claims_refused: int = 0
    taken_twice: int = 0
    holds_taken: int = 0
    dead_after_kill: list[float] = field(default_factory=list)
    fallback_turns: int = 0
    p_turns: dict[str, int] = field(default_factory=dict)
    d_turns: dict[str, int] = field(default_factory=dict)
    router_round_trips: int = 0
    fleet_round_trips: int = 0
    redis_commands: int = 0
    redis: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    kill_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.history_blocks if self.history_blocks else float("nan")

    @property
    def oracle_rate(self) -> float:
        return self.oracle_blocks / self.history_blocks if self.history_blocks else float("nan")

    n_p: int = 0
    n_d: int = 0

    @staticmethod
    def imbalance(counts: dict[str, int], n: int) -> float:
        """Turns of the busiest instance over the mean over all ``n`` of the role."""
        vals = list(counts.values())
        return max(vals) / (sum(vals) / n) if vals and n else float("nan")

    def row(self) -> dict[str, Any]:
        lat = self.latencies_ms
        dead = self.dead_after_kill
        return {
            "config": self.name,
            "turns": self.turns,
            "p50_ms": reporting.percentile(lat, 50) if lat else None,
            "p99_ms": reporting.percentile(lat, 99) if lat else None,
            "p99_steady_ms": reporting.percentile(self.steady_ms, 99) if self.steady_ms else None,
            "max_ms": max(lat) if lat else None,
            "hit_rate": self.hit_rate,
            "oracle": self.oracle_rate,
            "pulls": self.pulls,
            "claims_refused": self.claims_refused,
            "rt_per_turn": self.router_round_trips / self.turns if self.turns else None,
            "fleet_rt_per_turn": self.fleet_round_trips / self.turns if self.turns else None,
            "redis_cmds_per_turn": self.redis_commands / self.turns if self.turns else None,
            "taken_twice": self.taken_twice,
            "holds_taken": self.holds_taken,
            "dead_decisions": len(dead),
            "last_dead_s": max(dead) if dead else 0.0,
            "dead_per_s": per_second(dead),
            "p_imbalance": self.imbalance(self.p_turns, self.n_p),
            "d_imbalance": self.imbalance(self.d_turns, self.n_d),
            "fallback_turns": self.fallback_turns,
            "wall_s": self.wall_s,
            **{f"redis_{k}": v for k, v in self.redis.items()},
        }


def per_second(ages: list[float]) -> list[int]:
    if not ages:
        return []
    out = [0] * (int(max(ages)) + 1)
    for a in ages:
        out[int(a)] += 1
    return out


def round_trips(store: IndexStore) -> int:
    return int(store.counters().get("round_trips", 0))


class Simulation:
    """One configuration: ``mode`` is "index" (routers on a shared backend, instances heartbeat
    and publish), "embedded" (one router, in-process backend, seeds, no instance writes) or
    "rr" (round robin, no index)."""

    def __init__(
        self,
        cfg: SimConfig,
        mode: str,
        backend: str,
        n_routers: int,
        redis_url: str | None,
        log: reporting.Progress | None = None,
    ) -> None:
        self.cfg, self.mode, self.backend = cfg, mode, backend
        self.n_routers = n_routers
        self.redis_url = redis_url
        self.log = log or (lambda msg: None)
        self.fleet = Fleet(cfg)
        self.work = Workload(cfg)
        self.rng = random.Random(cfg.seed + 1)
        name = {"rr": "round robin", "embedded": "embedded, 1 router"}.get(
            mode, f"{backend}, {n_routers} router{'s' if n_routers > 1 else ''}"
        )
        self.stats = Stats(name, backend, n_routers)
        self.stats.n_p, self.stats.n_d = len(self.fleet.prefills), len(self.fleet.decodes)
        self.clock = 0
        self.kill_at: float | None = None
        self.killed: set[str] = set()
        self.seen_holds: set[str] = set()
        self.hold_serial = 0
        self.routers: list[Router] = []
        self.fleet_store: IndexStore | None = None
        self.rr = 0
        self._stop = False
        #: (turn at which it ends, the router's Instance): requests the router has in flight
        self.inflight: list[tuple[int, Instance]] = []
        #: the turn counts toward hit rates (the tail after the planned turns does not)
        self.counted = True
        #: session -> blocks of its system prompt (a turn whose history is only that is not
        #: counted in hit rates: every P holds the 16 shared prompts)
        self.system_len = {
            f"s{s}": len(self.work.system[s % SYSTEM_PROMPTS][0]) for s in range(cfg.sessions)
        }

    # --- set-up ----------------------------------------------------------------------------
    def open(self) -> IndexStore:
        if self.backend == "redis":
            assert self.redis_url
            return open_store(self.redis_url, hold_ttl_s=self.cfg.hold_ttl_s, cluster="sim")
        return MemoryIndexStore(self.cfg.hold_ttl_s, max_holds=max(100_000, 4 * self.cfg.sessions))

    async def setup(self) -> None:
        if self.mode == "rr":
            return
        shared: IndexStore | None = None
        if self.backend == "memory":
            shared = self.open()  # one in-process index every replica shares
            self.fleet_store = shared
        else:
            self.fleet_store = self.open()  # the instances' own client
            await self.fleet_store.ping()
        for _ in range(self.n_routers):
            store = shared if shared is not None else self.open()
            client = httpx.AsyncClient(transport=httpx.MockTransport(self.fleet.handler))
            if self.mode == "embedded":
                pool = Pool(
                    [i.url for i in self.fleet.prefills],
                    [i.url for i in self.fleet.decodes],
                    client=client,
                    store=store,
                    secret=SIM_SECRET,
                )
            else:
                pool = Pool([], [], client=client, store=store, secret=SIM_SECRET)
            flow = TurnFlow(pool, store, CollectorRegistry())
            self.routers.append(Router(pool, flow, store))
        if self.mode == "index":
            await asyncio.gather(*(self.heartbeat(i) for i in self.fleet.all))

    async def heartbeat(self, inst: SimInstance) -> None:
        assert self.fleet_store is not None
        await self.fleet_store.heartbeat(inst.record(self.clock), self.cfg.heartbeat_ttl_s)

    async def heartbeats(self) -> None:
        """Each instance every ``heartbeat_s``, staggered (independent processes)."""
        step = self.cfg.heartbeat_s / len(self.fleet.all)
        n = 0
        next_at = time.monotonic()
        while not self._stop:
            inst = self.fleet.all[n % len(self.fleet.all)]
            if inst.alive:
                await self.heartbeat(inst)
            n += 1
            next_at += step
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    async def close(self) -> None:
        seen: set[int] = set()
        for r in self.routers:
            await r.pool.client.aclose()
            if id(r.store) not in seen:
                seen.add(id(r.store))
                await r.store.close()
        if self.fleet_store is not None and id(self.fleet_store) not in seen:
            await self.fleet_store.close()

    # --- the kill --------------------------------------------------------------------------
    def kill(self) -> None:
        n_p = max(1, round(len(self.fleet.prefills) * self.cfg.kill_frac))
        n_d = max(1, round(len(self.fleet.decodes) * self.cfg.kill_frac))
        victims = self.rng.sample(self.fleet.prefills, n_p) + self.rng.sample(
            self.fleet.decodes, n_d
        )
        for v in victims:
            v.alive = False
            self.killed.add(v.url)
        self.kill_at = time.monotonic()
        self.log(f"  killed {n_p} P + {n_d} D")

    # --- one turn --------------------------------------------------------------------------
    async def turn(
        self,
        router: Router | None,
        key: Key,
        history: list[int],
        prompt: list[int],
        final_hexes: list[str],
        primary: bool,
    ) -> None:
        """One turn of ``key``: ``history`` known before it, ``prompt`` what P computes,
        ``final_hexes`` the chain D holds afterwards (prompt + answer)."""
        st = self.stats
        pull_ok = False
        oracle_pull = False
        decode_url = prefill_url = None
        turn_no = 0
        decode_inst: Instance | None = None
        if router is None:  # round robin: no index
            live_p = [i for i in self.fleet.prefills if i.alive]
            live_d = [i for i in self.fleet.decodes if i.alive]
            prefill_url = live_p[self.rr % len(live_p)].url
            decode_url = live_d[self.rr % len(live_d)].url
            self.rr += 1
        else:
            pool, flow = router.pool, router.flow
            probes, members_at = self.fleet.probes, pool._members_at
            t0 = time.perf_counter()
            start = await flow.begin(key)
            holding = start.hold
            decode, pull = await flow.choose_decode(key, start)  # the router's own choice
            hold_id = str(holding.params.get(SIM_HOLD_FIELD)) if holding is not None else None
            if pull is not None and hold_id is not None:  # the claim on D
                if not self.fleet.by_url[pull.decode_url].claim(hold_id):
                    pull = None
                    st.claims_refused += 1
            prefill = await pool.choose_prefill(key, start, pulled=pull is not None)
            if prefill is not None and decode is not None:
                flow.place_soon(key, start, prefill, decode)  # as _Turn.run: not awaited
            ms = (time.perf_counter() - t0) * 1000
            st.latencies_ms.append(ms)
            if self.fleet.probes == probes and pool._members_at == members_at:
                st.steady_ms.append(ms)
            if holding is not None and hold_id is not None:
                st.holds_taken += 1
                if hold_id in self.seen_holds:
                    st.taken_twice += 1
                self.seen_holds.add(hold_id)
                d = self.fleet.by_url.get(holding.decode_url)
                oracle_pull = d is not None and d.alive and (pull is not None or hold_id in d.holds)
            if prefill is None or decode is None:
                st.fallback_turns += 1
                return
            prefill_url, decode_url, decode_inst = prefill.url, decode.url, decode
            prefill.inflight += 1  # what the router's own count would say while they run
            decode.inflight += 1
            self.inflight += [
                (self.clock + P_BUSY_TURNS, prefill),
                (self.clock + D_BUSY_TURNS, decode),
            ]
            pull_ok = pull is not None
            turn_no = start.turn
            st.pulls += pull_ok
        # --- the simulated instances do the turn ---
        p_sim, d_sim = self.fleet.by_url[prefill_url], self.fleet.by_url[decode_url]
        if self.kill_at is not None:
            for url in (prefill_url, decode_url):
                if url in self.killed:
                    st.dead_after_kill.append(time.monotonic() - self.kill_at)
        if primary and len(history) > self.system_len.get(key[1], 0) and self.counted:
            st.history_blocks += len(history)
            # a killed P cannot serve the turn: its cache is worth nothing
            hit = len(history) if pull_ok else (p_sim.prefix(history) if p_sim.alive else 0)
            st.hit_blocks += hit
            best = len(history) if oracle_pull else hit
            if best < len(history):
                for p in self.fleet.prefills:
                    if p.alive:
                        best = max(best, p.prefix(history))
            st.oracle_blocks += best
        st.p_turns[prefill_url] = st.p_turns.get(prefill_url, 0) + 1
        st.d_turns[decode_url] = st.d_turns.get(decode_url, 0) + 1
        dev_s, dev_r, host_s, host_r = p_sim.compute(prompt)
        p_sim.busy_until.append(self.clock + P_BUSY_TURNS)
        d_sim.busy_until.append(self.clock + D_BUSY_TURNS)
        if self.mode == "index" and self.fleet_store is not None:
            gen = p_sim.generation
            await self.fleet_store.publish_blocks(p_sim.iid, gen, "device", dev_s, dev_r)
            if host_s or host_r:
                await self.fleet_store.publish_blocks(p_sim.iid, gen, "host", host_s, host_r)
        if router is not None and decode_inst is not None:  # D answered and holds the branch
            self.hold_serial += 1
            hold_id = f"h{self.hold_serial}"
            d_sim.keep_hold(hold_id, len(final_hexes))
            params = {
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_block_ids": list(range(len(final_hexes))),
                "remote_engine_id": d_sim.iid,
                "remote_host": "10.0.0.1",
                "remote_port": 5600,
                "remote_num_tokens": len(final_hexes) * self.cfg.block_size,
                "kvbranch_block_hashes": final_hexes,
                SIM_HOLD_FIELD: hold_id,
            }
            await router.flow.file_hold(key, decode_inst, turn_no, params)

    # --- the run ---------------------------------------------------------------------------
    async def run(self) -> Stats:
        cfg, st = self.cfg, self.stats
        await self.setup()
        rt0 = sum(round_trips(r.store) for r in self.routers) if self.backend == "redis" else 0
        frt0 = round_trips(self.fleet_store) if self.fleet_store is not None else 0
        cmds0 = await redis_commands(self.redis_url) if self.backend == "redis" else 0
        beats = asyncio.create_task(self.heartbeats()) if self.mode == "index" else None
        # Each router's background refresh (membership and probes off the turns' path), as
        # the router's lifespan runs it.
        fresh = [asyncio.create_task(r.pool.keep_fresh()) for r in self.routers]
        order = self.work.order()
        kill_turn = int(len(order) * cfg.kill_at)
        t_start = time.monotonic()
        k = 0
        while True:
            if k >= len(order):  # keep going until the kill is a heartbeat TTL old
                since = time.monotonic() - self.kill_at if self.kill_at is not None else None
                if self.mode == "rr" or since is None or since > cfg.heartbeat_ttl_s + cfg.tail_s:
                    break
                s = self.work.rng.randrange(cfg.sessions)
            else:
                s = order[k]
            if k == kill_turn and cfg.kill_frac > 0:
                self.kill()
            self.clock = k
            self.counted = k < len(order)
            if self.inflight:
                done = [x for x in self.inflight if x[0] <= k]
                for _, inst in done:
                    inst.inflight -= 1
                self.inflight = [x for x in self.inflight if x[0] > k]
            await self.one(s, k)
            k += 1
            if k % 2000 == 0:
                self.log(f"  {st.name}: {k} turns, {time.monotonic() - t_start:.1f} s")
            await asyncio.sleep(0)  # heartbeats run between turns
        st.wall_s = time.monotonic() - t_start
        st.turns = k
        self._stop = True
        for task in fresh:
            task.cancel()
        await asyncio.gather(*fresh, return_exceptions=True)
        if beats is not None:
            beats.cancel()
            try:
                await beats
            except asyncio.CancelledError:
                pass
        if self.backend == "redis":
            st.router_round_trips = sum(round_trips(r.store) for r in self.routers) - rt0
            st.fleet_round_trips = round_trips(self.fleet_store) - frt0  # type: ignore[arg-type]
            st.redis_commands = await redis_commands(self.redis_url) - cmds0 - 1
            st.redis = await redis_state(self.redis_url)
        await self.close()
        return st

    async def one(self, s: int, k: int) -> None:
        branches = self.work.sessions[s]
        branch = branches[self.work.rng.randrange(len(branches))]
        if self.work.rng.random() < self.cfg.fork_p:
            key = (branch.key[0], branch.key[1], f"b{len(branches)}")
            branch = Branch(key, list(branch.chain), list(branch.hexes))
            branches.append(branch)
        n_new = self.work.rng.randint(1, 3)
        salt = f"{branch.key[1]}/{branch.key[2]}"
        # the turn's new prompt blocks, then D's answer (one block)
        chain, hexes = self.work.extend(branch.chain, branch.hexes, salt, n_new + 1)
        history, prompt = branch.chain, chain[:-1]
        router = self.routers[k % len(self.routers)] if self.routers else None
        if router is not None and self.work.rng.random() < self.cfg.dup_p:
            other = self.routers[(k + 1) % len(self.routers)]
            self.stats.dups += 1
            await asyncio.gather(
                self.turn(router, branch.key, history, prompt, hexes, True),
                self.turn(other, branch.key, history, prompt, hexes, False),
            )
        else:
            await self.turn(router, branch.key, history, prompt, hexes, True)
        branch.chain, branch.hexes = chain, hexes


# --- Redis side ------------------------------------------------------------------------------
def _raw(url: str | None) -> Any:
    from redis.asyncio import Redis

    assert url
    return Redis.from_url(url)


async def redis_commands(url: str | None) -> int:
    """Commands Redis processed so far (every client: routers and instances)."""
    r = _raw(url)
    try:
        return int((await r.info("stats"))["total_commands_processed"])
    finally:
        await r.aclose()


async def redis_state(url: str | None, sample: int = 20_000) -> dict[str, Any]:
    """``used_memory``, ``DBSIZE``, and keys without a TTL among up to ``sample`` keys found by
    ``SCAN`` (the benchmark's own check: the backend never scans)."""
    r = _raw(url)
    try:
        mem = await r.info("memory")
        keys = int(await r.dbsize())
        scanned: list[bytes] = []
        async for name in r.scan_iter(count=1000):
            scanned.append(name)
            if len(scanned) >= sample:
                break
        no_ttl = 0
        for i in range(0, len(scanned), 1000):
            pipe = r.pipeline(transaction=False)
            for name in scanned[i : i + 1000]:
                pipe.pttl(name)
            no_ttl += sum(1 for t in await pipe.execute() if t == -1)
        return {
            "used_memory": int(mem["used_memory"]),
            "keys": keys,
            "sampled": len(scanned),
            "no_ttl": no_ttl,
        }
    finally:
        await r.aclose()


async def redis_flush(url: str) -> None:
    r = _raw(url)
    try:
        await r.flushall()
    finally:
        await r.aclose()


def redis_version() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        return "not installed"
    out = subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    return next((w[2:] for w in out.split() if w.startswith("v=")), out.strip())


# --- the whole run ---------------------------------------------------------------------------
def plan(cfg: SimConfig) -> list[tuple[str, str, int]]:
    """(mode, backend, routers) of each configuration, baselines first."""
    out = [("rr", "none", 0), ("embedded", "memory", 1)] if cfg.baselines else []
    for backend in cfg.backends:
        out += [("index", backend, n) for n in cfg.routers]
    return out


async def run_all(cfg: SimConfig, log: reporting.Progress | None = None) -> list[Stats]:
    log = log or (lambda msg: None)
    server = None
    url = cfg.redis_url
    if "redis" in cfg.backends and url is None:
        from tests.redis_server import RedisServer

        server = RedisServer().start()
        url = server.url
    out: list[Stats] = []
    try:
        for mode, backend, n in plan(cfg):
            if backend == "redis":
                assert url is not None
                await redis_flush(url)
            sim = Simulation(cfg, mode, backend, n, url if backend == "redis" else None, log)
            log(f"{sim.stats.name}: {cfg.total_turns} turns")
            stats = await sim.run()
            r = stats.row()
            log(
                f"  {stats.turns} turns in {stats.wall_s:.1f} s; hit {r['hit_rate']:.3f} "
                f"(oracle {r['oracle']:.3f}); p99 {r['p99_ms'] or 0:.2f} ms; "
                f"taken twice {stats.taken_twice}; dead decisions {r['dead_decisions']}"
            )
            out.append(stats)
    finally:
        if server is not None:
            server.close()
    return out


def _f(v: Any, digits: int = 2) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "–"
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return str(v)


def table(stats: list[Stats]) -> str:
    header = [
        "configuration", "turns", "decision p50 / p99 / max (ms)", "p99 without probe turns",
        "hit rate", "oracle", "hit / oracle", "pulls (claims refused)", "router round trips / turn",
        "instance round trips / turn", "Redis cmds / turn", "holds taken (twice)",
        "decisions to killed (last, s after kill)", "P / D max÷mean turns",
        "Redis used_memory, keys (no TTL / sampled)",
    ]  # fmt: skip
    rows = []
    for s in stats:
        r = s.row()
        lat = (
            f"{_f(r['p50_ms'], 3)} / {_f(r['p99_ms'], 3)} / {_f(r['max_ms'], 1)}"
            if s.latencies_ms
            else "–"
        )
        red = (
            f"{r['redis_used_memory'] / 2**20:.1f} MiB, {r['redis_keys']} "
            f"({r['redis_no_ttl']} / {r['redis_sampled']})"
            if s.redis
            else "–"
        )
        rows.append([
            s.name, s.turns, lat, _f(r["p99_steady_ms"], 3), _f(r["hit_rate"], 3),
            _f(r["oracle"], 3), _f(r["hit_rate"] / r["oracle"] if r["oracle"] else None, 3),
            f"{s.pulls} ({s.claims_refused})", _f(r["rt_per_turn"]) if s.redis else "–",
            _f(r["fleet_rt_per_turn"]) if s.redis else "–",
            _f(r["redis_cmds_per_turn"], 1) if s.redis else "–",
            f"{s.holds_taken} ({s.taken_twice})",
            f"{r['dead_decisions']} ({_f(r['last_dead_s'], 2)})",
            f"{_f(r['p_imbalance'])} / {_f(r['d_imbalance'])}", red,
        ])  # fmt: skip
    return reporting.md_table(header, rows)


class Target(NamedTuple):
    """One target: what it asks, met (None: not measured in this run), the numbers in words,
    and the one number it is decided on (for the run's record)."""

    what: str
    met: bool | None
    detail: str
    value: float
    metric: str
    unit: str


def targets(cfg: SimConfig, stats: list[Stats]) -> list[Target]:
    rr = next((s for s in stats if s.name == "round robin"), None)
    one = next((s for s in stats if s.name.startswith("embedded")), None)
    index_runs = [s for s in stats if s.name not in ("round robin",) and s.latencies_ms]
    cluster = [
        s for s in stats if s.backend in ("memory", "redis") and not s.name.startswith("emb")
    ]
    redis_runs = [s for s in stats if s.backend == "redis"]
    out: list[Target] = []
    if one is not None and rr is not None and cluster:
        worst = min(cluster, key=lambda s: s.hit_rate)
        ok = (
            worst.hit_rate >= TARGET_HIT_VS_ONE_ROUTER * one.hit_rate
            and worst.hit_rate >= TARGET_HIT_VS_RR * rr.hit_rate
        )
        out.append(Target(
            "cluster hit rate ≥ 90% of one router's and far above round robin (taken as ≥ "
            f"{TARGET_HIT_VS_RR:g}× its)", ok,
            f"lowest cluster {worst.hit_rate:.3f} ({worst.name}) vs one router "
            f"{one.hit_rate:.3f} ({worst.hit_rate / one.hit_rate:.0%}), round robin "
            f"{rr.hit_rate:.3f}", worst.hit_rate, "lowest cluster hit rate", "fraction",
        ))  # fmt: skip
    if index_runs:
        worst = max(index_runs, key=lambda s: reporting.percentile(s.latencies_ms, 99))
        p99 = reporting.percentile(worst.latencies_ms, 99)
        out.append(Target(
            f"decision p99 ≤ {TARGET_P99_MS:g} ms at {cfg.instances} × {cfg.sessions}",
            p99 <= TARGET_P99_MS,
            "worst " + ", ".join(
                f"{s.name} {reporting.percentile(s.latencies_ms, 99):.2f}" for s in index_runs
            ) + " ms", p99, "worst routing decision p99", "ms",
        ))  # fmt: skip
    if redis_runs:
        worst = max(redis_runs, key=lambda s: s.router_round_trips / max(s.turns, 1))
        rt = worst.router_round_trips / max(worst.turns, 1)
        out.append(Target(
            f"≤ {TARGET_ROUND_TRIPS:g} Redis round trips per turn (router side)",
            rt <= TARGET_ROUND_TRIPS, f"worst {rt:.2f} ({worst.name})", rt,
            "worst router round trips per turn", "round trips",
        ))  # fmt: skip
    twice = sum(s.taken_twice for s in stats)
    out.append(Target(
        "0 holds taken twice", twice == 0,
        f"{twice} of {sum(s.holds_taken for s in stats)} taken; "
        f"{sum(s.dups for s in stats)} duplicate concurrent turns", twice, "holds taken twice",
        "holds",
    ))  # fmt: skip
    late = [(s.name, max(s.dead_after_kill)) for s in stats if s.dead_after_kill]
    after_ttl = sum(1 for s in stats for a in s.dead_after_kill if a > cfg.heartbeat_ttl_s)
    out.append(Target(
        f"no decision aimed at a killed instance after the heartbeat TTL "
        f"({cfg.heartbeat_ttl_s:g} s)",
        after_ttl == 0,
        ("last ones " + ", ".join(f"{n} {a:.2f} s" for n, a in late) if late else "none at all")
        + f"; {after_ttl} after the TTL", after_ttl,
        "decisions to a killed instance after the heartbeat TTL", "decisions",
    ))  # fmt: skip
    if redis_runs:
        no_ttl = sum(s.redis.get("no_ttl", 0) for s in redis_runs)
        mem = max(s.redis.get("used_memory", 0) for s in redis_runs)
        out.append(Target(
            "bounded Redis memory: every key has a TTL", no_ttl == 0,
            f"max used_memory {mem / 2**20:.1f} MiB; {no_ttl} keys without TTL among "
            f"{sum(s.redis.get('sampled', 0) for s in redis_runs)} sampled", no_ttl,
            "Redis keys without a TTL (sampled)", "keys",
        ))  # fmt: skip
    return out


def sizes_md(cfg: SimConfig) -> str:
    return (
        f"- Sizes: {cfg.instances // 2} P + {cfg.instances - cfg.instances // 2} D, "
        f"{cfg.sessions} sessions, {cfg.total_turns} turns per configuration (then a tail of "
        f"turns, left out of hit rates, until the kill is a TTL old), P device cache "
        f"{cfg.cache_blocks} blocks + host {cfg.host_blocks}, "
        f"D holds up to {cfg.d_hold_blocks or cfg.cache_blocks + cfg.host_blocks} blocks, "
        f"{cfg.block_size} tokens a block; heartbeat "
        f"every {cfg.heartbeat_s:g} s (wall clock, staggered), TTL {cfg.heartbeat_ttl_s:g} s; "
        f"kill {cfg.kill_frac:.0%} of P and D at {cfg.kill_at:.0%} of the turns; forks "
        f"{cfg.fork_p:.0%}, duplicate concurrent turns {cfg.dup_p:.0%}; hold TTL "
        f"{cfg.hold_ttl_s:g} s; turns back to back (one at a time, duplicates two at once)"
    )


def report(cfg: SimConfig, stats: list[Stats], info: dict[str, str], elapsed: float,
           loads: list[float], title: str) -> str:  # fmt: skip
    lines = reporting.run_header(title, info, elapsed)
    lines.append(f"- redis-server {redis_version()} on a unix socket (tests/redis_server.py)")
    lines.append(reporting.load_md(loads))
    lines.append(sizes_md(cfg))
    lines.append("")
    lines.append(table(stats))
    lines.append("Targets:\n")
    for name, ok, detail, *_ in targets(cfg, stats):
        mark = "met" if ok else ("not met" if ok is False else "not measured")
        lines.append(f"- **{mark}** — {name}: {detail}")
    lines.append("")
    for s in stats:
        if s.dead_after_kill:
            lines.append(
                f"- {s.name}: decisions aimed at killed instances per second after the kill: "
                f"{per_second(s.dead_after_kill)}"
            )
    return "\n".join(lines) + "\n"


#: The options that set a :class:`SimConfig` field of the same name to a number, with the
#: field's default.
NUMBER_OPTIONS = (
    "instances",
    "sessions",
    "cache_blocks",
    "host_blocks",
    "d_hold_blocks",
    "heartbeat_s",
    "heartbeat_ttl_s",
    "seed",
)


def _names(text: str) -> tuple[str, ...]:
    """A comma-separated option's items (empty ones left out)."""
    return tuple(x for x in text.split(",") if x)


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in _names(text))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """Every option but ``--quick`` sets the :class:`SimConfig` field its dest names."""
    defaults = SimConfig()
    for name in NUMBER_OPTIONS:
        value = getattr(defaults, name)
        ap.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    ap.add_argument(
        "--turns", type=int, default=14_000, help="per configuration (0: 2 rounds of sessions)"
    )
    ap.add_argument("--routers", type=_ints, default=defaults.routers, help="e.g. 1,2,4")
    ap.add_argument("--backends", type=_names, default=defaults.backends, help="memory,redis")
    ap.add_argument("--redis-url", default=None, help="an existing Redis (it is FLUSHALLed)")
    ap.add_argument("--no-baselines", dest="baselines", action="store_false")
    ap.add_argument("--quick", action="store_true", help="about 30 s: 1000 sessions, short TTL")


def config_of(a: argparse.Namespace) -> SimConfig:
    names = {f.name for f in fields(SimConfig)}
    cfg = SimConfig(**{k: v for k, v in vars(a).items() if k in names})
    if a.quick:
        cfg.sessions, cfg.turns = min(cfg.sessions, 1000), 2000
        cfg.cache_blocks, cfg.host_blocks = 200, 400
        cfg.heartbeat_s, cfg.heartbeat_ttl_s = 0.5, 2.0
    return cfg


def records_of(cfg: SimConfig, stats: list[Stats]) -> list[Record]:
    """Decision p99 and hit rate per configuration, and one record per target."""
    out = [result(NAME, s.name, "hit rate", s.hit_rate, "fraction") for s in stats if s.turns]
    out += [
        result(NAME, s.name, "routing decision p99", reporting.percentile(s.latencies_ms, 99), "ms")
        for s in stats
        if s.latencies_ms
    ]
    out += [
        result(NAME, "all", t.metric, t.value, t.unit, target=t.what, met=t.met)
        for t in targets(cfg, stats)
    ]
    return out


def run(a: argparse.Namespace) -> list[Record]:
    cfg = config_of(a)
    progress = reporting.Progress()
    logging.getLogger("kvbranch.router").setLevel(logging.ERROR)  # 10% are killed on purpose
    progress(sizes_md(cfg)[2:])
    loads: list[float] = []

    async def go() -> list[Stats]:
        async def sample() -> None:
            while True:
                loads.append(os.getloadavg()[0])
                await asyncio.sleep(5)

        sampler = asyncio.create_task(sample())
        try:
            return await run_all(cfg, progress)
        finally:
            sampler.cancel()

    stats = asyncio.run(go())
    title = "index_sim (quick)" if a.quick else "index_sim"
    # after the runs: it imports vLLM in a subprocess, which would load the cores meanwhile
    info = reporting.machine_info()
    section = report(cfg, stats, info, progress.elapsed(), loads, title)
    reporting.write_json(reporting.raw_path("index_sim"), [s.row() for s in stats])
    reporting.publish(section, a.no_results)
    return records_of(cfg, stats)


if __name__ == "__main__":
    raise SystemExit(cli.run_study(sys.modules[__name__], sys.argv[1:]))
