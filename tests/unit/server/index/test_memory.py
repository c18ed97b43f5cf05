"""The embedded index's own bounds: capped (oldest hold evicted), swept (expired holds counted).
The behaviour both backends share is in the role suites (test_*_contract.py)."""

from __future__ import annotations

import asyncio
import time

import pytest

from server.index import Hold, MemoryIndexStore

D = "http://d"


def _hold(tokens: int, turn: int = 1) -> Hold:
    return Hold(D, "x", {"remote_num_tokens": tokens}, turn=turn)


def test_cap_evicts_the_oldest_hold():
    async def run() -> None:
        index = MemoryIndexStore(hold_ttl_s=60, max_holds=3)
        for i in range(3):
            await index.put_hold(("t", f"s{i}", "main"), _hold(i))
        await index.put_hold(("t", "s0", "main"), _hold(9, turn=2))  # s0 is now the youngest
        await index.put_hold(("t", "s3", "main"), _hold(3))
        assert len(index) == 3
        assert await index.peek_hold(("t", "s1", "main")) is None  # the oldest went
        held = await index.peek_hold(("t", "s0", "main"))
        assert held is not None and held.num_tokens == 9
        assert index.counters()["evicted"] == 1

    asyncio.run(run())
    with pytest.raises(ValueError):
        MemoryIndexStore(hold_ttl_s=1, max_holds=0)


def test_sweep_counts_what_it_dropped():
    async def run() -> None:
        index = MemoryIndexStore(hold_ttl_s=0.01)
        await index.put_hold(("t", "a", "main"), _hold(1))
        await index.put_hold(("t", "b", "main"), _hold(1))
        time.sleep(0.03)
        assert await index.sweep() == 2 and len(index) == 0
        assert index.counters()["expired"] == 2

    asyncio.run(run())


def test_drops_by_session_and_instance_and_scopes_snapshots_by_tenant():
    async def run() -> None:
        index = MemoryIndexStore(hold_ttl_s=10)
        await index.put_hold(("a", "s1", "main"), Hold("http://d1", None, {"remote_num_tokens": 1}))
        await index.put_hold(("a", "s1", "alt"), Hold("http://d2", None, {"remote_num_tokens": 2}))
        await index.put_hold(("b", "s2", "main"), Hold("http://d1", None, {"remote_num_tokens": 3}))
        assert {e["branch_id"] for e in await index.snapshot("a")} == {"main", "alt"}
        assert [e["session_id"] for e in await index.snapshot("b")] == ["s2"]
        assert await index.drop_instance_holds("http://d1") == 2
        assert await index.drop_session("a", "s1") == 1
        assert await index.snapshot(None) == []

    asyncio.run(run())
