"""Our router in front of aggregated replicas, all real: a Redis, two replicas (``--role single
--index redis://…``, each on its own core, NIXL over UCX on loopback) and a router started with
``--replica`` seeds and the same index.

The router keeps a session on the replica whose hold the index names (the hold the replica
filed itself: the router only reads it), moves the session when that replica is overloaded — the
new replica pulls the history from the old one — or gone — the new one recomputes. Every answer
is compared with plain vLLM's, greedy, token for token with logprobs. The kill test runs last:
it stops a replica.
"""

from __future__ import annotations

import os
import secrets
import threading
import time

import httpx

from sdk.contract import HEALTH_PATH
from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
from server.index.hold_cipher import HoldCipher
from server.index.redis_store import RedisKeys, decode_hold, digest
from server.launcher.process import free_port
from server.router.replicas import LOAD_MARGIN
from tests import prestart
from tests.integration.cluster_fixture import TENANT
from tests.integration.helpers import chat_body, client, size_args, system_prompt
from tests.prestart import BIND_ENV
from tests.redis_server import RedisServer
from tests.server_process import ServerProcess

SECRET = secrets.token_hex(32)
HOLD_TTL_S = "120"
ARGS = [*size_args(0.25, 0.25, 4096), "--pd-hold-ttl-s", HOLD_TTL_S]
MAX_TOKENS = 12
ROUTE = "X-KVBranch-Route"


class ReplicaCluster:
    """Redis, two replicas sharing it and one cluster secret, and a router in front of them:
    one process for :mod:`tests.prestart` (launched ahead of the module, two engines)."""

    engines = 2  # what tests.prestart counts against the memory budget (the router has none)

    def __init__(self) -> None:
        self.redis = RedisServer()
        env = {ENV_CLUSTER_SECRET: SECRET, "PYTHONHASHSEED": "0"}
        cores = os.environ.get(BIND_ENV)
        self.replicas = [
            ServerProcess(
                [*ARGS, "--index", self.redis.url, "--cpu-cores", cores or core]
                + ["--nixl-port", str(free_port())],
                name=f"router-replica-{core}",
                ready_timeout=900,
                env=env,
            )
            for core in ("0", "1")
        ]
        seeds = [a for r in self.replicas for a in ("--replica", r.url)]
        self.router = ServerProcess(
            ["--role", "router", "--index", self.redis.url, *seeds, "--pd-hold-ttl-s", HOLD_TTL_S],
            name="replica-router",
            ready_timeout=120,
            env=env,
        )
        self.ids: dict[str, ServerProcess] = {}

    def launch(self) -> None:
        self.redis.start()
        for server in self.replicas:
            server.launch()

    def wait_ready(self) -> None:
        """The replicas ready, then the router (its health is 503 until a replica answers)."""
        for server in self.replicas:
            server.wait_ready()
        for server in self.replicas:
            self.ids[httpx.get(server.url + HEALTH_PATH, timeout=30).json()["instance_id"]] = server
        self.router.launch()
        self.router.wait_ready()

    def stop(self) -> None:
        self.router.stop()
        for server in self.replicas:
            server.stop()
        self.redis.stop()


replica_router = prestart.fixture(
    "replica_router", lambda: (ReplicaCluster(),), scope="module", engines=2
)


def _redis(c: ReplicaCluster):
    import redis

    return redis.Redis(unix_socket_path=str(c.redis.socket), socket_timeout=5)


def holder(c: ReplicaCluster, session: str) -> ServerProcess | None:
    """The replica the branch's hold names, as the replica filed it (decrypted as the router
    reads it)."""
    name = RedisKeys("default").hold(digest(TENANT, session), digest(TENANT, session, "main"))
    r = _redis(c)
    raw, ttl = r.get(name), r.pttl(name)
    if raw is None:
        return None
    hold = decode_hold(raw, ttl, HoldCipher(SECRET.encode()), name)
    return c.ids.get(hold.instance_id) if hold is not None else None


def wait_holder(c: ReplicaCluster, session: str, timeout_s: float = 30.0) -> ServerProcess:
    """The replica holding the session once its hold is filed (the replica files it as its
    answer ends)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = holder(c, session)
        if found is not None:
            return found
        time.sleep(0.2)
    counts = {s.name: peer_counts(s) for s in c.replicas}
    raise AssertionError(f"no replica filed a hold for {session}; replicas' peer counts {counts}")


def peer_counts(server: ServerProcess) -> list[str]:
    """The replica's peer-pull counters (``/metrics``), for a failure's message."""
    try:
        with client(server) as http:
            text = http.get("/metrics").text
    except httpx.HTTPError as exc:
        return [f"unreachable: {exc}"]
    return [row for row in text.splitlines() if row.startswith("kvbranch_peer")]


def set_home(c: ReplicaCluster, session: str, server: ServerProcess) -> None:
    iid = next(i for i, s in c.ids.items() if s is server)
    _redis(c).hset(RedisKeys("default").session(digest(TENANT, session)), "home", iid)


def turn(
    c: ReplicaCluster, messages: list[dict], session: str
) -> tuple[list[tuple[str, float]], str]:
    """(greedy tokens with logprobs, the route) of one turn through the router."""
    body = chat_body(c.router, messages, session=session, max_tokens=MAX_TOKENS, logprobs=True)
    with client(c.router) as http:
        r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    assert "kv_transfer_params" not in r.json()
    content = r.json()["choices"][0]["logprobs"]["content"]
    return [(t["token"], round(t["logprob"], 3)) for t in content], r.headers[ROUTE]


def plain(plain_server, messages: list[dict]) -> list[tuple[str, float]]:
    body = chat_body(plain_server, messages, max_tokens=MAX_TOKENS, logprobs=True)
    r = httpx.post(f"{plain_server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    content = r.json()["choices"][0]["logprobs"]["content"]
    return [(t["token"], round(t["logprob"], 3)) for t in content]


def remote_hits(server: ServerProcess) -> int:
    with client(server) as http:
        return int(http.get("/v1/kvbranch/stats").json()["hits_tokens"]["remote"])


def conversation(seed: int) -> list[dict]:
    return [
        {"role": "system", "content": system_prompt(words=400, seed=seed)},
        {"role": "user", "content": "Which tool should run first? Answer briefly."},
    ]


def then(messages: list[dict], tokens: list[tuple[str, float]], user: str) -> list[dict]:
    reply = "".join(t for t, _ in tokens)
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": user}]


def test_a_session_stays_on_the_replica_that_holds_it(replica_router, plain_server):
    session = "stay-" + secrets.token_hex(4)
    messages = conversation(seed=51)
    tokens, route = turn(replica_router, messages, session)
    first = wait_holder(replica_router, session)
    assert route == "replica" and tokens == plain(plain_server, messages)
    pulled = {s.url: remote_hits(s) for s in replica_router.replicas}
    for user in ("The tool returned 42 records. Next?", "Price 17. Summarize."):
        messages = then(messages, tokens, user)
        tokens, route = turn(replica_router, messages, session)
        assert route == "replica" and wait_holder(replica_router, session) is first
        assert tokens == plain(plain_server, messages)
    # It never left the replica that had its history: nothing was pulled anywhere.
    assert {s.url: remote_hits(s) for s in replica_router.replicas} == pulled


def test_the_hold_decides_over_a_stale_home(replica_router, plain_server):
    session = "home-" + secrets.token_hex(4)
    messages = conversation(seed=52)
    tokens, _ = turn(replica_router, messages, session)
    first = wait_holder(replica_router, session)
    other = next(s for s in replica_router.replicas if s is not first)
    set_home(replica_router, session, other)  # as if another router had last sent it there
    messages = then(messages, tokens, "Next?")
    tokens, route = turn(replica_router, messages, session)
    assert route == "replica" and wait_holder(replica_router, session) is first
    assert tokens == plain(plain_server, messages)


def _busy(c: ReplicaCluster, server: ServerProcess, n: int) -> list[threading.Thread]:
    """``n`` long streamed answers on ``server``, through the router (sessions whose home is
    ``server``), each started before this returns: the router counts them in flight there."""
    started = threading.Barrier(n + 1)
    threads = []
    for i in range(n):
        session = f"busy-{i}-" + secrets.token_hex(4)
        set_home(c, session, server)
        short = [{"role": "user", "content": f"Count from {i} to a thousand."}]  # quick prefill
        body = chat_body(c.router, short, session=session, max_tokens=400)
        body.update(stream=True, ignore_eos=True)

        def run(body: dict = body) -> None:
            with (
                client(c.router) as http,
                http.stream("POST", "/v1/chat/completions", json=body) as r,
            ):
                assert r.headers[ROUTE] == "replica"
                started.wait()
                for _ in r.iter_bytes():
                    pass

        threads.append(threading.Thread(target=run, daemon=True))
        threads[-1].start()
    started.wait(timeout=300)
    return threads


def test_an_overloaded_holder_hands_the_session_over_and_the_history_is_pulled(
    replica_router, plain_server
):
    session = "busy-holder-" + secrets.token_hex(4)
    messages = conversation(seed=53)
    tokens, _ = turn(replica_router, messages, session)
    first = wait_holder(replica_router, session)
    other = next(s for s in replica_router.replicas if s is not first)
    threads = _busy(replica_router, first, LOAD_MARGIN + 1)
    before = remote_hits(other)
    messages = then(messages, tokens, "The tool returned 42 records. Next?")
    tokens, route = turn(replica_router, messages, session)
    assert route == "replica-moved"
    assert wait_holder(replica_router, session) is other  # read first: holds expire
    assert remote_hits(other) - before >= 400  # a move costs a pull, not a recompute
    assert tokens == plain(plain_server, messages)
    for thread in threads:
        thread.join(timeout=600)


def test_a_dead_holder_moves_the_session(replica_router, plain_server):
    session = "dead-" + secrets.token_hex(4)
    messages = conversation(seed=54)
    tokens, _ = turn(replica_router, messages, session)
    first = wait_holder(replica_router, session)
    other = next(s for s in replica_router.replicas if s is not first)
    first.stop()
    messages = then(messages, tokens, "Next?")
    tokens, route = turn(replica_router, messages, session)
    assert route == "replica-moved"
    assert wait_holder(replica_router, session) is other
    assert tokens == plain(plain_server, messages)
