"""The circuit breaker in front of a shared index: fail fast while it is down, probe after a
backoff, close on success."""

from __future__ import annotations

import asyncio

import pytest

from server.index import IndexUnavailable, MemoryIndexStore
from server.index.guarded import FIRST_BACKOFF_S, GuardedStore


class _Flaky(MemoryIndexStore):
    def __init__(self) -> None:
        super().__init__(hold_ttl_s=10)
        self.down = False
        self.calls = 0

    async def begin_turn(self, key):  # type: ignore[no-untyped-def]
        self.calls += 1
        if self.down:
            raise IndexUnavailable("down")
        return await super().begin_turn(key)


def test_fails_fast_while_open_and_closes_after_a_successful_probe():
    now = [0.0]
    inner = _Flaky()
    store = GuardedStore(inner, clock=lambda: now[0])
    key = ("t", "s", "main")

    async def go() -> None:
        assert (await store.begin_turn(key)).turn == 1
        inner.down = True
        with pytest.raises(IndexUnavailable):
            await store.begin_turn(key)
        calls = inner.calls
        with pytest.raises(IndexUnavailable):  # open: not even tried
            await store.begin_turn(key)
        assert inner.calls == calls and store.short_circuited == 1
        now[0] += FIRST_BACKOFF_S
        with pytest.raises(IndexUnavailable):  # the probe fails: open again, longer
            await store.begin_turn(key)
        now[0] += FIRST_BACKOFF_S
        with pytest.raises(IndexUnavailable):
            await store.begin_turn(key)
        assert inner.calls == calls + 1
        inner.down = False
        now[0] += 2 * FIRST_BACKOFF_S
        assert (await store.begin_turn(key)).turn == 2
        assert store.available and store.counters()["unavailable"] == 2

    asyncio.run(go())
