"""``--cluster``: a whole kvbranch cluster on one machine — a Redis for the cluster index, N
prefill and M decode instances (or N aggregated replicas), and K stateless routers that share
that index (docs/cluster.md).

``python -m server --cluster [--prefills 1] [--decodes 1] [--routers 2] [--index URL]``
``python -m server --cluster --replicas N [--routers 2] [--index URL]``

* **Redis**: without ``--index`` a private ``redis-server`` on a unix socket in the run
  directory (no TCP port, nothing persisted, memory capped with ``volatile-lru``: every index
  record has a TTL and the index may forget anything — it is advisory). With ``--index`` that
  index is used and no Redis is started.
* **Instances**: ``--role prefill|decode --index URL --nixl-port <free>`` on free ports, each with
  the user's own instance flags (model, ``--kv-cache-gib``, …: what :func:`instance_argv` passes
  for ``--disagg``) and everything after ``--``. On CPU the cores are split as ``--disagg``
  splits them: the prefill instances share the first half, the decode instances the second
  (:func:`share_cores`; with 2 cores every P computes on core 0 and every D on core 1).
* **Replicas** (``--replicas N``, instead of ``--prefills``/``--decodes``): N aggregated
  instances, ``--role single --index URL --nixl-port <free>``, each prefilling and decoding; a
  turn whose history another replica holds is pulled from it. On CPU they divide all the cores
  (:func:`replica_cores`: one each on 2 cores with 2 replicas, shared when they outnumber them).
* **Routers**: on ``--port``, ``--port + 1``, …, each with ``--index`` and the instances as seeds
  (``--prefill``/``--decode``, or ``--replica``: so they serve from the first request; an
  instance started elsewhere with the same ``--index`` joins through its heartbeat). Any of
  them serves any turn: holds, turn order, homes and placement live in the index, so a
  session's next turn can go to another router.

One cluster secret (``KVBRANCH_CLUSTER_SECRET``, made when unset) for every child, and the
launcher's own ``PYTHONHASHSEED`` (block hashes must agree across instances), or none, for all.
Each child's log is a file in the run directory, printed as it starts. SIGTERM or SIGINT stops
the cluster in order: routers first (they give in-flight requests ``--shutdown-grace-s``), then
the instances, then Redis; whatever is left after the teardown time is SIGKILLed. Children also
stop when the launcher dies (:mod:`server.launcher.process`).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from server.launcher.settings import LaunchError
from server.launcher.vllm_flags import data_parallel_size
from server.router.launch import (
    _CLUSTER_FLAGS,
    bind_listener,
    instance_argv,
    redact,
    select_flags,
    strip_flags,
)

#: Redis's memory cap for the one-machine index: holds are a few KB each, block entries tens of
#: bytes; volatile-lru evicts the least recently used record (all have TTLs) beyond it.
REDIS_MAXMEMORY = "256mb"
#: Flags that are the cluster's, not an instance's: never copied to a child as given (the
#: launcher sets --index itself; each instance advertises its own URL).
_LAUNCHER_FLAGS = {**_CLUSTER_FLAGS, "--index": 1, "--advertise-url": 1}
#: Flags a router child keeps from the user's (the rest describe an instance). Every flag whose
#: help says "router:" is here, except --prefill/--decode/--replica, which the launcher sets
#: itself (tests/unit/server/router/test_cluster_launch.py keeps that true).
_ROUTER_FLAGS = {
    "--host": 1,
    "--api-key": 1,
    "--log-level": 1,
    "--shutdown-grace-s": 1,
    "--pd-hold-ttl-s": 1,
    "--cluster-name": 1,
    "--router-tenant-inflight": 1,
    "--router-policy": 1,
    "--header-timeout-s": 1,
}
_REDIS_START_S = 10.0
#: A child spec's role for an aggregated replica (launched as ``--role single``; its routers
#: get it as ``--replica URL``).
REPLICA = "replica"


@dataclass
class ChildSpec:
    """One child ``python -m server``: its name, role, port and argv (without ``--port``,
    which :class:`server.launcher.process.ServerProcess` adds)."""

    name: str
    role: str
    port: int
    argv: list[str]
    cores: str | None = None
    nixl_port: int | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


#: The flags that size a prefill/decode cluster, which --replicas replaces.
_PD_COUNTS = ("--prefills", "--decodes")


def check_args(args: argparse.Namespace, given: Sequence[str] = ()) -> None:
    """Refuse what --cluster cannot honour, each with what to do instead (``given``: the
    user's own flags, to tell a count given from its default)."""
    if args.replicas is not None:
        named = [f for f in _PD_COUNTS if any(a.split("=", 1)[0] == f for a in given)]
        if named:
            raise LaunchError(
                f"--cluster --replicas starts aggregated replicas: drop {'/'.join(named)} "
                "(they size a prefill/decode cluster)"
            )
    if args.disagg:
        raise LaunchError("--cluster and --disagg are two different launches: give one of them")
    if args.role != "single":
        raise LaunchError(
            f"--cluster starts every role itself: drop --role {args.role} (to run one role "
            "on its own, use --role without --cluster)"
        )
    if args.prefill or args.decode or args.replica:
        raise LaunchError(
            "--cluster starts its own instances: drop --prefill/--decode/--replica (to add an "
            "instance started elsewhere, give it the same --index: it joins through its "
            "heartbeat)"
        )
    if args.advertise_url:
        raise LaunchError("--cluster: each instance advertises its own URL; drop --advertise-url")
    if args.port + args.routers - 1 > 65535:
        raise LaunchError(f"--port {args.port} --routers {args.routers}: ports past 65535")


def keep_flags(argv: list[str], flags: dict[str, int]) -> list[str]:
    """Only ``flags`` (with their values) from ``argv``, in order."""
    return select_flags(argv, flags, keep=True)


def _span(cores: list[int]) -> str:
    return str(cores[0]) if len(cores) == 1 else f"{cores[0]}-{cores[-1]}"


def _share(cores: list[int], count: int) -> list[str]:
    """``count`` instances on ``cores``: contiguous disjoint slices when there are enough (the
    first ones get one more when it does not divide), else instance i shares core i mod n."""
    if count <= len(cores):
        size, extra = divmod(len(cores), count)
        out, at = [], 0
        for i in range(count):
            take = size + (1 if i < extra else 0)
            out.append(_span(cores[at : at + take]))
            at += take
        return out
    return [str(cores[i % len(cores)]) for i in range(count)]


def share_cores(ncpu: int, prefills: int, decodes: int) -> list[str]:
    """``--cpu-cores`` for each instance, prefill instances first: as ``--disagg``'s
    ``split_cores``, P's get the first half of the cores and D's the rest, and instances of one
    role divide their half (sharing cores when they outnumber them). With 2 cores: every P on
    core 0, every D on core 1."""
    if ncpu < 2:
        raise LaunchError("--cluster needs at least 2 CPU cores (prefill and decode apart)")
    half = ncpu // 2
    return _share(list(range(half)), prefills) + _share(list(range(half, ncpu)), decodes)


def replica_cores(ncpu: int, replicas: int) -> list[str]:
    """``--cpu-cores`` for each replica: all the cores divided among them (contiguous slices,
    one core each where there are enough; shared round the cores when they outnumber them)."""
    return _share(list(range(ncpu)), replicas)


def plan_instances(
    args: argparse.Namespace,
    ours: list[str],
    passthrough: list[str],
    index_url: str,
    cores: list[str] | None,
    port_of=None,
) -> list[ChildSpec]:
    """Every instance's argv: the user's instance flags, then its role, the index and its own
    NIXL port (and cores on CPU), then what came after ``--``."""
    if port_of is None:
        from server.launcher.process import free_port

        port_of = free_port
    base = strip_flags(instance_argv(ours), _LAUNCHER_FLAGS)
    if args.replicas is not None:
        roles = [REPLICA] * args.replicas
    else:
        roles = ["prefill"] * args.prefills + ["decode"] * args.decodes
    specs: list[ChildSpec] = []
    counts = {"prefill": 0, "decode": 0, REPLICA: 0}
    # A replica's data-parallel engine i listens on its NIXL port + i.
    engines = data_parallel_size(passthrough) if args.replicas is not None else 1
    for i, role in enumerate(roles):
        counts[role] += 1
        port, nixl = port_of(), (port_of() if engines == 1 else port_of(engines))
        launched_as = "single" if role == REPLICA else role
        argv = [*base, "--role", launched_as, "--index", index_url, "--nixl-port", str(nixl)]
        core = cores[i] if cores else None
        if core is not None:
            argv += ["--cpu-cores", core]
        if passthrough:
            argv += ["--", *passthrough]
        specs.append(ChildSpec(f"{role}{counts[role]}", role, port, argv, core, nixl))
    return specs


def plan_routers(
    args: argparse.Namespace, ours: list[str], index_url: str, instances: list[ChildSpec]
) -> list[ChildSpec]:
    """Routers on --port, --port+1, ...: --role router, the index, and the instances as seeds
    (``--prefill``/``--decode`` URLs, or ``--replica`` URLs)."""
    base = keep_flags(ours, _ROUTER_FLAGS)
    seeds: list[str] = []
    for inst in instances:
        seeds += [f"--{inst.role}", inst.url]
    return [
        ChildSpec(
            f"router{i + 1}",
            "router",
            args.port + i,
            [*base, "--role", "router", "--index", index_url, *seeds],
        )
        for i in range(args.routers)
    ]


def find_redis() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        raise LaunchError(
            "--cluster needs redis-server for its index and it is not installed: "
            "scripts/setup.sh installs it, or pass --index redis://host:port/db"
        )
    return binary


def redis_argv(
    binary: str, sock: Path, folder: Path, maxmemory: str = REDIS_MAXMEMORY
) -> list[str]:
    """A ``redis-server`` on the unix socket ``sock`` only (``--port 0``: no TCP listener),
    nothing persisted, memory capped with the eviction policy the index is built for (every key
    has a TTL): the launcher's and the tests' Redis alike."""
    return [
        binary,
        "--port", "0",
        "--unixsocket", str(sock),
        "--unixsocketperm", "700",
        "--save", "",
        "--appendonly", "no",
        "--maxmemory", maxmemory,
        "--maxmemory-policy", "volatile-lru",
        "--dir", str(folder),
    ]  # fmt: skip


def redis_answers(sock: Path) -> bool:
    """PING over the socket, without a client library."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            s.connect(str(sock))
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def redis_started(
    proc: subprocess.Popen[bytes], sock: Path, timeout_s: float, poll_s: float = 0.05
) -> str | None:
    """Wait until the just-started ``proc`` answers PING on ``sock``: None once it does, else
    why not (it exited, or did not answer in ``timeout_s``); the caller stops it and raises
    its own error (the launcher's and the tests' Redis alike)."""
    deadline = time.monotonic() + timeout_s
    while not redis_answers(sock):
        if proc.poll() is not None:
            return f"redis-server exited ({proc.returncode})"
        if time.monotonic() > deadline:
            return f"redis-server did not answer in {timeout_s:g} s"
        time.sleep(poll_s)
    return None


def _redis_child() -> None:  # in the forked child, before exec: main thread only (see below)
    from server.launcher.process import set_parent_death_signal

    os.setsid()  # the terminal's ^C reaches the launcher only; it stops Redis last
    set_parent_death_signal(signal.SIGTERM)


class LocalRedis:
    """A private ``redis-server`` on ``<run_dir>/redis.sock``: no TCP listener, nothing saved."""

    def __init__(self, run_dir: Path, maxmemory: str = REDIS_MAXMEMORY) -> None:
        self.binary = find_redis()
        self.dir = run_dir
        self.socket = run_dir / "redis.sock"
        self.log_path = run_dir / "redis.log"
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def argv(self) -> list[str]:
        return redis_argv(self.binary, self.socket, self.dir, self.maxmemory)

    def start(self, timeout_s: float = _REDIS_START_S) -> LocalRedis:
        with self.log_path.open("ab") as log:
            # preexec_fn: the launcher forks it from its main thread, before any other starts.
            self.proc = subprocess.Popen(  # noqa: PLW1509
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=_redis_child,
            )
        why = redis_started(self.proc, self.socket, timeout_s)
        if why is not None:
            self.stop()
            raise LaunchError(f"{why}; log: {self.log_path}")
        return self

    def answers(self) -> bool:
        return redis_answers(self.socket)

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        self.proc = None
        self.socket.unlink(missing_ok=True)


@dataclass
class _Running:
    """What the launcher started, in start order (stopped in reverse: routers first)."""

    redis: LocalRedis | None = None
    instances: list = field(default_factory=list)
    routers: list = field(default_factory=list)
    reported: set = field(default_factory=set)


def _cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch means no CUDA either
        return False


def child_env(secret: str) -> dict[str, str]:
    """What every child is given: the cluster secret. ``PYTHONHASHSEED`` (block hashes must
    agree) is the launcher's own, inherited by all of them alike: set or unset — with vLLM's
    default SHA-256 block hash, unset means its fixed seed, as on an instance started
    elsewhere without it."""
    from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET

    return {ENV_CLUSTER_SECRET: secret}


def run_cluster(args: argparse.Namespace, ours: list[str], passthrough: list[str]) -> None:
    from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
    from server.launcher.phases import Phases
    from server.launcher.process import TEARDOWN_S, ServerProcess

    phases = Phases()
    check_args(args, ours)
    index_url = args.index if args.index != "memory" else None
    if index_url is None:
        find_redis()  # before anything starts: one line when it is missing
    cores = None
    if not _cuda():
        ncpu = len(os.sched_getaffinity(0))
        if args.replicas is not None:
            cores = replica_cores(ncpu, args.replicas)
        else:
            cores = share_cores(ncpu, args.prefills, args.decodes)
    # The routers' ports stay ours while the instances load (their NIXL/UCX transports open
    # listeners on ephemeral ports; see bind_listener); released just before the routers start.
    held = [bind_listener(args.host, args.port + i) for i in range(args.routers)]
    run_dir = Path(tempfile.mkdtemp(prefix="kvbranch-cluster-"))
    secret = os.environ.get(ENV_CLUSTER_SECRET) or secrets.token_hex(32)
    env = child_env(secret)
    running = _Running()
    # SIGTERM unwinds to the ``finally`` below as ^C does (the default action would not).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    phases.say(f"cluster: run directory {run_dir} (logs)")
    try:
        if index_url is None:
            running.redis = LocalRedis(run_dir).start()
            index_url = running.redis.url
            phases.say(f"redis ready at {index_url} (log: {running.redis.log_path})")
        else:
            phases.say(f"index {redact(index_url)}")
        for spec in plan_instances(args, ours, passthrough, index_url, cores):
            child = _child(ServerProcess, spec, run_dir, env, ready_timeout=900)
            running.instances.append(child)
            child.launch()
            cores_note = f" cores {spec.cores}" if spec.cores else ""
            phases.say(
                f"{spec.name} instance starting on {spec.url}{cores_note} "
                f"nixl port {spec.nixl_port} (log: {child.log_path})"
            )
        for child in running.instances:
            child.wait_ready()
            phases.say(f"{child.name} ready: {child.url}")
        specs = plan_routers(args, ours, index_url, _as_specs(running.instances))
        for sock in held:
            sock.close()
        held = []
        for spec in specs:
            child = _child(ServerProcess, spec, run_dir, env, ready_timeout=120)
            running.routers.append(child)
            child.launch()
            phases.say(f"{spec.name} starting on {spec.url} (log: {child.log_path})")
        for child in running.routers:
            child.wait_ready()
            phases.say(f"{child.name} ready: {child.url}")
        urls = " ".join(r.url for r in running.routers)
        phases.say(f"cluster ready: routers {urls}; SIGTERM or ^C stops it")
        _watch(running, phases)
    except RuntimeError as exc:
        if isinstance(exc, LaunchError):
            raise
        raise LaunchError(f"{str(exc).splitlines()[0]} (logs in {run_dir})") from None
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # a second ^C must not cut the teardown short
        for sock in held:
            sock.close()
        _teardown(running, args.shutdown_grace_s, TEARDOWN_S, phases)


def _child(cls, spec: ChildSpec, run_dir: Path, env: dict[str, str], ready_timeout: float):
    child = cls(spec.argv, name=spec.name, port=spec.port, ready_timeout=ready_timeout, env=env)
    child.log_path = run_dir / f"{spec.name}.log"
    child.role = spec.role
    return child


def _as_specs(children) -> list[ChildSpec]:
    return [ChildSpec(c.name, c.role, c.port, c.args) for c in children]


def _watch(running: _Running, phases, poll_s: float = 1.0) -> None:
    """Serve until stopped; say once when a child exits on its own (the rest keep serving: a
    router is stateless and an instance that leaves only moves its sessions)."""
    while True:
        for child in [*running.instances, *running.routers]:
            proc = child.proc
            if proc is not None and proc.poll() is not None and child.name not in running.reported:
                running.reported.add(child.name)
                phases.say(
                    f"{child.name} exited with {proc.returncode} (log: {child.log_path}); "
                    "the others keep serving"
                )
        redis = running.redis
        if (
            redis
            and redis.proc
            and redis.proc.poll() is not None
            and "redis" not in running.reported
        ):
            running.reported.add("redis")
            phases.say(
                f"redis exited with {redis.proc.returncode} (log: {redis.log_path}): routers "
                "serve on affinity alone until an index is back"
            )
        time.sleep(poll_s)


def _teardown(running: _Running, grace_s: float, teardown_s: float, phases) -> None:
    """Routers, then instances, then Redis: each group asked at once, then waited for, then
    SIGKILLed (the whole process group) past its time."""
    if running.routers:
        phases.say("stopping the routers")
        for child in running.routers:
            child.terminate()
        for child in running.routers:
            child.stop(timeout=grace_s + teardown_s)
    if running.instances:
        phases.say("stopping the instances")
        for child in running.instances:
            child.terminate()
        for child in running.instances:
            child.stop(timeout=teardown_s)
    if running.redis is not None:
        phases.say("stopping redis")
        running.redis.stop()
    phases.say("cluster stopped")
