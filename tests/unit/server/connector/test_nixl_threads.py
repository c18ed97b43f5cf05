"""NIXL's threads keep their priority until one spins: the watcher's decision (fake clock and
readings), and the scheduler statistics it reads (real threads)."""

from __future__ import annotations

import threading
import time

from server.connector import nixl_threads
from server.connector.nixl_threads import SPIN_WINDOWS, SpinWatch


class Threads:
    """Each thread's runnable seconds, advanced by the test."""

    def __init__(self) -> None:
        self.now = 0.0
        self.runnable: dict[int, float] = {}
        self.lowered: list[int] = []

    def tick(self, shares: dict[int, float]) -> None:
        self.now += 1.0
        for tid, share in shares.items():
            self.runnable[tid] += share

    def watch(self) -> SpinWatch:
        return SpinWatch(
            clock=lambda: self.now, read=self.runnable.get, act=lambda t: not self.lowered.append(t)
        )


def test_a_thread_runnable_window_after_window_is_lowered_one_that_sleeps_is_not():
    threads = Threads()
    threads.runnable = {1: 0.0, 2: 0.0}
    watch = threads.watch()
    assert watch.watch({1, 2}) == set()
    for window in range(SPIN_WINDOWS):
        assert threads.lowered == [], window
        threads.tick({1: 1.0, 2: 0.05})
        lowered = watch.sample()
    assert lowered == [1] and threads.lowered == [1]
    assert watch.watching()  # thread 2 still watched
    for _ in range(5):
        threads.tick({1: 1.0, 2: 0.05})
        assert watch.sample() == []  # lowered once, then no longer watched
    assert threads.lowered == [1] and watch.lowered == [1]


def test_a_busy_window_between_quiet_ones_is_a_read_not_a_spin():
    threads = Threads()
    threads.runnable = {1: 0.0}
    watch = threads.watch()
    watch.watch({1})
    for _ in range(4):
        threads.tick({1: 1.0})
        watch.sample()
        threads.tick({1: 0.1})
        watch.sample()
    assert threads.lowered == []


def test_an_ended_thread_is_dropped_and_an_unreadable_one_is_returned():
    threads = Threads()
    threads.runnable = {1: 0.0}
    watch = threads.watch()
    assert watch.watch({1, 9}) == {9}  # no statistics for 9: the caller lowers it at once
    del threads.runnable[1]
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
    assert nixl_threads.runnable_seconds(spinner.native_id) is None  # ended: nothing to read
