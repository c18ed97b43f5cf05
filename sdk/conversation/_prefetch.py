"""Background prefetches: a thread for a sync call, a task for an async one. A prefetch is only
a hint (warm the branch while a tool runs), so a failed one is logged and never fails the turn;
callers can wait for them (tests, orderly shutdown)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sdk.conversation._flow import BranchRef

__all__ = ["Prefetches"]


class Prefetches:
    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._threads: set[threading.Thread] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def _failed(self, ref: BranchRef, exc: BaseException) -> None:
        self._log.info("kvbranch: prefetch of %s/%s failed: %s", ref.session_id, ref.branch, exc)

    def start(self, ref: BranchRef, prefetch: Callable[[], Any]) -> None:
        """Run ``prefetch`` in a daemon thread."""

        def run() -> None:
            try:
                prefetch()
            except Exception as exc:  # a hint: never fails the turn
                self._failed(ref, exc)
            finally:
                self._threads.discard(threading.current_thread())

        thread = threading.Thread(target=run, name="kvbranch-prefetch", daemon=True)
        self._threads.add(thread)
        try:
            thread.start()
        except RuntimeError as exc:  # e.g. the interpreter is shutting down
            self._threads.discard(thread)
            self._failed(ref, exc)

    def astart(self, ref: BranchRef, prefetch: Callable[[], Awaitable[Any]]) -> None:
        """Run ``prefetch`` as a task of the running event loop."""

        async def run() -> None:
            try:
                await prefetch()
            except Exception as exc:  # noqa: BLE001 - as in start
                self._failed(ref, exc)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def wait(self, timeout: float | None) -> None:
        """Wait for the prefetch threads."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in list(self._threads):
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))

    async def await_tasks(self, timeout: float | None) -> None:
        """Wait for the prefetch tasks of the running event loop."""
        loop = asyncio.get_running_loop()
        tasks = [t for t in self._tasks if not t.done() and t.get_loop() is loop]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
