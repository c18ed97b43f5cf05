"""The aggregated replicas' cluster, shared by :mod:`~tests.integration.test_replicas` (each turn
sent straight to a replica, as a Kubernetes Service or round robin would send it),
:mod:`~tests.integration.test_replica_router` (turns through our router),
:mod:`~tests.integration.test_replica_revive` (pulls from a peer's host store after its hold) and
:mod:`~tests.integration.test_replicas_edge` (the router's attacker probes): a real Redis, two
replicas (``--role single --index redis://…``, each on its own core, NIXL over UCX on loopback)
and a router in front of them (``--replica`` seeds and the same index), with the helpers the
modules use (test_replicas_edge breaks nothing: its probes are all refused at the router).

One cluster for all three modules — the session fixture ``replica_cluster`` of
tests/integration/conftest.py, launched ahead of the first module that uses it and released
after the last one's last test (:mod:`tests.prestart`, ``ahead=True``): three engine starts
(two, and one restart after a kill) instead of two clusters' four, one Redis and one router
instead of two, and two engines alive instead of four. Why sharing holds, in either order of
the modules:

* **Whatever a test breaks is mended before the next test.** Each module's ``replicas``
  fixture calls :meth:`ReplicaCluster.whole` first: it restarts a replica a test stopped or
  SIGKILLed (a new instance id, a new NIXL port, its old HTTP port), starts Redis if a test
  left it down, and waits until the index lists both replicas' current instances and the
  router sees both alive. The tests that kill a replica (a holder killed mid-turn through the
  router, a peer SIGKILLed between turns) run last in their modules, so a run of both modules
  restarts one replica once, and a test that failed midway never fails the next one. (Ordering the
  breaking tests last across both modules would not spare the restart: each of them needs two
  live replicas and leaves one.) test_replicas_edge runs after both and starts the peer
  test_replicas' last test killed: a second restart in a run of all three (its docstring says
  why it runs last).
* **No test sees another's state.** Every session id is random, so no turn finds an earlier
  test's hold, home or history in the index; what earlier tests leave are holds on a replica's
  blocks, which end :data:`HOLD_TTL_S` after their turn, and the tests that need a replica's
  caches empty wait for them (:func:`~tests.integration.helpers.empty_caches`).
* **One configuration serves both.** Two API keys (the tenant checks need two tenants; the
  router and its tests use the first, :data:`KEY_A`), and 30 s holds: short, so that emptying
  a replica waits at most that long for earlier tests' holds; the router's tests read a hold
  within seconds of the turn that filed it (offered 25 s: the router's module passed with 30 s
  offers before the replicas' TTL became configurable).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from typing import NamedTuple

import httpx

from sdk.contract import HEALTH_PATH
from server.common.tenants import scope_of
from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
from server.index import Hold
from server.index.hold_cipher import HoldCipher
from server.index.redis_store import RedisKeys, decode_hold, digest, encode_hold
from server.launcher.process import free_port
from tests.integration.cluster_fixture import restart
from tests.integration.helpers import chat_body, client, size_args, stats, system_prompt
from tests.prestart import BIND_ENV
from tests.redis_server import RedisServer
from tests.server_process import ServerProcess

SECRET = secrets.token_hex(32)
#: How long a replica holds a finished turn's blocks for a pull (offered in the index 5 s
#: less): a test empties a replica by waiting for earlier tests' holds to end (a held turn's
#: blocks cannot be reset away).
HOLD_TTL_S = 30
#: Two tenants: every request names one; the first is the servers' own (``headers()``), which
#: the router and the helpers use.
KEY_A = "replica-tenant-a-" + secrets.token_hex(8)
KEY_B = "replica-tenant-b-" + secrets.token_hex(8)
TENANT_A = scope_of(f"Bearer {KEY_A}")
KEYS = ["--api-key", KEY_A, "--api-key", KEY_B]
#: Pulls loaded before the step's forward (the default ``--sync-pull-wait-s``): test_replicas
#: counts each pulled turn's synchronous read.
REPLICA_ARGS = [
    *size_args(0.25, 0.25, 4096),
    *("--pd-hold-ttl-s", str(HOLD_TTL_S)),
    *KEYS,
]
CLUSTER = "default"
MAX_TOKENS = 12
#: The router's answer header naming how it routed a turn.
ROUTE = "X-KVBranch-Route"

#: How far a logprob may move between two servers that split the same work differently (a
#: pull, a local hit, a recompute): float rounding; a wrongly loaded block moves it far more.
LOGPROB_TOL = 2e-3


class Tokens(list[tuple[str, float]]):
    """Greedy tokens with their logprobs: what every answer is compared by. Equal when the
    tokens are and every logprob is within :data:`LOGPROB_TOL` (rounded to 3 decimals
    instead, -1.5765 and -1.5764 compared unequal)."""

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, list)
            and len(self) == len(other)
            and all(
                mine == theirs and abs(lp - other_lp) <= LOGPROB_TOL
                for (mine, lp), (theirs, other_lp) in zip(self, other, strict=True)
            )
        )

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = None  # type: ignore[assignment]


class ReplicaCluster:
    """Redis, two replicas sharing it, the cluster secret and one PYTHONHASHSEED, and a router
    in front of them: one process for :mod:`tests.prestart` (two engines; the router has
    none)."""

    engines = 2  # what tests.prestart counts against the memory budget

    def __init__(self) -> None:
        self.redis = RedisServer()
        env = {ENV_CLUSTER_SECRET: SECRET, "PYTHONHASHSEED": "0"}
        cores = os.environ.get(BIND_ENV)
        self.replicas = [
            ServerProcess(
                [*REPLICA_ARGS, "--index", self.redis.url, "--cpu-cores", cores or core]
                + ["--nixl-port", str(free_port())],
                name=f"replica-{core}",
                ready_timeout=900,
                env=env,
            )
            for core in ("0", "1")
        ]
        seeds = [a for r in self.replicas for a in ("--replica", r.url)]
        self.router = ServerProcess(
            ["--role", "router", "--index", self.redis.url, *seeds]
            + ["--pd-hold-ttl-s", str(HOLD_TTL_S), *KEYS],
            name="replica-router",
            ready_timeout=120,
            env=env,
        )
        #: instance id -> replica, as their health reports them now (:meth:`whole` renews it)
        self.ids: dict[str, ServerProcess] = {}

    def launch(self) -> None:
        self.redis.start()
        for server in self.replicas:
            server.launch()

    def wait_ready(self) -> None:
        """The replicas ready, then the router (its health is 503 until a replica answers),
        then the cluster whole."""
        for server in self.replicas:
            server.wait_ready()
        self.router.launch()
        self.router.wait_ready()
        self.whole()

    def stop(self) -> None:
        self.router.stop()
        for server in self.replicas:
            server.stop()
        self.redis.close()

    # --- whole again after a test that broke it --------------------------------------------

    def whole(self, timeout_s: float = 90.0) -> None:
        """Redis up, both replicas running (one a test stopped or killed started again), the
        index listing both replicas' current instances and the router seeing both alive: what
        every test starts from, whatever the test before it broke."""
        if self.redis.proc is None or self.redis.proc.poll() is not None:
            self.redis.start()
        for server in self.replicas:
            if server.proc is None or server.proc.poll() is not None:
                server.stop()  # forget what is left of it
                restart(server)
        self.ids = {self.instance_id(server): server for server in self.replicas}
        wait_for("both replicas' instances listed in the index", self._listed, timeout_s)
        wait_for("the router seeing both replicas alive", self._routed, timeout_s)

    def instance_id(self, server: ServerProcess) -> str:
        r = httpx.get(server.url + HEALTH_PATH, headers=server.headers(), timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["instance_id"]

    def _listed(self) -> bool:
        """Each replica's heartbeat (a peer is pulled from only once listed)."""
        with self.redis_client() as r:
            return all(r.exists(RedisKeys(CLUSTER).instance(iid)) for iid in self.ids)

    def _routed(self) -> bool:
        """The router's health shows each replica alive, listed, as its current instance."""
        r = httpx.get(self.router.url + HEALTH_PATH, headers=self.router.headers(), timeout=10)
        if r.status_code != 200:
            return False
        seen = {(i["url"], i["instance_id"]) for i in r.json()["instances"] if i["alive"]}
        listed = {i["url"] for i in r.json()["instances"] if i["listed"]}
        return all((s.url, iid) in seen and s.url in listed for iid, s in self.ids.items())

    # --- the index, read and written as a router and a replica do ---------------------------

    def redis_client(self):
        import redis

        return redis.Redis(unix_socket_path=str(self.redis.socket), socket_timeout=5)

    def hold_key(self, session: str, tenant: str = TENANT_A) -> str:
        """The Redis key of the session's main branch's hold (docs/index_redis.md)."""
        return RedisKeys(CLUSTER).hold(digest(tenant, session), digest(tenant, session, "main"))

    def hold(self, session: str) -> Hold | None:
        """The branch's hold as its replica filed it, decrypted as a reader does; None when
        none is filed (or it does not decrypt)."""
        name = self.hold_key(session)
        with self.redis_client() as r:
            raw, ttl = r.get(name), r.pttl(name)
        if raw is None:
            return None
        return decode_hold(raw, ttl, HoldCipher(SECRET.encode()), name)

    def edit_hold(self, session: str, edit: Callable[[Hold], None]) -> None:
        """Decode the hold, let ``edit`` change it and write it back under a valid envelope
        with at least a minute left (what whoever writes Redis could do)."""
        name, cipher = self.hold_key(session), HoldCipher(SECRET.encode())
        with self.redis_client() as r:
            raw, ttl = r.get(name), r.pttl(name)
            assert raw is not None, f"no replica filed a hold for {session}"
            hold = decode_hold(raw, ttl, cipher, name)
            assert hold is not None, f"the hold of {session} does not decode"
            edit(hold)
            r.set(name, encode_hold(hold, cipher, name), px=max(ttl, 60_000))

    def holder(self, session: str) -> ServerProcess | None:
        """The replica the branch's hold names; None without a hold."""
        hold = self.hold(session)
        return self.ids.get(hold.instance_id or "") if hold is not None else None

    def wait_holder(self, session: str, timeout_s: float = 30.0) -> ServerProcess:
        """The replica holding the session once its hold is filed (the replica files it as its
        answer ends)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = self.holder(session)
            if found is not None:
                return found
            time.sleep(0.2)
        counts = {s.name: peer_counts(s) for s in self.replicas}
        raise AssertionError(f"no replica filed a hold for {session}; peer counts {counts}")

    def set_home(self, session: str, server: ServerProcess) -> None:
        """Record ``server`` as the session's home, as a router that last sent it there would."""
        iid = next(i for i, s in self.ids.items() if s is server)
        with self.redis_client() as r:
            r.hset(RedisKeys(CLUSTER).session(digest(TENANT_A, session)), "home", iid)


def wait_for(what: str, probe: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if probe():
                return
        except (httpx.HTTPError, OSError):
            pass
        time.sleep(0.5)
    raise AssertionError(f"{what}: not within {timeout_s}s")


# --- turns and answers ---------------------------------------------------------------------


class Turn(NamedTuple):
    tokens: Tokens
    #: kvbranch's split of the prompt (device, host, remote hit tokens)
    split: dict
    #: how the router routed it (None from a replica)
    route: str | None


def tokens_of(answer: dict) -> Tokens:
    """An answer's greedy tokens with their logprobs."""
    content = answer["choices"][0]["logprobs"]["content"]
    return Tokens((t["token"], t["logprob"]) for t in content)


def turn(
    server: ServerProcess,
    messages: list[dict],
    session: str,
    key: str = KEY_A,
    branch: str | None = None,
) -> Turn:
    """One greedy turn at ``server`` (a replica, or the router) as ``key``'s tenant."""
    body = chat_body(
        server, messages, session=session, branch=branch, max_tokens=MAX_TOKENS, logprobs=True
    )
    with client(server, headers={"Authorization": f"Bearer {key}"}) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert "kv_transfer_params" not in answer, "a replica's handle reached the client"
    return Turn(tokens_of(answer), answer.get("kvbranch") or {}, r.headers.get(ROUTE))


def plain(plain_server, messages: list[dict]) -> Tokens:
    """Plain vLLM's answer: the reference every turn is compared with."""
    body = chat_body(plain_server, messages, max_tokens=MAX_TOKENS, logprobs=True)
    r = httpx.post(f"{plain_server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return tokens_of(r.json())


def conversation(seed: int) -> list[dict]:
    """A first turn with a 400-word system prompt (~1,100 tokens: several blocks to pull)."""
    return [
        {"role": "system", "content": system_prompt(words=400, seed=seed)},
        {"role": "user", "content": "Which tool should run first? Answer briefly."},
    ]


def then(messages: list[dict], tokens: Tokens, user: str) -> list[dict]:
    """The next turn's messages: the answer ``tokens`` and a new user message."""
    reply = "".join(t for t, _ in tokens)
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": user}]


# --- what a replica counted ----------------------------------------------------------------


def remote_hits(server: ServerProcess) -> int:
    """Prompt tokens the replica has pulled from peers so far."""
    return int(stats(server)["hits_tokens"]["remote"])


def metric(server: ServerProcess, name: str, label: str, value: str) -> float | None:
    """One labelled counter of the replica's ``/metrics``; None while it has no such row."""
    with client(server) as c:
        text = c.get("/metrics").text
    line = f'{name}{{{label}="{value}"}}'
    for row in text.splitlines():
        if row.startswith(line):
            return float(row.split()[-1])
    return None


def peer_counts(server: ServerProcess) -> list[str]:
    """The replica's peer-pull counters (``/metrics``), for a failure's message."""
    try:
        with client(server) as http:
            text = http.get("/metrics").text
    except httpx.HTTPError as exc:
        return [f"unreachable: {exc}"]
    return [row for row in text.splitlines() if row.startswith("kvbranch_peer")]
