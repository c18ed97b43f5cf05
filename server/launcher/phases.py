"""The launcher's start-up phases on stderr, one line each, and the URL once the server listens.

A start takes 25-90 s on CPU, most of it inside vLLM's engine core, which runs in its own
processes (spawned, so no logging handler of ours reaches them). What every one of those
processes does share is the standard output vLLM logs to: :class:`StdoutTee` puts a pipe on
file descriptor 1 before the engine starts, forwards every byte unchanged, and hands each line
to :class:`PhaseTracker`, which knows the few vLLM log lines that start a phase. The last phase,
*ready*, is not a log line: :func:`watch_listening` connects to the port until the HTTP server
accepts (vLLM binds the socket early but listens only once the app has started).

Nothing here changes what the server prints or when it is ready: the tee forwards before it
looks, and a marker that a vLLM release renames only loses that one phase line. Standard
library only.
"""

from __future__ import annotations

import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

__all__ = [
    "ENGINE_DEATH_MARKERS",
    "ENGINE_PHASES",
    "PhaseTracker",
    "Phases",
    "StdoutTee",
    "tells_engine_death",
    "watch_listening",
]

#: (a vLLM 0.32 log line's marker, the phase it starts), in the order they happen.
ENGINE_PHASES: tuple[tuple[bytes, str], ...] = (
    (b"Initializing a V1 LLM engine", "starting the engine core"),
    (b"Starting to load model", "loading weights"),
    (b"Loading weights took", "weights loaded; profiling memory and sizing the KV cache"),
    (b"Warming up model", "compiling and warming up"),
    (b"Capturing CUDA graph", "capturing CUDA graphs"),
    (
        b"init engine (profile, create kv cache, warmup model) took",
        "engine up; starting the HTTP server",
    ),
)
#: vLLM 0.32 log lines that say its engine died while serving (a fatal error in the engine core,
#: the core's process gone, the API server's output handler failing). vLLM's server then shuts
#: itself down and returns as it does from a requested stop: only these lines tell them apart.
ENGINE_DEATH_MARKERS: tuple[bytes, ...] = (
    b"EngineCore encountered a fatal error",
    b"engine core exited unexpectedly",
    b"AsyncLLM output_handler failed",
)
_MAX_PARTIAL = 64 * 1024  # a "line" longer than this is not one of vLLM's log lines


class Phases:
    """Prints ``[kvbranch] <phase> (<seconds since start> s)`` on stderr."""

    def __init__(self, stream: TextIO | None = None, started: float | None = None) -> None:
        self._stream = stream
        self.started = time.monotonic() if started is None else started
        self._lock = threading.Lock()

    def say(self, text: str) -> None:
        elapsed = time.monotonic() - self.started
        stream = self._stream or sys.stderr
        with self._lock:
            print(f"[kvbranch] {text} ({elapsed:.1f} s)", file=stream, flush=True)


class PhaseTracker:
    """Which phase a log line starts, if any: each phase once, and never one that comes before
    a phase already seen (vLLM logs some markers again later, e.g. from another process)."""

    def __init__(self, phases: tuple[tuple[bytes, str], ...] = ENGINE_PHASES) -> None:
        self._phases = phases
        self._next = 0

    def phase_of(self, line: bytes) -> str | None:
        for index in range(self._next, len(self._phases)):
            marker, phase = self._phases[index]
            if marker in line:
                self._next = index + 1
                return phase
        return None


def tells_engine_death(line: bytes) -> bool:
    """Whether this vLLM log line says its engine died (:data:`ENGINE_DEATH_MARKERS`)."""
    return any(marker in line for marker in ENGINE_DEATH_MARKERS)


class StdoutTee:
    """File descriptor 1 through a pipe: every byte is forwarded to the original stdout as it
    comes, and each complete line is passed to ``on_line`` (after it was forwarded). Processes
    started afterwards inherit the pipe, so their output passes the same way.

    :meth:`close` puts the original stdout back for this process and forwards what is already
    in the pipe; the thread keeps forwarding what children still write until this process
    exits."""

    def __init__(self, on_line: Callable[[bytes], None]) -> None:
        self._on_line = on_line
        self._lock = threading.Lock()
        self._partial = b""
        sys.stdout.flush()
        self._saved = os.dup(1)
        self._read, write = os.pipe()
        os.dup2(write, 1)
        os.close(write)
        self._thread = threading.Thread(target=self._pump, name="kvbranch-phases", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        while True:
            try:
                ready, _, _ = select.select([self._read], [], [], 0.5)
                if ready and not self._forward_once():
                    return
            except (OSError, ValueError):
                return

    def _forward_once(self) -> bool:
        """Forward one read's worth; False at end of file."""
        with self._lock:
            data = os.read(self._read, 65536)
            if not data:
                return False
            _write_all(self._saved, data)
            lines = (self._partial + data).split(b"\n")
            self._partial = lines.pop()[-_MAX_PARTIAL:]
        for line in lines:
            try:
                self._on_line(line)
            except Exception:  # noqa: BLE001 - a phase line must never cost the server's output
                pass
        return True

    def close(self) -> None:
        try:
            sys.stdout.flush()
        except (OSError, ValueError):
            pass
        os.dup2(self._saved, 1)
        try:
            while select.select([self._read], [], [], 0)[0] and self._forward_once():
                pass
        except (OSError, ValueError):
            pass


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except InterruptedError:
            continue
        except OSError:
            return  # the reader of our stdout is gone: nothing to forward to


def watch_listening(
    host: str,
    port: int,
    on_ready: Callable[[], None],
    stop: threading.Event,
    interval_s: float = 0.5,
) -> threading.Thread:
    """A thread that calls ``on_ready`` once ``host:port`` accepts TCP connections (or gives up
    when ``stop`` is set). The launcher checked the port was free, so the listener is ours."""
    target = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}.get(host, host)

    def poll() -> None:
        while not stop.is_set():
            try:
                with socket.create_connection((target, port), timeout=1.0):
                    pass
            except OSError:
                stop.wait(interval_s)
                continue
            on_ready()
            return

    thread = threading.Thread(target=poll, name="kvbranch-ready", daemon=True)
    thread.start()
    return thread
