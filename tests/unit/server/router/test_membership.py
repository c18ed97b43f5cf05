"""The pool follows the shared index: instances learnt from heartbeats, chosen only while their
record lives, kept through an index outage; P chosen by cost (server/router/choice.py)."""

from __future__ import annotations

import asyncio

import httpx

from server.connector.pd.transfer_auth import load_cluster_secret
from server.index import (
    BlockHits,
    IndexUnavailable,
    InstanceRecord,
    MemoryIndexStore,
    TurnStart,
    record_seal,
)
from server.router import choice
from server.router import pool as pool_mod
from server.router.pool import Pool
from tests.unit.server.router.fakes import base_of, json_reply

P1, P2, D1 = "http://p1.test:1", "http://p2.test:1", "http://d1.test:2"
KEY = ("t", "s", "main")


def _client(down: set[str] | None = None) -> httpx.AsyncClient:
    def handler(request: httpx.Request) -> httpx.Response:
        if base_of(request) in (down or set()):
            raise httpx.ConnectError("refused", request=request)
        return json_reply(200, {"instance_id": "iid-" + base_of(request)})

    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _indexed_pool() -> tuple[MemoryIndexStore, Pool]:
    """A pool that knows no instance but what the (embedded) index lists."""
    store = MemoryIndexStore(hold_ttl_s=10)
    return store, Pool([], [], client=_client(), store=store)


def _record(url: str, role: str, load: int = 0) -> InstanceRecord:
    """A heartbeat as an instance sends it: sealed with the cluster secret the pool verifies."""
    record = InstanceRecord("iid-" + url, url, role, block_size=16, load=load)  # type: ignore[arg-type]
    return record_seal.seal(record, load_cluster_secret())


def test_instances_come_from_heartbeats_and_leave_when_their_record_expires():
    async def go() -> None:
        now = [0.0]
        store = MemoryIndexStore(hold_ttl_s=10, clock=lambda: now[0])
        pool = Pool([], [], client=_client(), store=store)
        await store.heartbeat(_record(P1, "prefill"), ttl_s=0.2)
        await store.heartbeat(_record(D1, "decode"), ttl_s=60)
        assert [i.url for i in await pool.live(pool.prefills)] == [P1]
        assert [i.url for i in await pool.live(pool.decodes)] == [D1]
        now[0] += 0.3  # P1's heartbeat lapsed (the index's clock); its health check still answers
        await pool.refresh_members(max_age=0)
        assert await pool.live(pool.prefills) == []
        await store.heartbeat(_record(P1, "prefill"), ttl_s=60)  # back
        await pool.refresh_members(max_age=0)
        assert [i.url for i in await pool.live(pool.prefills)] == [P1]

    asyncio.run(go())


class _Down(MemoryIndexStore):
    async def members(self) -> list[InstanceRecord]:
        raise IndexUnavailable("down")


def test_an_index_outage_keeps_the_last_view():
    async def go() -> None:
        store, pool = _indexed_pool()
        await store.heartbeat(_record(P1, "prefill"), ttl_s=60)
        assert len(await pool.live(pool.prefills)) == 1
        pool.store = _Down(hold_ttl_s=10)
        await pool.refresh_members(max_age=0)
        assert [i.url for i in await pool.live(pool.prefills)] == [P1]
        assert pool.members_failures == 1

    asyncio.run(go())


def test_the_prefill_that_holds_the_history_wins_unless_a_hold_makes_them_equal():
    async def go() -> None:
        store, pool = _indexed_pool()
        for url in (P1, P2):
            await store.heartbeat(_record(url, "prefill"), ttl_s=60)
        chain = list(range(1, 9))
        await store.publish_blocks("iid-" + P2, 0, "device", chain, [])
        start = TurnStart(turn=2, hold=None, home="iid-" + P1, chain=chain)
        chosen = await pool.choose_prefill(KEY, start)
        assert chosen is not None and chosen.url == P2  # holds all 8 blocks; home holds none
        chosen = await pool.choose_prefill(KEY, start, pulled=True)
        assert chosen is not None and chosen.url == P1  # equal cost: the home wins the tie

    asyncio.run(go())


def test_cost_weighs_load_against_prefill_left():
    class Inst:
        def __init__(self, url: str, load: int) -> None:
            self.url, self.instance_id, self.load = url, url, load

    busy, idle = Inst("a", 3), Inst("b", 0)
    hits = {"a": BlockHits(device=10)}
    # 10 blocks of 16 tokens held on the busy one: 160 tokens saved < 3 requests' load.
    assert choice.choose([busy, idle], KEY, history_tokens=160, hits=hits, block_size=16) is idle
    # 100 blocks held: 1600 tokens saved > 3 x 512.
    hits = {"a": BlockHits(device=100)}
    assert choice.choose([busy, idle], KEY, history_tokens=1600, hits=hits, block_size=16) is busy
    # host blocks count less than device blocks
    assert choice.held_tokens(BlockHits(host=10), 16) < choice.held_tokens(BlockHits(device=10), 16)


def test_round_robin_takes_turns_and_reads_nothing_from_the_index():
    async def go() -> None:
        pool = Pool([P1, P2], [D1], client=_client(), policy="round-robin")
        chosen = [await pool.choose_prefill(KEY, TurnStart(2, None, None)) for _ in range(4)]
        assert [c.url for c in chosen if c is not None] == [P2, P1, P2, P1]

    asyncio.run(go())


def test_an_index_that_comes_back_empty_keeps_the_last_view_for_one_heartbeat_ttl(monkeypatch):
    async def go() -> None:
        store, pool = _indexed_pool()
        await store.heartbeat(_record(P1, "prefill"), ttl_s=60)
        assert len(await pool.live(pool.prefills)) == 1
        pool.store = MemoryIndexStore(hold_ttl_s=10)  # a Redis that restarted empty
        await pool.refresh_members(max_age=0)
        assert [i.url for i in await pool.live(pool.prefills)] == [P1]
        monkeypatch.setattr(pool_mod, "DEFAULT_HEARTBEAT_TTL_S", 0.0)  # the TTL has passed
        await pool.refresh_members(max_age=0)
        assert await pool.live(pool.prefills) == []

    asyncio.run(go())


class _Clock:
    """The pool's injected clock: an outage longer than a TTL without waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_an_outage_longer_than_a_ttl_still_leaves_one_ttl_to_re_register():
    """CI 2026-12-03: Redis was down 13 s (> the 10 s TTL) and came back empty. The router had
    counted the TTL from its last read before the outage (503 at once); then, counting from the
    outage, a read that found some instances re-registered left out the others (503 while no D
    had re-registered yet)."""

    async def go() -> None:
        clock = _Clock()
        store, pool = _indexed_pool()
        pool.clock = clock
        for url, role in ((P1, "prefill"), (D1, "decode")):
            await store.heartbeat(_record(url, role), ttl_s=600)
        assert len(await pool.live(pool.prefills)) == len(await pool.live(pool.decodes)) == 1
        pool.store = _Down(hold_ttl_s=10)
        for _ in range(3):  # the outage outlasts a TTL
            clock.now += pool_mod.DEFAULT_HEARTBEAT_TTL_S / 2
            await pool.refresh_members(max_age=0)
        clock.now += 1
        back = MemoryIndexStore(hold_ttl_s=10)  # back, and empty
        pool.store = back
        assert [i.url for i in await pool.live(pool.prefills)] == [P1]
        assert [i.url for i in await pool.live(pool.decodes)] == [D1]
        clock.now += 2
        await back.heartbeat(_record(P1, "prefill"), ttl_s=600)  # P1 re-registers first
        assert [i.url for i in await pool.live(pool.decodes)] == [D1]  # D1 not yet: still kept
        assert pool.routable(pool.prefills) and pool.routable(pool.decodes)
        clock.now += pool_mod.DEFAULT_HEARTBEAT_TTL_S  # D1 never came back within a TTL: gone
        assert await pool.live(pool.decodes) == []
        assert [i.url for i in await pool.live(pool.prefills)] == [P1]
        # health says so: still alive, but not listed, so no turn goes there (degraded)
        assert pool.decodes[0].info()["alive"] and not pool.decodes[0].info()["listed"]
        assert not pool.routable(pool.decodes)

    asyncio.run(go())


def test_instances_unlisted_long_ago_are_forgotten(monkeypatch):
    async def go() -> None:
        store, pool = _indexed_pool()
        await store.heartbeat(_record(P1, "prefill"), ttl_s=60)
        await store.heartbeat(_record(P2, "prefill"), ttl_s=60)
        await pool.refresh_members(max_age=0)
        await store.deregister("iid-" + P1)
        await pool.refresh_members(max_age=0)
        assert {i.url for i in pool.prefills} == {P1, P2}  # remembered a while
        monkeypatch.setattr(pool_mod, "FORGET_UNLISTED_S", 0.0)
        await pool.refresh_members(max_age=0)
        assert [i.url for i in pool.prefills] == [P2]

    asyncio.run(go())
