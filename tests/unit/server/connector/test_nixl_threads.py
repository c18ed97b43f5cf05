"""NIXL's threads keep their priority until one spins: the watcher's decision (fake clock and
readings), and the scheduler statistics it reads (real threads)."""

from __future__ import annotations

import threading
import time

from server.connector import nixl_threads
from server.connector.nixl_threads import SPIN_WINDOWS, SpinWatch


class Threads:
    """Each thread's seconds on a core and waiting for one, advanced by the test."""

    def __init__(self, *tids: int) -> None:
        self.now = 0.0
        self.seconds: dict[int, tuple[float, float]] = {tid: (0.0, 0.0) for tid in tids}
        self.lowered: list[int] = []

    def tick(self, shares: dict[int, tuple[float, float]]) -> None:
        """One second: each thread's (on a core, waiting) share of it."""
        self.now += 1.0
        for tid, (on_core, waiting) in shares.items():
            before = self.seconds[tid]
            self.seconds[tid] = (before[0] + on_core, before[1] + waiting)

    def watch(self) -> SpinWatch:
        return SpinWatch(
            clock=lambda: self.now, read=self.seconds.get, act=lambda t: not self.lowered.append(t)
        )


SPINS = (1.0, 0.0)  # on a core the whole second
SLEEPS = (0.03, 0.02)  # wakes, polls, sleeps again


def test_a_thread_runnable_window_after_window_is_lowered_one_that_sleeps_is_not():
    threads = Threads(1, 2)
    watch = threads.watch()
    assert watch.watch({1, 2}) == set()
    for window in range(SPIN_WINDOWS):
        assert threads.lowered == [], window
        threads.tick({1: SPINS, 2: SLEEPS})
        lowered = watch.sample()
    assert lowered == [1] and threads.lowered == [1]
    assert watch.watching()  # thread 2 still watched
    for _ in range(5):
        threads.tick({1: SPINS, 2: SLEEPS})
        assert watch.sample() == []  # lowered once, then no longer watched
    assert threads.lowered == [1] and watch.lowered == [1]


def test_a_busy_window_between_quiet_ones_is_a_read_not_a_spin():
    threads = Threads(1)
    watch = threads.watch()
    watch.watch({1})
    for _ in range(4):
        threads.tick({1: SPINS})
        watch.sample()
        threads.tick({1: SLEEPS})
        watch.sample()
    assert threads.lowered == []


def test_a_spinner_sharing_its_core_is_lowered_a_sleeper_waiting_for_a_crowded_core_is_not():
    threads = Threads(1, 2)
    watch = threads.watch()
    watch.watch({1, 2})
    for _ in range(SPIN_WINDOWS + 2):
        # 1 gets a third of a core shared with two forwards, waiting the rest; 2 wakes every
        # millisecond and waits about as long for the core each time
        threads.tick({1: (0.33, 0.67), 2: (0.04, 0.93)})
        watch.sample()
    assert threads.lowered == [1]


def test_an_ended_thread_is_dropped_and_an_unreadable_one_is_returned():
    threads = Threads(1)
    watch = threads.watch()
    assert watch.watch({1, 9}) == {9}  # no statistics for 9: the caller lowers it at once
    del threads.seconds[1]
    threads.tick({})
    assert watch.sample() == [] and not watch.watching()


def test_the_scheduler_statistics_tell_a_spinning_thread_from_a_sleeping_one():
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            pass

    def sleep() -> None:
        while not stop.is_set():
            time.sleep(0.05)

    spinner = threading.Thread(target=spin, daemon=True)
    sleeper = threading.Thread(target=sleep, daemon=True)
    spinner.start()
    sleeper.start()
    lowered: list[int] = []
    watch = SpinWatch(act=lambda t: not lowered.append(t))
    try:
        assert watch.watch({spinner.native_id, sleeper.native_id}) == set()
        for _ in range(SPIN_WINDOWS + 1):
            time.sleep(1.0)
            watch.sample()
    finally:
        stop.set()
        spinner.join()
        sleeper.join()
    assert lowered == [spinner.native_id]
    assert nixl_threads.scheduled_seconds(spinner.native_id) is None  # ended: nothing to read
