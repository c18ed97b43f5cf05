"""The index-backed cluster of :mod:`tests.integration.test_cluster`: its own redis-server (so a
test may kill it without touching the session's ``redis_server``), two prefill and two decode
instances publishing into it (``--index``), and two routers that know no instance by URL: they
find all four through the index's heartbeats.

Sized to fit beside the session's other servers (plain, kvbranch, the keyed P/D pair) on a
2-core / 24 GB machine: 0.25 GiB device cache, 0.1 GiB host store, 2048 tokens; both P's bound
to core 0, both D's to core 1 (``--cpu-cores``, as :func:`~tests.integration.trust_cluster.
trust_instance` does). Every process shares one cluster secret (routers sign their legs and
claims with it; P and D seal and check handles with it) and one ``PYTHONHASHSEED``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import secrets
import signal
import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil

from sdk.contract import HEALTH_PATH
from server.common.tenants import scope_of
from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
from server.index import Hold, InstanceRecord
from server.index.hold_cipher import HoldCipher
from server.index.redis_store import RedisIndexStore, RedisKeys, decode_hold, digest, encode_hold
from server.launcher.process import free_port
from tests.integration.helpers import pd_instance, size_args
from tests.redis_server import RedisServer
from tests.server_process import ServerProcess

#: Longer than the module runs: a hold never expires under a test (expiry is not what it checks).
HOLD_TTL_S = "300"
INSTANCE_ARGS = [*size_args(0.25, 0.1, 2048), "--pd-hold-ttl-s", HOLD_TTL_S]
CLUSTER = "default"
#: The tenant of a request without an API key, as routers scope the index.
TENANT = scope_of(None)
#: The instances' heartbeat TTL (server.index.membership.DEFAULT_HEARTBEAT_TTL_S).
HEARTBEAT_TTL_S = 10.0


def _instance(role: str, n: int, core: str, index_url: str, env: dict[str, str]) -> ServerProcess:
    args = [*INSTANCE_ARGS, "--index", index_url]
    return pd_instance(args, role, core, name=f"cluster-{role}{n}", env=env)


def _router(n: int, index_url: str, env: dict[str, str]) -> ServerProcess:
    # Every turn through P (the tests check holds and pulls): a D holding a branch would serve a
    # turn alone whenever P happened to be busier (docs/pd.md, decode-local).
    policy = ["--router-policy", "always-split"]
    return ServerProcess(
        ["--role", "router", "--index", index_url, *policy, "--pd-hold-ttl-s", HOLD_TTL_S],
        name=f"cluster-router{n}",
        ready_timeout=180,
        env=env,
    )


def tree_memory_mib(server: ServerProcess) -> tuple[float, float]:
    """(RSS, PSS) summed over the server and every process under it (API server, engine core,
    worker, reaper), MiB. RSS counts the pages they share (torch, the model) once per process;
    PSS splits them, so it is what the machine really gives the instance."""
    assert server.proc is not None
    try:
        root = psutil.Process(server.proc.pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.Error:
        return 0.0, 0.0
    rss = pss = 0
    for proc in procs:
        try:
            rss += proc.memory_info().rss
            pss += getattr(proc.memory_full_info(), "pss", 0)
        except psutil.Error:
            pass
    return rss / (1 << 20), pss / (1 << 20)


def sigkill(server: ServerProcess) -> None:
    """SIGKILL to the server's whole process group (API server, engine core): a crash, no
    clean shutdown (no deregistration from the index)."""
    assert server.proc is not None
    try:
        os.killpg(os.getpgid(server.proc.pid), signal.SIGKILL)
    except ProcessLookupError:
        pass
    server.proc.wait(30)
    server.stop()  # forget it (nothing left to signal)


def restart(server: ServerProcess) -> float:
    """Start a killed instance again on its port (a new instance id) with a fresh NIXL port;
    seconds until it is ready."""
    args = list(server.args)
    if "--nixl-port" in args:
        args[args.index("--nixl-port") + 1] = str(free_port())
    server.args = args
    started = time.monotonic()
    server.start()
    return time.monotonic() - started


def wait_for(what: str, probe: Callable[[], Any], timeout_s: float, every_s: float = 0.5) -> Any:
    """Poll ``probe()`` until it returns something truthy (a hang guard, not a timing check)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        try:
            last = probe()
        except (httpx.HTTPError, ValueError) as exc:
            last = exc
        else:
            if last:
                return last
        time.sleep(every_s)
    raise AssertionError(f"{what}: not reached within {timeout_s}s (last: {last!r})")


class Cluster:
    """Redis, P0/P1 (core 0), D0/D1 (core 1), routers A and B — all real processes."""

    def __init__(self) -> None:
        self.redis = RedisServer()
        self.secret = secrets.token_hex(32)
        self.env = {ENV_CLUSTER_SECRET: self.secret, "PYTHONHASHSEED": "0"}
        url = self.redis.url
        self.prefills = [_instance("prefill", n, "0", url, self.env) for n in range(2)]
        self.decodes = [_instance("decode", n, "1", url, self.env) for n in range(2)]
        self.routers = [_router(n, url, self.env) for n in range(2)]
        #: name → seconds from launch until ready (all four launched at once)
        self.startup_s: dict[str, float] = {}
        #: name → (RSS, PSS) in MiB once the cluster is up
        self.memory_mib: dict[str, tuple[float, float]] = {}

    @property
    def instances(self) -> list[ServerProcess]:
        return [*self.prefills, *self.decodes]

    @property
    def engines(self) -> int:
        """vLLM engines it runs (tests.prestart's memory budget counts them)."""
        return len(self.instances)

    @property
    def a(self) -> ServerProcess:
        return self.routers[0]

    @property
    def b(self) -> ServerProcess:
        return self.routers[1]

    def launch(self) -> None:
        """Redis, then every instance at once; each one's readiness is awaited in its own
        thread from now on (so each start-up time is its own, whatever the caller does
        meanwhile: the plain reference starts beside them). :meth:`wait_ready` collects."""
        self.redis.start()
        launched = time.monotonic()
        for inst in self.instances:
            inst.launch()

        def ready(inst: ServerProcess) -> float:
            inst.wait_ready()
            return time.monotonic() - launched

        self._waiters = concurrent.futures.ThreadPoolExecutor(len(self.instances))
        self._ready = [self._waiters.submit(ready, inst) for inst in self.instances]

    def wait_ready(self, members_timeout_s: float = 60.0) -> None:
        """Each instance ready, then both routers, then until each router's health lists all
        four instances alive."""
        try:
            for inst, future in zip(self.instances, self._ready, strict=True):
                self.startup_s[inst.name] = future.result()
        finally:
            self._waiters.shutdown(wait=True)
        started = time.monotonic()
        for router in self.routers:
            router.launch()
        for router in self.routers:
            router.wait_ready()
        self.startup_s["routers"] = time.monotonic() - started
        self.wait_whole(members_timeout_s)
        for proc in [*self.instances, *self.routers]:
            self.memory_mib[proc.name] = tree_memory_mib(proc)

    def wait_whole(self, timeout_s: float = 60.0) -> None:
        """Until each router's health lists all four instances alive. The fault tests start
        with it: each leaves the cluster whole, and one that failed midway must not fail the
        next one too."""
        for router in self.routers:
            wait_for(
                f"{router.name} lists all four instances alive and listed",
                lambda r=router: self.alive_urls(r) >= {i.url for i in self.instances},
                timeout_s,
            )

    def stop(self) -> None:
        for proc in [*self.routers, *self.instances]:
            proc.terminate()
        for proc in [*self.routers, *self.instances]:
            proc.stop()
        self.redis.close()

    # --- views ---------------------------------------------------------------------------

    def health(self, router: ServerProcess) -> dict:
        r = httpx.get(router.url + HEALTH_PATH, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()

    def alive_urls(self, router: ServerProcess) -> set[str]:
        """The instances ``router`` would send a turn to: alive and listed by the index."""
        return {i["url"] for i in self.health(router)["instances"] if i["alive"] and i["listed"]}

    def instance_id(self, inst: ServerProcess) -> str:
        r = httpx.get(inst.url + HEALTH_PATH, timeout=10)
        assert r.status_code == 200, r.text
        return r.json()["instance_id"]

    def by_url(self, url: str) -> ServerProcess:
        return next(i for i in self.instances if i.url == url.rstrip("/"))

    # --- the index, read and written as a router does --------------------------------------

    def _store(self) -> RedisIndexStore:
        # the cluster's own secret: holds are sealed with it (server/index/hold_cipher.py)
        return RedisIndexStore.from_url(
            self.redis.url,
            hold_ttl_s=float(HOLD_TTL_S),
            cluster=CLUSTER,
            secret=self.secret.encode(),
        )

    def _run(self, fn: Callable[[RedisIndexStore], Any]) -> Any:
        async def go() -> Any:
            store = self._store()
            try:
                return await fn(store)
            finally:
                await store.close()

        return asyncio.run(go())

    def peek_hold(self, session: str, branch: str = "main") -> Hold | None:
        return self._run(lambda s: s.peek_hold((TENANT, session, branch)))

    def session_instances(self, session: str) -> set[str]:
        return self._run(lambda s: s.session_instances(TENANT, session))

    def members(self) -> list[InstanceRecord]:
        return self._run(lambda s: s.members())

    def hold_key(self, session: str, branch: str = "main") -> str:
        """The Redis key of a branch's hold (docs/index_redis.md)."""
        keys = RedisKeys(CLUSTER)
        return keys.hold(digest(TENANT, session), digest(TENANT, session, branch))

    def redis_client(self):
        import redis

        return redis.Redis(unix_socket_path=str(self.redis.socket), socket_timeout=5)

    def raw_hold(self, session: str, branch: str = "main") -> tuple[bytes, int]:
        """The hold's raw value and its TTL (ms)."""
        with self.redis_client() as r:
            key = self.hold_key(session, branch)
            raw, ttl = r.get(key), r.pttl(key)
        assert raw is not None, f"no hold filed for {session}/{branch}"
        return raw, ttl

    def overwrite_hold(self, session: str, value: bytes, branch: str = "main") -> None:
        """Replace the hold's value, keeping its TTL (a tampered Redis)."""
        _, ttl = self.raw_hold(session, branch)
        with self.redis_client() as r:
            r.set(self.hold_key(session, branch), value, px=max(ttl, 60_000))

    def edit_hold(self, session: str, edit: Callable[[Hold], None], branch: str = "main") -> None:
        """Decode the hold, let ``edit`` change it, encode it back (well-formed, so the index
        offers it: only the instances' own checks can refuse it)."""
        raw, ttl = self.raw_hold(session, branch)
        cipher, key = HoldCipher(self.secret.encode()), self.hold_key(session, branch)
        hold = decode_hold(raw, ttl, cipher, key)
        assert hold is not None
        edit(hold)
        self.overwrite_hold(session, encode_hold(hold, cipher, key), branch)
