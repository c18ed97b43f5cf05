"""Start and stop a real ``python -m server`` as a child process: used by the demo, the tests,
the benchmarks and ``--disagg`` (they all need the same readiness wait and whole-process-group
teardown) — and make sure nothing it starts outlives it.

Lifetime rules: a child started by :class:`ServerProcess` stops when its launcher
dies, even by SIGKILL (:func:`die_with_launcher`: the kernel's parent-death signal where the
launching thread is the main one, and a watchdog thread polling the parent pid everywhere); and
an instance's own children (vLLM's engine core) stop when the instance dies
(:func:`start_reaper`), since vLLM 0.32's engine core does not watch its parent.
"""

from __future__ import annotations

import ctypes
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import ClassVar

ROOT = Path(__file__).resolve().parents[2]
MODEL_NAME = "SmolLM2-135M-Instruct"
#: Set by :class:`ServerProcess` for its child: the launcher's pid, which the child watches.
ENV_PARENT_PID = "KVBRANCH_PARENT_PID"
#: Set with it when the launching thread is the main thread: the parent-death signal is safe
#: (Linux sends it when the *thread* that forked the child exits, not only the process).
ENV_PARENT_DEATHSIG = "KVBRANCH_PARENT_DEATHSIG"
#: Default seconds in-flight requests get after SIGTERM before everything stops.
DEFAULT_SHUTDOWN_GRACE_S = 5.0
#: After the grace: what vLLM's own teardown (engine core, NIXL) may take before SIGKILL.
TEARDOWN_S = 10.0
_PR_SET_PDEATHSIG = 1
_POLL_S = 0.5
#: A raised exception's line in a log: ``AssertionError: ...`` at the line's start or after a
#: log record's prefix (``... [core.py:1510] AssertionError: ...``), its module named or not
#: (``nixl._bindings.nixlBackendError: ...``); not an exception's name quoted in a message.
_RAISED = re.compile(r"(?:^|\] )(?:\w+\.)*[A-Za-z_]\w*(?:Error|Exception): ")


def set_parent_death_signal(sig: int = signal.SIGTERM) -> bool:
    """Linux: have the kernel send ``sig`` to this process when its parent dies (prctl
    PR_SET_PDEATHSIG, through ctypes). False where unsupported (then only polling works)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def die_with_launcher(grace_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> None:
    """Called first thing by ``python -m server`` (any role): when started by a
    :class:`ServerProcess` (``KVBRANCH_PARENT_PID`` set), stop when that launcher dies — SIGTERM
    to ourselves (the normal graceful path), then SIGKILL after ``grace_s`` plus teardown time.

    A server started by hand (no variable) keeps running when its shell goes away (nohup)."""
    parent_text = os.environ.pop(ENV_PARENT_PID, None)  # not for our own children
    deathsig = os.environ.pop(ENV_PARENT_DEATHSIG, None) == "1"
    if not parent_text:
        return
    try:
        parent = int(parent_text)
    except ValueError:
        return
    direct = os.getppid() == parent  # else a wrapper process sits between us
    if direct and deathsig:
        set_parent_death_signal(signal.SIGTERM)
        direct = os.getppid() == parent  # it may have died before the prctl took effect
    if not direct and not _alive(parent):
        print("[kvbranch] launcher already gone; not starting", file=sys.stderr, flush=True)
        os._exit(1)

    def launcher_alive() -> bool:
        return os.getppid() == parent if direct else _alive(parent)

    def watch() -> None:
        while launcher_alive():
            time.sleep(_POLL_S)
        print(f"[kvbranch] launcher (pid {parent}) gone: stopping", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s + TEARDOWN_S)
        os.kill(os.getpid(), signal.SIGKILL)  # the reaper stops what we leave behind

    threading.Thread(target=watch, name="kvbranch-launcher-watch", daemon=True).start()


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a dead launcher waiting to be reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not os.path.isdir("/proc")  # /proc readable but no entry: gone


def start_reaper(grace_s: float = DEFAULT_SHUTDOWN_GRACE_S) -> subprocess.Popen | None:
    """Start a small process that outlives this one only to stop its descendants (vLLM's engine
    core and anything else it spawned) when this process dies — even by SIGKILL, when no
    cleanup of ours runs. Linux only (it reads the process tree through psutil)."""
    if not sys.platform.startswith("linux"):
        return None
    code = (
        "import sys; from server.launcher.process import reap; "
        "reap(int(sys.argv[1]), float(sys.argv[2]))"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code, str(os.getpid()), str(grace_s)],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
    )


def reap(parent: int, grace_s: float) -> None:
    """The reaper's loop (see :func:`start_reaper`): remember ``parent``'s descendants while it
    lives; once it is gone, SIGTERM those still running, SIGKILL them after ``grace_s``."""
    import psutil

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # a group-wide ^C must not stop us before our job
    me = os.getpid()
    known: dict[int, psutil.Process] = {}
    try:
        root = psutil.Process(parent)
    except psutil.Error:
        return
    while os.getppid() == parent:
        try:
            for child in root.children(recursive=True):
                if child.pid != me:
                    known.setdefault(child.pid, child)
        except psutil.Error:
            pass
        known = {pid: p for pid, p in known.items() if p.is_running()}
        time.sleep(_POLL_S)
    alive = [p for p in known.values() if p.is_running()]
    for proc in alive:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(alive, timeout=grace_s)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


#: Ports this process handed out already (a port is free until its server binds it, which
#: may be minutes later: never hand it out twice).
_handed_out: set[int] = set()


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ephemeral ports (what ``bind(0)`` and outgoing connections get)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port(span: int = 1) -> int:
    """A free TCP port outside the kernel's ephemeral range (with ``span``: the first of that
    many consecutive free ports, as a data-parallel instance's NIXL side channels need).

    The server that will listen on it binds it only after loading (a minute or more for an
    instance). A port from the ephemeral range could meanwhile be taken by any socket in the
    meantime — another instance's NIXL/UCX or ZMQ listener, an outgoing connection: seen as
    "Address already in use" in an instance's NIXL handshake listener when four instances
    started at once. Ports below (or above) that range are only ever bound on purpose."""
    low, high = _ephemeral_range()
    candidates = list(range(max(1024, low - 12000), low)) or list(range(high + 1, 65536))
    rng = random.Random()
    for _ in range(200):
        port = rng.choice(candidates)
        ports = range(port, port + span)
        if port + span > 65536 or any(p in _handed_out for p in ports) or not _bindable(ports):
            continue
        _handed_out.update(ports)
        return port
    if span > 1:
        raise OSError(f"no {span} consecutive free ports")
    with socket.socket() as sock:  # a crowded range: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _bindable(ports: range) -> bool:
    for port in ports:
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


class ServerProcess:
    """``with ServerProcess([...]) as server: server.url`` — waits for readiness (timeout),
    and on exit stops the whole process group (API server, engine core, workers)."""

    #: Servers launched and not yet stopped (the test suite attaches their log tails to a
    #: failure: a CI run leaves nothing else behind).
    running: ClassVar[weakref.WeakSet[ServerProcess]] = weakref.WeakSet()

    def __init__(
        self,
        args: list[str],
        *,
        name: str = "server",
        port: int | None = None,
        ready_timeout: float = 600.0,
        env: dict[str, str] | None = None,
    ) -> None:
        self.args = args
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout = ready_timeout
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.gettempdir()) / f"kvbranch-test-{name}-{self.port}.log"
        self.model = MODEL_NAME
        self.api_key: str | None = None
        if "--api-key" in args:
            self.api_key = args[args.index("--api-key") + 1]

    def start(self) -> ServerProcess:
        self.launch()
        self.wait_ready()
        return self

    #: What ``python -m`` runs: the launcher (a subclass may run another server with the same
    #: flags, e.g. the tests' vLLM reference).
    module = "server"
    #: The interpreter and the folder it runs in (a check of an installed copy runs another
    #: virtual environment's interpreter outside the clone, so only what pip installed imports).
    python: str = sys.executable
    cwd: Path = ROOT

    def launch(self) -> ServerProcess:
        """Start the process without waiting (start several, then ``wait_ready`` each)."""
        # vLLM's dev routes (reset_prefix_cache, sleep, collective_rpc, ...) only when the
        # caller's environment or ``env`` asks for them (VLLM_SERVER_DEV_MODE=1): never by default.
        env = dict(os.environ, PYTHONUNBUFFERED="1", **self.extra_env)
        env[ENV_PARENT_PID] = str(os.getpid())  # the child stops when we die
        if threading.current_thread() is threading.main_thread():
            env[ENV_PARENT_DEATHSIG] = "1"
        else:
            env.pop(ENV_PARENT_DEATHSIG, None)
        log = self.log_path.open("wb")
        # A process group of its own (stopped as one, out of the terminal's ^C, which the
        # launcher handles), in the caller's session, not one of its own: Linux's autogroup
        # shares a core between sessions before it looks at a thread's nice, so a replica's
        # spinning NIXL thread at nice 19 still took a core from another replica there
        # (docs/cluster.md, "A spinning NIXL progress thread").
        self.proc = subprocess.Popen(
            [self.python, "-m", self.module, "--port", str(self.port), *self.args],
            cwd=self.cwd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
        ServerProcess.running.add(self)
        return self

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self) -> None:
        import httpx  # here: the reaper imports this module and needs none of it

        deadline = time.monotonic() + self.ready_timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"{self.name} server exited with {self.proc.returncode}; "
                    f"first error: {self.first_error()}; log ({self.log_path}):\n{self.log_tail()}"
                )
            try:
                r = httpx.get(f"{self.url}/v1/models", headers=self.headers(), timeout=2.0)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(
            f"{self.name} server not ready after {self.ready_timeout}s; log:\n{self.log_tail()}"
        )

    def log_tail(self, n: int = 60, only: tuple[str, ...] = ()) -> str:
        """The log's last ``n`` lines (those containing one of ``only``, if given)."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        if only:
            lines = [line for line in lines if any(word in line for word in only)]
        return "\n".join(lines[-n:])

    def first_error(self) -> str:
        """The log's first raised exception line: a failed start's cause, which the tail of a
        long traceback (re-raised through the engine client) no longer shows."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return next((line.strip() for line in lines if _RAISED.search(line)), "(none found)")

    def terminate(self) -> None:
        """Ask the whole process group to stop (SIGTERM) without waiting; ``stop`` finishes."""
        if self.proc is None:
            return
        try:
            os.killpg(os.getpgid(self.proc.pid), signal.SIGTERM)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 30.0) -> None:
        ServerProcess.running.discard(self)
        if self.proc is None:
            return
        try:
            pgid = os.getpgid(self.proc.pid)
        except ProcessLookupError:
            self.proc = None
            return
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)  # whatever children are left
        except ProcessLookupError:
            pass
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
