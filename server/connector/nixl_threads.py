"""NIXL's own threads (its UCX progress thread among them), watched for spinning.

A paced progress thread sleeps in ``poll`` between UCX progress calls; it serves a peer's read
of this instance's blocks while the forward computes, so it should run at the forward's
priority. Over UCX's TCP transport its poll was seen returning at once, every time, for minutes
(docs/cluster.md, "A spinning NIXL progress thread"): a thread that spins like that starved
another engine sharing its core. Lowering every NIXL thread to nice 19 for good ended that, but
a read a busy peer serves then waits for CPU no one else wants, which on a busy core is almost
none. So the threads keep their priority and a watcher lowers one only once it spins: runnable
(on a core or waiting for one) for nearly all of :data:`SPIN_WINDOWS` windows in a row. The
measure is the scheduler's own accounting (``/proc/self/task/<tid>/schedstat``: time on a core
plus time waiting for one), so it reads the same whether the thread has a core to itself or
shares it, where its CPU share alone would halve. A thread that sleeps between polls is
runnable a small part of each window; one serving a long read is runnable throughout, and is
lowered too after the same windows (a read of gigabytes over TCP: then it yields only to
compute). Without ``schedstat`` (a kernel without scheduler statistics) the threads are lowered
at once, as before the watcher. A nice value ranks a thread within its own session only (Linux's
autogroup): lowered, the thread yields to its own instance's forward, not to another instance's
sharing the core.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

logger = logging.getLogger("kvbranch.nixl_threads")

#: The nice value of a NIXL thread found spinning: below the forward's and every other
#: process's threads, so that it takes only CPU no one else wants.
NIXL_THREAD_NICE = 19
#: Each window's length, and how many windows in a row a thread must be runnable for at least
#: :data:`SPIN_SHARE` of, and on a core for at least :data:`ON_CORE_SHARE` of, to count as
#: spinning. The second bound keeps a thread that wakes every millisecond on a crowded core,
#: where each wake-up may wait for the core as long as it slept, from reading as spinning.
WINDOW_S = 1.0
SPIN_WINDOWS = 2
SPIN_SHARE = 0.9
ON_CORE_SHARE = 0.2


def native_threads() -> set[int]:
    """This process's thread ids (Linux; empty elsewhere)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return set()


def python_threads() -> set[int]:
    return {t.native_id for t in threading.enumerate() if t.native_id is not None}


def scheduled_seconds(tid: int) -> tuple[float, float] | None:
    """Seconds ``tid`` has been on a core, and waiting for one; ``None``: no such thread, or no
    scheduler statistics."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            on_core, waiting = f.read().split()[:2]
        return int(on_core) / 1e9, int(waiting) / 1e9
    except (OSError, ValueError):
        return None


def lower(tid: int) -> bool:
    """``tid`` at :data:`NIXL_THREAD_NICE` (Linux sets a nice value per thread)."""
    try:
        os.setpriority(os.PRIO_PROCESS, tid, NIXL_THREAD_NICE)
        return True
    except OSError:
        return False  # gone already, or not allowed: it keeps its priority


def lower_all(thread_ids: set[int]) -> None:
    """``thread_ids`` at :data:`NIXL_THREAD_NICE` from now on, unwatched (``--nixl-threads
    lowered``)."""
    for tid in thread_ids:
        lower(tid)


class SpinWatch:
    """Samples the watched threads; :meth:`sample` lowers those that spun. The clock and the
    readers are arguments so that the decision is tested on its own."""

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        read: Callable[[int], tuple[float, float] | None] = scheduled_seconds,
        act: Callable[[int], bool] = lower,
    ) -> None:
        self._clock = clock
        self._read = read
        self._act = act
        self._lock = threading.Lock()
        self._last: dict[int, tuple[float, tuple[float, float]]] = {}  # tid -> (clock, reading)
        self._strikes: dict[int, int] = {}
        self.lowered: list[int] = []

    def watch(self, thread_ids: set[int]) -> set[int]:
        """Starts watching ``thread_ids``; returns those it cannot watch (no statistics)."""
        unwatchable = set()
        now = self._clock()
        with self._lock:
            for tid in thread_ids:
                reading = self._read(tid)
                if reading is None:
                    unwatchable.add(tid)
                else:
                    self._last[tid] = (now, reading)
                    self._strikes[tid] = 0
        return unwatchable

    def watching(self) -> bool:
        with self._lock:
            return bool(self._last)

    def sample(self) -> list[int]:
        """One reading of every watched thread; returns the threads lowered by it."""
        now = self._clock()
        lowered = []
        with self._lock:
            for tid, (then, (on_before, waited_before)) in list(self._last.items()):
                reading = self._read(tid)
                if reading is None:  # the thread ended
                    del self._last[tid], self._strikes[tid]
                    continue
                self._last[tid] = (now, reading)
                per_second = 1.0 / (now - then) if now > then else 0.0
                on_core = (reading[0] - on_before) * per_second
                runnable = on_core + (reading[1] - waited_before) * per_second
                spun = runnable >= SPIN_SHARE and on_core >= ON_CORE_SHARE
                self._strikes[tid] = self._strikes[tid] + 1 if spun else 0
                if self._strikes[tid] >= SPIN_WINDOWS:
                    del self._last[tid], self._strikes[tid]
                    if self._act(tid):
                        lowered.append(tid)
            self.lowered.extend(lowered)
        return lowered


_watch = SpinWatch()
_watcher: threading.Thread | None = None
_watcher_lock = threading.Lock()


def watch_for_spin(thread_ids: set[int]) -> None:
    """Watch ``thread_ids`` (NIXL's, started while its agent was made) from one daemon thread
    per process; those that cannot be watched are lowered now."""
    global _watcher
    with _watcher_lock:
        lower_all(_watch.watch(thread_ids))
        if _watcher is None and _watch.watching():
            _watcher = threading.Thread(target=_run, name="kvbranch-nixl-spin-watch", daemon=True)
            _watcher.start()


def _run() -> None:
    global _watcher
    while True:
        time.sleep(WINDOW_S)
        for tid in _watch.sample():
            logger.warning(
                "kvbranch: NIXL thread %d was runnable for %d s on end (a spinning progress "
                "thread): lowered to nice %d, so that it takes only CPU no one else wants",
                tid,
                int(WINDOW_S * SPIN_WINDOWS),
                NIXL_THREAD_NICE,
            )
        with _watcher_lock:
            if not _watch.watching():
                _watcher = None
                return
