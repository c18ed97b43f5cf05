"""Stopping is bounded, and nothing runs on orphaned: real ``python -m server --disagg``
launchers (router + prefill + decode instances, each with its vLLM engine core), real signals.

Two launches in all (P/D instances are heavy on small machines); each checks several things:

1. SIGTERM to the launcher while long streams hang on slow clients (one through the router,
   one straight at D): the launcher, P, D and every engine core are gone within the shutdown
   grace (the router's, then D's own drain) plus a margin. The same launch first
   checks the router's session fan-out against real instances (idempotent retries converge).
2. SIGKILL to the prefill instance: its engine core goes too (the single-instance case,
   ``python -m server`` killed outright). Then SIGKILL to the launcher: D and its engine core
   stop instead of running on orphaned.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest

from sdk.contract import SESSIONS_PATH, session_path
from tests import prestart
from tests.integration.helpers import size_args
from tests.server_process import ServerProcess

GRACE_S = 3.0
#: Beyond the grace: vLLM's own teardown (engine core, NIXL) on 2 busy cores.
MARGIN_S = 25.0
ARGS = ["--disagg", *size_args(0.5, 0.25, 4096), "--shutdown-grace-s", str(GRACE_S)]


@pytest.fixture
def launcher() -> Iterator[ServerProcess]:
    """A fresh launch per test (each ends it), counted in the memory budget while it runs."""
    with prestart.reserved("the router lifecycle's --disagg launch", engines=2):
        server = ServerProcess(ARGS, name="disagg-life", ready_timeout=900).start()
        try:
            yield server
        finally:
            server.stop()


def _tree(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def _role_of(proc: psutil.Process) -> str:
    try:
        cmd = proc.cmdline()
    except psutil.Error:
        return "?"
    if "--role" in cmd:
        return cmd[cmd.index("--role") + 1]
    return "child"


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie (a zombie waits for its dead parent's reaping, it runs nothing)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _gone_within(procs: list[psutil.Process], timeout: float) -> tuple[float, list[str]]:
    """Seconds until every process exited (or the timeout), and the survivors' names."""
    names = {p.pid: _name(p) for p in procs}
    start = time.monotonic()
    alive = list(procs)
    while alive and time.monotonic() - start < timeout:
        time.sleep(0.2)
        alive = [p for p in alive if _running(p)]
    return time.monotonic() - start, [f"{p.pid}:{names[p.pid]}" for p in alive]


def _name(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())[:120]
    except psutil.Error:
        return "(gone)"


def _kill_all(procs: list[psutil.Process]) -> None:
    for proc in procs:
        try:
            proc.kill()
        except psutil.Error:
            pass


def _instance_urls(launcher: ServerProcess) -> dict[str, str]:
    with httpx.Client(timeout=30) as c:
        stats = c.get(launcher.url + "/v1/kvbranch/stats").json()
    return {i["role"]: i["url"] for i in stats["cluster"]["instances"]}


def _check_fanout(launcher: ServerProcess) -> None:
    """Session routes reach every instance; a retry after a partial failure converges."""
    urls = _instance_urls(launcher)
    with httpx.Client(timeout=60) as c:
        r = c.post(launcher.url + SESSIONS_PATH, json={"session_id": "life-1"})
        assert r.status_code == 201, r.text
        for url in urls.values():
            assert c.get(url + session_path("life-1")).status_code == 200
        # A create that reached only P before (e.g. D was briefly down): a retry converges.
        assert (
            c.post(urls["prefill"] + SESSIONS_PATH, json={"session_id": "life-2"}).status_code
            == 201
        )
        r = c.post(launcher.url + SESSIONS_PATH, json={"session_id": "life-2"})
        assert r.status_code == 201, r.text
        assert c.get(urls["decode"] + session_path("life-2")).status_code == 200
        # A delete that reached only D before: the retry through the router is done, not 404.
        assert c.delete(urls["decode"] + session_path("life-1")).status_code == 200
        r = c.delete(launcher.url + session_path("life-1"))
        assert r.status_code == 200, r.text
        assert c.get(urls["prefill"] + session_path("life-1")).status_code == 404
        # Deleting it again everywhere is a plain 404, as on one instance.
        assert c.delete(launcher.url + session_path("life-1")).status_code == 404


def _hang_a_stream(launcher: ServerProcess, url: str, started: threading.Event) -> threading.Thread:
    """A long generation read by a client that stops reading after the first chunk."""
    body = {
        "model": launcher.model,
        "temperature": 0,
        "max_tokens": 3500,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": "Count to a million."}],
    }

    def run() -> None:
        try:
            with httpx.Client(timeout=httpx.Timeout(600, connect=10)) as c:
                with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_raw():
                        started.set()
                        time.sleep(600)  # the slow client: never reads on
        except httpx.HTTPError:
            pass
        finally:
            started.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_sigterm_with_a_hanging_stream_stops_everything_within_the_grace(launcher):
    procs: list[psutil.Process] = []
    try:
        _check_fanout(launcher)
        procs = [psutil.Process(launcher.proc.pid), *_tree(launcher.proc.pid)]
        roles = {_role_of(p) for p in procs}
        assert {"prefill", "decode"} <= roles, roles
        # one stream through the router, one straight at D (an instance draining on SIGTERM)
        via_router, at_decode = threading.Event(), threading.Event()
        _hang_a_stream(launcher, launcher.url, via_router)
        _hang_a_stream(launcher, _instance_urls(launcher)["decode"], at_decode)
        assert via_router.wait(300) and at_decode.wait(300), "the streams never started"
        time.sleep(1.0)
        assert launcher.proc.poll() is None
        os.kill(launcher.proc.pid, signal.SIGTERM)
        took, alive = _gone_within(procs, GRACE_S + MARGIN_S)
        print(f"SIGTERM with a hanging stream: all {len(procs)} processes gone in {took:.1f}s")
        assert not alive, f"still running {took:.0f}s after SIGTERM: {alive}"
    finally:
        _kill_all(procs)


def test_sigkill_stops_the_engine_core_and_the_orphaned_instances(launcher):
    procs: list[psutil.Process] = []
    problems: list[str] = []
    try:
        procs = _tree(launcher.proc.pid)
        prefill = next(p for p in procs if _role_of(p) == "prefill")
        p_tree = _tree(prefill.pid)
        assert p_tree, "the prefill instance has no engine core process"
        prefill.kill()
        took, alive = _gone_within(p_tree, 15.0)
        print(f"SIGKILL of the prefill instance: its {len(p_tree)} children gone in {took:.1f}s")
        if alive:
            problems.append(f"P's children outlived P by {took:.0f}s: {alive}")
        rest = [p for p in procs if _running(p)]
        os.kill(launcher.proc.pid, signal.SIGKILL)
        took, alive = _gone_within(rest, GRACE_S + MARGIN_S)
        print(f"SIGKILL of the launcher: {len(rest)} processes gone in {took:.1f}s")
        if alive:
            problems.append(f"still running {took:.0f}s after the launcher died: {alive}")
        for problem in problems:
            print("PROBLEM:", problem)
        assert not problems, problems
    finally:
        _kill_all(procs)


@pytest.fixture(autouse=True)
def _say_which(request):
    print(f"\n[{request.node.name}]")
    yield
