"""A soak of a kvbranch cluster with faults and abuse (issue 37 item 8): minutes of legitimate
tenants beside hostile traffic while processes are SIGKILLed, then every answer replayed on plain
vLLM.

    with_server_slot .venv/bin/python -m benchmarks.history.soak --quick  # 2 min of traffic
    with_server_slot .venv/bin/python -m benchmarks.history.soak          # 5 min
    with_server_slot .venv/bin/python -m benchmarks.history.soak --prefills 2 --decodes 2 \
        --minutes 10
    .venv/bin/python -m benchmarks.history.soak --replicas 2 --quick  # aggregated replicas

The cluster is the launcher's cluster form, one process each, started here: a Redis (the index),
``--prefills`` P (core 0) and ``--decodes`` D (core 1) publishing into it, and two routers
that find them through it, all with three API keys — tenants A and B are legitimate, C is the
abusive one — and a small ``--router-tenant-inflight`` so that C's share is reachable.

With ``--replicas N`` (N >= 2) the cluster is the aggregated one instead, as ``python -m server
--cluster --replicas N`` starts it: N replicas (``--role single --index URL``, each prefilling and
decoding, on the cores :func:`server.router.cluster.replica_cores` gives them: one each where
there are enough) and the two routers in aggregated mode with the replicas as seeds. The routers'
policies are ``--router-policies`` (default ``cache-aware round-robin``): router0 is ours, which
keeps a session on the replica holding it, router1 a plain balancer that sends turns to the
replicas in turn, so that turns alternating the routers land on other replicas and pull their
history from a peer — the pulls the report counts from the replicas' ``/metrics``.

Traffic, through both routers, until ``--minutes`` have passed and every instance has been
faulted once:

* legitimate (A, B; ``--agents`` each): sessions created over the session routes, several
  turns alternating the routers, streaming and not, a fork per session with a turn on it, a
  tool-call request (a tool result in the history, ``strict`` tools), the session deleted;
  a request to a router that is down is retried once on the other one (a client with two
  endpoints);
* hostile (:mod:`benchmarks.history.soak_abuse`): rounds of malformed bodies and headers, floods of
  unauthenticated chats, a batch of idle sockets held open, C past its in-flight share; each
  round at one door in turn: the routers, and with ``--replicas`` also replica0's own HTTP port
  (behind a plain balancer a replica is a door too);
* a fault every ``--fault-every`` seconds, cycling router → Redis → D → P (with ``--replicas``:
  router → Redis → replica), each role's members in turn: SIGKILL, restart, and the next fault
  only once both routers list every instance alive again. The router fault kills router1 only:
  router0 runs the whole soak, so the report judges a router's growth (RSS over the run), which
  it cannot for a process that was restarted.

Then the cluster is stopped and plain vLLM (:mod:`tests.vanilla_vllm`: vLLM's own server, no
kvbranch code) is started on the same cores, and every served legitimate request's body is
replayed on it (greedy, same ``max_tokens``, non-streaming): the answers must be identical.

Report (:mod:`benchmarks.history.soak_report`): per tenant the requests served, 4xx and 5xx by
cause, failures during a fault of the only instance of a role apart; RSS of every process tree and
the Redis key count sampled every ``--sample-every`` seconds (with ``--replicas`` also each
replica's peer-pull counters, read again just before it is killed); every target met or not. Raw
data (bodies included): ``benchmarks/out/soak-<time>.json`` (not committed); the plot:
``benchmarks/plots/soak[_replicas][_quick].png``; records in benchmarks/results/ (unless
--no-results).
Everything it started is stopped on exit, Ctrl-C and errors included; all traffic goes to
127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import secrets
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import cli, common, reporting  # noqa: E402
from benchmarks.history import cluster, soak_abuse, soak_report  # noqa: E402
from benchmarks.history.soak_abuse import Outcome  # noqa: E402
from benchmarks.records import Record  # noqa: E402
from benchmarks.textgen import WORDS  # noqa: E402
from sdk.contract import (  # noqa: E402
    CHAT_COMPLETIONS_PATH,
    HEALTH_PATH,
    SESSIONS_PATH,
    branches_path,
    session_path,
)
from server.launcher.process import MODEL_NAME, ServerProcess  # noqa: E402
from server.router.cluster import replica_cores  # noqa: E402
from tests.conftest import VanillaVLLM  # noqa: E402
from tests.integration.cluster_fixture import restart, sigkill, tree_memory_mib  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

NAME = "soak"
DESCRIPTION = (
    "a soak of a kvbranch cluster: legitimate tenants beside hostile traffic while processes "
    "are SIGKILLed, answers replayed on plain vLLM"
)
FAULT_CYCLE = ("router", "redis", "decode", "prefill")
REPLICA_FAULT_CYCLE = ("router", "redis", "replica")
#: Roles faulted once, not once per member: routers are stateless (one killed is every one
#: killed), Redis is one process.
ONCE_ROLES = ("router", "redis")
#: The router no fault kills: the one whose growth over the whole soak the report judges.
KEPT_ROUTER = "router0"
ROUTER_POLICIES = ("cache-aware", "round-robin")
#: Hard bounds on every loop (the time bounds are the run's deadline).
MAX_SESSIONS_PER_AGENT = 500
MAX_ABUSE_ROUNDS = 500
MAX_FAULTS = 64
#: How long past ``--minutes`` the run may go to finish its fault cycle and recover.
GRACE_S = 1200.0
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
            "strict": True,  # explicit: kvbranch's default and plain vLLM's then agree
        },
    }
]


# --- the cluster ---------------------------------------------------------------------------------
class SoakCluster:
    """Redis, P's, D's (or aggregated replicas) and two routers, each its own process; names
    ``prefill0``, ``decode0``, ``replica0``, ``router0``, ``redis``."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.redis = RedisServer()
        self.keys = {t: f"tenant-{t.lower()}-{secrets.token_hex(8)}" for t in ("A", "B", "C")}
        key_flags = [a for k in self.keys.values() for a in ("--api-key", k)]
        # the benchmarks' cluster launch forms (their secret, core binding, sizes), with the keys
        self.procs: dict[str, ServerProcess] = {}
        seeds: list[str] = []
        if args.replicas:
            cores = replica_cores(len(os.sched_getaffinity(0)), args.replicas)
            for n, core in enumerate(cores):
                inst = cluster.replica(core, self.redis.url, args)
                inst.args += key_flags
                self.procs[f"replica{n}"] = inst
                seeds += ["--replica", inst.url]
        else:
            for role, count, core in (
                ("prefill", args.prefills, "0"),
                ("decode", args.decodes, "1"),
            ):
                for n in range(count):
                    inst = cluster.instance(role, core, self.redis.url, args)
                    inst.args += key_flags
                    self.procs[f"{role}{n}"] = inst
        for n in range(2):
            flags = [
                "--index",
                self.redis.url,
                "--router-tenant-inflight",
                str(args.tenant_inflight),
                *seeds,
            ]
            if args.router_policies:
                flags += ["--router-policy", args.router_policies[n]]
            self.procs[f"router{n}"] = cluster.router([*flags, *key_flags])
        for name, proc in self.procs.items():
            proc.name, proc.api_key = f"soak-{name}", self.keys["A"]
            proc.ready_timeout = max(proc.ready_timeout, 300)
        self.routers = [self.procs["router0"], self.procs["router1"]]
        #: the process being killed and restarted now (its exit is ours, not a crash)
        self.faulting: str | None = None
        #: processes that exited on their own: name → when the sampler first saw it
        self.died: dict[str, float] = {}
        self.instances = [p for n, p in self.procs.items() if not n.startswith("router")]
        self.replicas = {n: p for n, p in self.procs.items() if n.startswith("replica")}
        #: each replica's life: counted up at its kill, so a reading of its counters is summed
        #: per process (a restart starts them at zero again)
        self.lives = dict.fromkeys(self.replicas, 0)
        #: the replicas' peer-pull counters as read over the run (:func:`soak_report.pull_totals`)
        self.pull_readings: list[dict[str, Any]] = []
        self.t0 = time.monotonic()

    def of_role(self, role: str) -> list[str]:
        return ["redis"] if role == "redis" else [n for n in self.procs if n.startswith(role)]

    def members(self, cycle: tuple[str, ...]) -> dict[str, list[str]]:
        """Each faulted role's processes, in the order they are killed."""
        return {role: faulted_members(role, self.of_role(role)) for role in cycle}

    def doors(self) -> list[tuple[str, ServerProcess]]:
        """Where the hostile traffic knocks, a round at each in turn: the routers, and the first
        replica's own port (a replica behind a plain balancer is reachable as it is)."""
        doors = [(name, proc) for name, proc in self.procs.items() if name.startswith("router")]
        return doors + list(self.replicas.items())[:1]

    def start(self, log: reporting.Progress) -> None:
        self.redis.start()
        for inst in self.instances:
            inst.launch()
        for inst in self.instances:
            inst.wait_ready()
        log(f"{len(self.instances)} instances ready")
        for router in self.routers:
            router.launch()
        for router in self.routers:
            router.wait_ready()

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.terminate()
        for proc in self.procs.values():
            proc.stop()
        self.redis.close()

    def kill(self, name: str) -> None:
        self.faulting = name
        if name in self.replicas:
            self.read_pulls(name)  # what it counted since the last sample dies with it
            self.lives[name] += 1
        if name == "redis":
            self.redis.kill()
        else:
            sigkill(self.procs[name])

    def restart(self, name: str) -> None:
        if name == "redis":
            self.redis.start()
        else:
            restart(self.procs[name])
        self.faulting = None

    def headers(self, tenant: str = "A") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.keys[tenant]}"}

    async def whole(self, client: httpx.AsyncClient) -> bool:
        """Each router lists every instance alive and listed (what a turn needs)."""
        want = {i.url for i in self.instances}
        for router in self.routers:
            try:
                r = await client.get(router.url + HEALTH_PATH, headers=self.headers(), timeout=10)
                alive = {i["url"] for i in r.json()["instances"] if i["alive"] and i["listed"]}
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return False
            if not want <= alive:
                return False
        return True

    async def wait_whole(self, client: httpx.AsyncClient, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if await self.whole(client):
                return True
            if self.died:  # nothing restarts a crashed process: it will not be whole
                return False
            await asyncio.sleep(1.0)
        return False

    def _redis(self) -> Any:
        import redis

        return redis.Redis(unix_socket_path=str(self.redis.socket), socket_timeout=2)

    def read_pulls(self, name: str) -> None:
        """One reading of a replica's peer-pull counters (``/metrics``), kept with its life;
        none while it is down."""
        proc, life = self.replicas[name], self.lives[name]
        if proc.proc is None or proc.proc.poll() is not None:
            return
        try:
            r = httpx.get(proc.url + "/metrics", headers=self.headers(), timeout=10)
        except httpx.HTTPError:
            return
        if r.status_code == 200:
            counts = soak_report.peer_pull_counts(r.text)
            t = round(time.monotonic() - self.t0, 1)
            self.pull_readings.append({"t": t, "member": name, "life": life, "counts": counts})

    def sample(self, now: float) -> dict[str, Any]:
        """RSS (MiB) of every process tree (None while it is down) and Redis' key count; a
        process found exited that no fault killed is noted in :attr:`died` (a crash). The
        replicas' peer-pull counters are read too."""
        rss: dict[str, float | None] = {}
        for name in self.replicas:
            self.read_pulls(name)
        for name, proc in self.procs.items():
            if proc.proc is not None and proc.proc.poll() is not None:
                if name != self.faulting and name not in self.died:
                    self.died[name] = round(now, 1)
                rss[name] = None
                continue
            rss[name] = tree_memory_mib(proc)[0] if proc.proc is not None else None
        try:
            with self._redis() as r:
                keys: int | None = int(r.dbsize())
        except Exception:  # noqa: BLE001 - Redis down (a fault): no sample
            keys = None
        return {"rss": rss, "redis_keys": keys}

    def keys_without_ttl(self, limit: int = 200_000) -> tuple[int, int]:
        """(keys, keys without a TTL), scanning at most ``limit`` keys."""
        keys = no_ttl = 0
        with self._redis() as r:
            for key in r.scan_iter(count=1000):
                keys += 1
                no_ttl += r.ttl(key) == -1
                if keys >= limit:
                    break
        return keys, no_ttl


# --- legitimate tenants -------------------------------------------------------------------------
def normalized(message: dict[str, Any]) -> dict[str, Any]:
    """What is compared of an answer: the text and the tool calls (name, arguments; not ids)."""
    calls = [
        [c.get("function", {}).get("name"), c.get("function", {}).get("arguments")]
        for c in message.get("tool_calls") or []
    ]
    return {"content": message.get("content") or "", "tool_calls": calls}


def replay_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body plain vLLM gets: no kvbranch session fields, not streamed."""
    drop = {common.SESSION_FIELD, common.XARGS_FIELD, "stream", "stream_options"}
    return {k: v for k, v in body.items() if k not in drop}


class Soak:
    """One run's shared state: the cluster, its clock, what was recorded."""

    def __init__(self, cluster: SoakCluster, args: argparse.Namespace) -> None:
        self.cluster = cluster
        self.args = args
        self.t0 = time.monotonic()
        self.stop = asyncio.Event()
        self.events: list[dict[str, Any]] = []
        self.served: list[dict[str, Any]] = []
        self.faults: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []

    def now(self) -> float:
        return time.monotonic() - self.t0

    def record(self, out: Outcome, door: str | None = None) -> None:
        ev = out.to_dict()
        ev["t0"], ev["t1"] = round(out.t0 - self.t0, 3), round(out.t1 - self.t0, 3)
        if door is not None:
            ev["door"] = door
        self.events.append(ev)

    async def request(
        self,
        client: httpx.AsyncClient,
        tenant: str,
        router: int,
        kind: str,
        case: str,
        method: str,
        path: str,
        body: dict[str, Any] | None = None,
        stream: bool = False,
    ) -> tuple[int | None, dict[str, Any] | None]:
        """One legitimate request (retried once on the other router if this one is down):
        ``(status, answer)``; a served chat's body and answer are kept for the replay."""
        for _attempt in range(2):
            url = self.cluster.routers[router].url
            out = Outcome(tenant, kind, case, router, time.monotonic(), 0.0)
            answer = None
            try:
                if stream:
                    try:
                        res = await common.stream_request(
                            client, url + path, body or {}, timeout_s=300
                        )
                    except RuntimeError as exc:  # a non-200: "... -> HTTP 503: ..."
                        out.status = int(str(exc).split("HTTP ", 1)[1][:3])
                        out.extra["body"] = str(exc)[-200:]
                    else:
                        if res.prompt_tokens == 0:
                            out.error = "the stream ended without its usage chunk"
                        else:
                            out.status = 200
                            answer = {"content": res.content, "tool_calls": []}
                else:
                    r = await client.request(method, url + path, json=body, timeout=300)
                    out.status = r.status_code
                    if r.status_code >= 400:
                        out.extra["body"] = r.text[:200]
                    elif path == CHAT_COMPLETIONS_PATH:
                        answer = normalized(r.json()["choices"][0]["message"])
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                out.error = f"{type(exc).__name__}: {exc}"[:200]
            out.t1 = time.monotonic()
            self.record(out)
            if answer is not None and body is not None:
                self.served.append(
                    {
                        "tenant": tenant,
                        "kind": kind,
                        "t0": self.events[-1]["t0"],
                        "body": replay_body(body),
                        "answer": answer,
                        "plain": None,
                    }
                )
            if not (isinstance(out.error, str) and out.error.startswith("ConnectError")):
                return out.status, answer
            router = 1 - router  # this router is down: the client's other endpoint
        return None, None

    async def agent(self, tenant: str, n: int) -> None:
        """Sessions one after another: create, turns alternating routers (odd turns streamed),
        a fork after turn 2 with a turn on it, a tool-call request, delete."""
        args, rng = self.args, random.Random(f"{self.args.seed}-{tenant}-{n}")
        headers = self.cluster.headers(tenant)
        async with httpx.AsyncClient(headers=headers) as client:
            for s in range(MAX_SESSIONS_PER_AGENT):
                if self.stop.is_set():
                    return
                sid, router = f"soak-{tenant}{n}-{s}-{rng.randrange(16**6):06x}", (n + s) % 2
                await self.request(
                    client,
                    tenant,
                    router,
                    "session",
                    "create",
                    "POST",
                    SESSIONS_PATH,
                    {"session_id": sid},
                )
                notes = " ".join(rng.choice(WORDS) for _ in range(args.system_words))
                history = [{"role": "system", "content": f"You are a terse agent. Notes: {notes}"}]
                for turn in range(1, args.turns + 1):
                    if self.stop.is_set():
                        break
                    history.append(
                        {
                            "role": "user",
                            "content": f"Step {turn}: tool "
                            f"{rng.choice(WORDS)} returned {rng.randrange(10**5)}. Next?",
                        }
                    )
                    body = self.chat_body(history, sid)
                    status, answer = await self.request(
                        client,
                        tenant,
                        router,
                        "stream" if turn % 2 else "turn",
                        f"t{turn}",
                        "POST",
                        CHAT_COMPLETIONS_PATH,
                        body,
                        stream=bool(turn % 2),
                    )
                    router = 1 - router
                    if answer is None:
                        history.pop()
                        await asyncio.sleep(1.0)  # a failed turn: the client backs off
                        continue
                    history.append({"role": "assistant", "content": answer["content"]})
                    if turn == 2:
                        await self.fork(client, tenant, router, sid, history)
                await self.tool_request(client, tenant, 1 - router, sid, rng)
                await self.request(
                    client, tenant, router, "session", "delete", "DELETE", session_path(sid)
                )

    def chat_body(self, messages: list[dict], sid: str, branch: str | None = None) -> dict:
        return {
            "model": MODEL_NAME,
            "messages": list(messages),
            "temperature": 0.0,
            "max_tokens": self.args.max_tokens,
            **common.session_fields(sid, branch),
        }

    async def fork(
        self, client: httpx.AsyncClient, tenant: str, router: int, sid: str, history: list[dict]
    ) -> None:
        status, _ = await self.request(
            client,
            tenant,
            router,
            "session",
            "fork",
            "POST",
            branches_path(sid),
            {"parent": "main", "branch_id": "alt"},
        )
        if status is None or status >= 300:
            return
        messages = [*history, {"role": "user", "content": "Try another way instead."}]
        await self.request(
            client,
            tenant,
            1 - router,
            "fork",
            "alt",
            "POST",
            CHAT_COMPLETIONS_PATH,
            self.chat_body(messages, sid, "alt"),
        )

    async def tool_request(
        self, client: httpx.AsyncClient, tenant: str, router: int, sid: str, rng: random.Random
    ) -> None:
        city = rng.choice(["Paris", "Rome", "Oslo", "Lima"])
        messages = [
            {"role": "user", "content": f"What is the weather in {city}?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {
                            "name": "get_weather",
                            "arguments": json.dumps({"city": city}),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": f"{rng.randrange(30)} C"},
            {"role": "user", "content": "And in Madrid?"},
        ]
        body = {**self.chat_body(messages, f"{sid}-tool"), "tools": TOOLS, "max_tokens": 24}
        await self.request(
            client, tenant, router, "tool", "tool", "POST", CHAT_COMPLETIONS_PATH, body
        )

    # --- hostile traffic, faults, samples ------------------------------------------------------
    async def pause(self, seconds: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.stop.wait(), seconds)

    async def abuse(self) -> None:
        args, rng = self.args, random.Random(f"{self.args.seed}-abuse")
        key, idle = self.cluster.keys["C"], []
        doors = self.cluster.doors()
        async with httpx.AsyncClient() as client:
            for rounds in range(MAX_ABUSE_ROUNDS):
                if self.stop.is_set():
                    break
                r = rounds % len(doors)
                door, proc = doors[r]
                url = proc.url

                def record(out: Outcome, door: str = door) -> None:
                    self.record(out, door)

                for case in soak_abuse.abuse_cases(MODEL_NAME, rng):
                    await soak_abuse.send_case(client, url, r, case, key, record)
                await soak_abuse.flood(client, url, r, MODEL_NAME, args.flood, rng, record)
                if rounds % 2 == 0:
                    n = 3 * args.tenant_inflight
                    await soak_abuse.over_share(client, url, r, MODEL_NAME, key, n, record)
                if rounds % 4 == 1 and args.idle_sockets:
                    port = proc.port
                    idle.append(
                        asyncio.create_task(
                            soak_abuse.idle_sockets("127.0.0.1", port, args.idle_sockets, 20.0)
                        )
                    )
                await self.pause(args.abuse_every)
            held = await asyncio.gather(*idle)
        self.idle_held = list(held)

    async def fault_loop(self, client: httpx.AsyncClient, log: reporting.Progress) -> None:
        """A fault every ``fault_every`` s (SIGKILL, restart, wait until whole) until the traffic
        time is over and every instance was faulted once; then the traffic stops."""
        args = self.args
        traffic_end, hard_end = args.minutes * 60, args.minutes * 60 + GRACE_S
        cycle = fault_cycle(args.replicas)
        members = self.cluster.members(cycle)
        wanted = faults_to_cover(cycle, members)
        try:
            for i in range(MAX_FAULTS):
                await asyncio.sleep(max(0.0, (i + 1) * args.fault_every - self.now()))
                if self.now() >= hard_end or (self.now() >= traffic_end and i >= wanted):
                    break
                role, victim = fault_victim(i, cycle, members)
                victims = members[role]
                fault = {
                    "role": role,
                    "victim": victim,
                    "t_kill": round(self.now(), 3),
                    "t_back": None,
                    "only": len(victims) == 1,
                }
                self.faults.append(fault)
                await asyncio.to_thread(self.cluster.kill, victim)
                log(f"fault {i}: SIGKILL {victim}")
                try:
                    await asyncio.to_thread(self.cluster.restart, victim)
                except RuntimeError as exc:  # it did not start again: reported, faults end
                    fault["restart_error"] = str(exc).splitlines()[0]
                    log(f"fault {i}: {victim} did not start again: {fault['restart_error']}")
                    break
                if not await self.cluster.wait_whole(client, args.recovery_s):
                    log(f"the cluster did not recover from the kill of {victim}: no more faults")
                    break
                fault["t_back"] = round(self.now(), 3)
                log(
                    f"fault {i}: {victim} back, cluster whole after "
                    f"{fault['t_back'] - fault['t_kill']:.0f}s"
                )
            rest = traffic_end - self.now()
            if rest > 0:
                await asyncio.sleep(rest)
        finally:
            self.stop.set()

    async def sampler(self, done: asyncio.Event) -> None:
        while not done.is_set():
            sample = await asyncio.to_thread(self.cluster.sample, self.now())
            sample["t"] = round(self.now(), 1)
            self.samples.append(sample)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(done.wait(), self.args.sample_every)

    async def progress(self, log: reporting.Progress) -> None:
        while not self.stop.is_set():
            await self.pause(30)
            counts: dict[str, int] = {}
            for ev in self.events:
                counts[soak_report.outcome(ev)] = counts.get(soak_report.outcome(ev), 0) + 1
            log(f"t={self.now():.0f}s events {counts}, served {len(self.served)}")

    async def run(self, log: reporting.Progress) -> dict[str, Any]:
        done = asyncio.Event()
        async with httpx.AsyncClient() as client:
            if not await self.cluster.wait_whole(client, 120):
                raise RuntimeError("the routers never listed every instance alive")
            self.t0 = self.cluster.t0 = time.monotonic()
            sampler = asyncio.create_task(self.sampler(done))
            try:
                agents = [
                    self.agent(t, n) for t in soak_report.LEGIT for n in range(self.args.agents)
                ]
                await asyncio.gather(
                    self.fault_loop(client, log), self.abuse(), self.progress(log), *agents
                )
                traffic_s = self.now()
                whole = await self.cluster.wait_whole(client, self.args.recovery_s)
                for name in self.cluster.replicas:  # the last counts, once every turn ended
                    await asyncio.to_thread(self.cluster.read_pulls, name)
                keys, no_ttl = await asyncio.to_thread(self.cluster.keys_without_ttl)
            finally:
                done.set()
                await sampler
        return {
            "whole": whole,
            "died": dict(self.cluster.died),
            "keys": keys,
            "keys_without_ttl": no_ttl,
            "traffic_s": traffic_s,
            "idle_sockets_held": getattr(self, "idle_held", []),
        }


# --- the plain replay ----------------------------------------------------------------------------
async def replay(
    served: list[dict[str, Any]], args: argparse.Namespace, log: reporting.Progress
) -> None:
    """Every served legitimate body on plain vLLM, one at a time; ``plain`` filled in."""
    argv = ["--kv-cache-gib", "0.5", "--max-model-len", str(args.max_model_len), "--no-connector"]
    with VanillaVLLM(argv, name="soak-plain", ready_timeout=1200) as plain:
        log(f"plain vLLM ready; replaying {len(served)} answers")
        async with httpx.AsyncClient(timeout=300) as client:
            for rec in served:
                r = await client.post(plain.url + CHAT_COMPLETIONS_PATH, json=rec["body"])
                if r.status_code == 200:
                    rec["plain"] = normalized(r.json()["choices"][0]["message"])
                else:
                    rec["plain_error"] = f"{r.status_code}: {r.text[:200]}"


async def soak_run(args: argparse.Namespace) -> list[Record]:
    log = reporting.Progress()
    info = reporting.machine_info_async()
    cluster = SoakCluster(args)
    soak = Soak(cluster, args)
    try:
        cluster.start(log)
        log("cluster up; traffic begins")
        end = await soak.run(log)
    finally:
        log("stopping the cluster")
        cluster.stop()
    if not args.no_replay:
        await replay(soak.served, args, log)
    config = {
        "prefills": args.prefills,
        "decodes": args.decodes,
        "replicas": args.replicas,
        "router_policies": args.router_policies,
        "doors": [name for name, _ in cluster.doors()],
        "agents": args.agents,
        "tenant_inflight": args.tenant_inflight,
        "fault_every_s": args.fault_every,
        "fault_cycle": list(fault_cycle(args.replicas)),
        "traffic_s": end["traffic_s"],
        "turns": args.turns,
        "max_tokens": args.max_tokens,
        "idle_sockets": args.idle_sockets,
        "flood": args.flood,
    }
    record = {
        "config": config,
        "events": soak.events,
        "served": soak.served,
        "faults": soak.faults,
        "samples": soak.samples,
        "end": end,
    }
    if args.replicas:
        record["pulls"] = cluster.pull_readings
    reporting.write_json(reporting.raw_path("soak"), record)
    name = "soak" + ("_replicas" if args.replicas else "") + ("_quick" if args.quick else "")
    png = reporting.plot_path(f"{name}.png", args.no_results)
    soak_report.plot(record, png)
    rel = png.relative_to(reporting.ROOT)
    section = soak_report.section(record, info.result(), log.elapsed(), str(rel))
    reporting.publish(section, args.no_results)
    return soak_report.records_of(record, next(iter(reporting.plot_ref(png)), ""))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--minutes", type=float, default=5.0, help="traffic time (at least)")
    ap.add_argument("--quick", action="store_true", help="2 minutes, a fault every 20 s")
    ap.add_argument("--prefills", type=int, default=None, help="P instances (default 1)")
    ap.add_argument("--decodes", type=int, default=None, help="D instances (default 1)")
    ap.add_argument(
        "--replicas",
        type=int,
        default=None,
        metavar="N",
        help="N >= 2 aggregated replicas instead of P and D (the launcher's --cluster --replicas)",
    )
    ap.add_argument(
        "--router-policies",
        nargs=2,
        choices=ROUTER_POLICIES,
        default=None,
        metavar=("ROUTER0", "ROUTER1"),
        help="each router's --router-policy (default: cache-aware round-robin with --replicas, "
        "the routers' own default without)",
    )
    ap.add_argument("--agents", type=int, default=2, help="concurrent agents per legit tenant")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=12)
    ap.add_argument("--system-words", type=int, default=120)
    ap.add_argument("--tenant-inflight", type=int, default=3, help="--router-tenant-inflight")
    ap.add_argument("--fault-every", type=float, default=30.0)
    ap.add_argument("--recovery-s", type=float, default=900.0, help="wait for the cluster whole")
    ap.add_argument("--abuse-every", type=float, default=8.0)
    ap.add_argument("--flood", type=int, default=100, help="unauthenticated chats per round")
    ap.add_argument("--idle-sockets", type=int, default=600)
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--no-replay", action="store_true", help="skip the plain vLLM replay")
    common.add_server_args(ap, kv_cache_gib=0.25, max_model_len=2048, host_store_gib=0.1)
    common.add_run_args(ap, reserved_cpus=False)


def check_args(args: argparse.Namespace) -> None:
    """Refuse what the soak cannot run, each with what to give instead; fill in the topology's
    defaults (1 P and 1 D; with ``--replicas``, router policies :data:`ROUTER_POLICIES`)."""
    if args.agents > args.tenant_inflight:
        raise SystemExit("--tenant-inflight must exceed each legitimate tenant's agents per router")
    if args.replicas is None:
        args.prefills = 1 if args.prefills is None else args.prefills
        args.decodes = 1 if args.decodes is None else args.decodes
        if args.prefills < 1 or args.decodes < 1:
            raise SystemExit("--prefills and --decodes: at least 1 each")
        return
    if args.replicas < 2:
        raise SystemExit("--replicas N: N >= 2 (a turn pulls from another replica)")
    if args.prefills is not None or args.decodes is not None:
        raise SystemExit("--replicas replaces P and D: drop --prefills/--decodes")
    args.prefills = args.decodes = 0
    if args.router_policies is None:
        args.router_policies = list(ROUTER_POLICIES)


def fault_cycle(replicas: int | None) -> tuple[str, ...]:
    """The roles killed in turn: router → Redis → D → P, or router → Redis → replica."""
    return REPLICA_FAULT_CYCLE if replicas else FAULT_CYCLE


def faulted_members(role: str, names: list[str]) -> list[str]:
    """The processes of ``role`` a fault may kill: all but :data:`KEPT_ROUTER` (with the
    routers killed in turn, no router ran throughout and its growth went unjudged)."""
    return [n for n in names if n != KEPT_ROUTER] if role == "router" else names


def fault_victim(i: int, cycle: tuple[str, ...], members: dict[str, list[str]]) -> tuple[str, str]:
    """Fault ``i``'s role and process: the roles in ``cycle`` order, each role's members in
    turn from one cycle to the next."""
    role = cycle[i % len(cycle)]
    victims = members[role]
    return role, victims[(i // len(cycle)) % len(victims)]


def faults_to_cover(cycle: tuple[str, ...], members: dict[str, list[str]]) -> int:
    """How many faults kill every role once and every instance (P, D, replica) once: the soak
    goes on past ``--minutes`` until then (with 1 P and 1 D that is one cycle)."""
    wanted = len(cycle)
    for at, role in enumerate(cycle):
        if role not in ONCE_ROLES:
            wanted = max(wanted, at + (len(members[role]) - 1) * len(cycle) + 1)
    return wanted


def run(args: argparse.Namespace) -> list[Record]:
    if args.quick:
        args.minutes, args.fault_every, args.recovery_s = 2.0, 20.0, 300.0
    check_args(args)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in background
    signal.signal(signal.SIGTERM, _interrupt)  # stop everything on a plain kill too
    return asyncio.run(soak_run(args))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":
    raise SystemExit(cli.run_study(sys.modules[__name__], sys.argv[1:]))
