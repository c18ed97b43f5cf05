"""Process lifetime without vLLM (fast): the mechanisms behind "nothing runs on orphaned"
(server.launcher.process), with tiny Python processes in vLLM's place. The real launcher, router and
instances are in tests/integration/test_router_lifecycle.py."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

from server.launcher.process import _POLL_S, ENV_PARENT_DEATHSIG, ENV_PARENT_PID, ROOT

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _spawn(code: str) -> tuple[subprocess.Popen, int]:
    """Start ``code``; it prints one pid (a process it started) on its first line."""
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    line = proc.stdout.readline()
    assert line.strip().isdigit(), f"no pid from the child: {line!r}"
    return proc, int(line)


def _gone_within(pid: int, timeout: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return time.monotonic() - start
        except psutil.NoSuchProcess:
            return time.monotonic() - start
        time.sleep(0.1)
    return None


def _wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 60.0) -> None:
    """Until ``proc`` (or a child sharing its stdout) prints the line ``text``."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no {text!r} line within {timeout}s"
    line = proc.stdout.readline()
    assert line.strip() == text, f"expected {text!r}, got {line!r}"


def _wait_for_reaper(parent: int, timeout: float = 60.0) -> None:
    """Until ``parent``'s reaper runs its loop (it loads psutil's extension right before), and
    two of its polls more: on a loaded machine its start-up alone can take seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for child in psutil.Process(parent).children():
            try:
                polling = "reap(" in " ".join(child.cmdline()) and any(
                    "_psutil_linux" in m.path for m in child.memory_maps()
                )
            except psutil.Error:
                continue
            if polling:
                time.sleep(2 * _POLL_S + 0.2)
                return
        time.sleep(0.05)
    pytest.fail("the reaper never started polling")


def _cleanup(proc: subprocess.Popen, pid: int) -> None:
    for target in (proc.pid, pid):
        try:
            os.kill(target, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(5)


def test_an_instances_children_stop_when_it_is_killed():
    """``python -m server`` SIGKILLed: its reaper stops what vLLM started (the engine core)."""
    proc, grandchild = _spawn("""
        import subprocess, sys, time
        from server.launcher.process import start_reaper
        start_reaper(1.0)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    try:
        _wait_for_reaper(proc.pid)  # it has seen the child
        proc.kill()
        took = _gone_within(grandchild, 8.0)
        assert took is not None, "the engine-core stand-in outlived its killed parent"
    finally:
        _cleanup(proc, grandchild)


@pytest.mark.parametrize("deathsig", ["1", "0"], ids=["prctl", "watchdog-only"])
def test_a_launched_child_stops_when_its_launcher_is_killed(deathsig):
    """The --disagg launcher SIGKILLed: the P/D stand-in stops (parent-death signal/watchdog)."""
    proc, child = _spawn(f"""
        import os, subprocess, sys, time
        code = ("from server.launcher.process import die_with_launcher; die_with_launcher(0.5); "
                "print('armed', flush=True); import time; time.sleep(600)")
        env = dict(os.environ, {ENV_PARENT_PID}=str(os.getpid()),
                   {ENV_PARENT_DEATHSIG}="{deathsig}")
        child = subprocess.Popen([sys.executable, "-c", code], env=env)
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    try:
        # Its import can take seconds on a loaded machine: killed before it is armed, the
        # launcher would test nothing (and the watchdog's first look would come late).
        _wait_for_line(proc, "armed")
        time.sleep(1.0)
        assert _gone_within(child, 0.5) is None, "the child stopped while its launcher lived"
        proc.kill()
        took = _gone_within(child, 5.0)
        assert took is not None, "the child kept running after its launcher died"
    finally:
        _cleanup(proc, child)


def test_a_child_started_by_hand_is_not_tied_to_its_parent(monkeypatch):
    """No launcher variable (e.g. nohup from a shell): die_with_launcher does nothing."""
    from server.launcher.process import die_with_launcher

    monkeypatch.delenv(ENV_PARENT_PID, raising=False)
    before = {t.name for t in __import__("threading").enumerate()}
    die_with_launcher(1.0)
    after = {t.name for t in __import__("threading").enumerate()}
    assert after == before


def test_a_child_behind_a_wrapper_watches_its_launcher_by_pid():
    """A shell between launcher and server (no exec): the server neither refuses to start nor
    outlives the launcher."""
    proc, wrapper = _spawn(f"""
        import os, subprocess, sys, time
        code = ("from server.launcher.process import die_with_launcher; die_with_launcher(0.5); "
                "import time; time.sleep(600)")
        env = dict(os.environ, {ENV_PARENT_PID}=str(os.getpid()), {ENV_PARENT_DEATHSIG}="1")
        shell = f"'{{sys.executable}}' -c '{{code}}'; true"
        child = subprocess.Popen(["sh", "-c", shell], env=env)
        print(child.pid, flush=True)
        time.sleep(600)
    """)
    try:
        time.sleep(1.5)
        servers = psutil.Process(wrapper).children()
        assert servers, "the server behind the wrapper did not start (or refused to)"
        proc.kill()
        took = _gone_within(servers[0].pid, 5.0)
        assert took is not None, "the server behind a wrapper outlived its launcher"
    finally:
        _cleanup(proc, wrapper)


def test_a_server_runs_in_its_own_process_group_inside_the_launchers_session(tmp_path):
    """A replica's process group is its own (stopped as one) but its session is the launcher's:
    Linux's autogroup shares a core between sessions before any thread's nice counts, so in
    sessions of their own one replica's NIXL thread at nice 19 took a core from another."""
    from server.launcher.process import ServerProcess

    (tmp_path / "sleeper.py").write_text("import time\ntime.sleep(60)\n")

    class Sleeper(ServerProcess):
        module = "sleeper"
        cwd = tmp_path

    server = Sleeper([], name="unit-session")
    proc = server.launch().proc
    assert proc is not None
    try:
        assert os.getpgid(proc.pid) == proc.pid
        assert os.getsid(proc.pid) == os.getsid(0)
    finally:
        server.stop(timeout=5)
    assert proc.poll() is not None
