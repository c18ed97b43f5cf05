"""The launcher's start-up phases (issue 16 item 4): which vLLM log lines start a phase, the
stdout tee that forwards every byte unchanged (also what child processes write), and the
readiness watch on the port."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from server.launcher.phases import ENGINE_PHASES, Phases, PhaseTracker, watch_listening

ROOT = Path(__file__).resolve().parents[3]

#: Lines of a real start (vLLM 0.32 on CPU), in order, with noise and repeats in between.
LOG = [
    b"(APIServer pid=1) INFO 12-01 05:41:41 [model.py:733] Resolved architecture: Llama",
    b"(EngineCore pid=2) INFO 12-01 05:42:12 [core.py:133] Initializing a V1 LLM engine (v0.32.0)",
    b"(Worker pid=3) INFO 12-01 05:43:23 [cpu_model_runner.py:68] Starting to load model /m...",
    b"(Worker pid=3) INFO 12-01 05:43:27 [default_loader.py:501] Loading weights took 2.75 s",
    b"(EngineCore pid=2) INFO 12-01 05:43:37 [core.py:402] init engine (profile, create kv "
    b"cache, warmup model) took 0.92 s",
    b"(EngineCore pid=2) INFO 12-01 05:43:39 [core.py:133] Initializing a V1 LLM engine again",
    b"(Worker pid=3) INFO Starting to load model /m...",
]


def test_each_phase_once_in_order():
    tracker = PhaseTracker()
    seen = [p for p in map(tracker.phase_of, LOG) if p is not None]
    assert seen == [
        "starting the engine core",
        "loading weights",
        "weights loaded; profiling memory and sizing the KV cache",
        "engine up; starting the HTTP server",
    ]


def test_a_phase_that_never_logs_is_skipped_not_waited_for():
    tracker = PhaseTracker()
    assert tracker.phase_of(LOG[2]) == "loading weights"  # no engine-core line first
    assert tracker.phase_of(LOG[1]) is None  # never back to an earlier phase
    assert [m for m, _ in ENGINE_PHASES].index(b"Warming up model") > 1


def test_phase_lines_say_the_time_since_start():
    out = io.StringIO()
    Phases(out, started=0.0).say("loading weights")
    line = out.getvalue()
    assert line.startswith("[kvbranch] loading weights (") and line.endswith(" s)\n")


def test_the_tee_forwards_every_byte_and_sees_children_lines():
    """In a subprocess: the tee replaces fd 1 there, which must not disturb pytest's own."""
    script = textwrap.dedent("""
        import subprocess, sys
        from server.launcher.phases import PhaseTracker, StdoutTee
        tracker = PhaseTracker()
        seen = []
        tee = StdoutTee(lambda line: seen.append(tracker.phase_of(line)))
        print("first line, from the launcher", flush=True)
        subprocess.run([sys.executable, "-c",
                        "print('x Starting to load model y'); print('no newline', end='')"])
        print()
        print("z" * 200000, flush=True)  # longer than one pipe read
        tee.close()
        print("after close", flush=True)
        print("phases:", [p for p in seen if p], file=sys.stderr)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, timeout=60)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout == (
        b"first line, from the launcher\nx Starting to load model y\n"
        b"no newline\n" + b"z" * 200000 + b"\nafter close\n"
    )
    assert b"phases: ['loading weights']" in proc.stderr


def test_ready_once_the_port_listens():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, not listening: how vLLM holds it while it starts
    port = sock.getsockname()[1]
    ready = threading.Event()
    stop = threading.Event()
    thread = watch_listening("0.0.0.0", port, ready.set, stop, interval_s=0.05)
    try:
        assert not ready.wait(0.3)
        sock.listen()
        assert ready.wait(5.0)
    finally:
        stop.set()
        thread.join(5.0)
        sock.close()
    assert not thread.is_alive()


def test_the_watch_stops_when_told():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        stop = threading.Event()
        thread = watch_listening("127.0.0.1", port, lambda: None, stop, interval_s=0.05)
        stop.set()
        thread.join(5.0)
        assert not thread.is_alive()


def test_engine_death_lines_are_told_from_a_requested_stop():
    from server.launcher.phases import tells_engine_death

    died = (
        b"(EngineCore pid=7) ERROR 12-06 02:26:27 [core.py:1512] EngineCore encountered a fatal "
        b"error.",
        b"(APIServer pid=6) WARNING [core_client.py:818] [shutdown] MPClient: engine core exited "
        b"unexpectedly; starting cleanup",
        b"(APIServer pid=6) ERROR [async_llm.py:906] AsyncLLM output_handler failed.",
    )
    assert all(tells_engine_death(line) for line in died)
    stopped = (
        b"(APIServer pid=6) INFO [core_client.py:777] [shutdown] MPClient: complete",
        b"(EngineCore pid=7) INFO [core.py:1454] [shutdown] EngineCore: trigger received "
        b"signal=SIGTERM",
    )
    assert not any(tells_engine_death(line) for line in stopped)
