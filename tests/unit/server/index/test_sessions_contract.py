"""The session role's contract (:class:`~server.index.sessions.SessionStore`): turn numbers,
single-use holds, the newest turn's hold kept, chains, homes, placement, session deletes and the
stats snapshot, on every backend that serves the role (backends.py), and across routers."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.index.guarded import GuardedStore
from server.index.memory import MemoryIndexStore
from server.index.redis_store import RedisIndexStore
from server.index.sessions import MAX_SESSION_INSTANCES, Key, SessionStore, chain_of
from tests.redis_server import RedisServer
from tests.unit.server.index.backends import (
    KEY,
    TTL_S,
    FakeClock,
    MakeStore,
    backend_fixture,
    hold,
    names,
    run_out,
)

backend = backend_fixture(SessionStore)


@pytest.fixture
async def store(make_store: MakeStore) -> SessionStore:
    return await make_store()


async def test_turn_numbers_increase_per_branch(store: SessionStore) -> None:
    assert [(await store.begin_turn(KEY)).turn for _ in range(3)] == [1, 2, 3]
    assert (await store.begin_turn(("tenant-a", "sess:1", "alt"))).turn == 1
    assert (await store.begin_turn(("tenant-b", "sess:1", "main"))).turn == 1


async def test_take_is_single_use(store: SessionStore) -> None:
    assert (await store.begin_turn(KEY)).hold is None
    assert await store.put_hold(KEY, hold(1))
    got = (await store.begin_turn(KEY)).hold
    assert got is not None
    assert (got.decode_url, got.instance_id, got.turn) == ("http://d1", "d1-id", 1)
    assert got.params == hold(1).params and got.num_tokens == 32
    assert 0 < got.expires_in_s <= 30
    assert (await store.begin_turn(KEY)).hold is None
    assert await store.peek_hold(KEY) is None
    assert store.counters()["taken"] == 1 and store.counters()["stored"] == 1


async def test_older_turn_never_replaces_newer(store: SessionStore) -> None:
    assert await store.put_hold(KEY, hold(5, url="http://new"))
    assert not await store.put_hold(KEY, hold(3, url="http://late"))
    peeked = await store.peek_hold(KEY)
    assert peeked is not None and (peeked.turn, peeked.decode_url) == (5, "http://new")
    assert await store.put_hold(KEY, hold(5, url="http://again"))  # same turn: a retry files
    assert await store.put_hold(KEY, hold(6))
    assert store.counters()["stale_dropped"] == 1
    taken = (await store.begin_turn(KEY)).hold
    assert taken is not None and taken.turn == 6


async def test_hold_expires(make_store: MakeStore, backend: str, clock: FakeClock) -> None:
    store = await make_store(hold_ttl_s=TTL_S)
    await store.put_hold(KEY, hold(1))
    peeked = await store.peek_hold(KEY)
    assert peeked is not None and peeked.expires_in_s is not None
    assert 0 < peeked.expires_in_s <= TTL_S  # Redis's own TTL, as set: no longer
    assert backend != "memory" or peeked.expires_in_s == TTL_S  # its clock has not moved

    async def held() -> bool:
        return await store.peek_hold(KEY) is not None

    await run_out(backend, clock, held)
    assert (await store.begin_turn(KEY)).hold is None


async def test_a_hold_offered_for_less_expires_sooner_never_later(
    make_store: MakeStore, backend: str, clock: FakeClock
) -> None:
    """``put_hold(..., ttl_s)``: a fork's new branch gets its parent's hold for what is left of
    the parent's offer, never past the store's own hold TTL."""
    store = await make_store(hold_ttl_s=10 * TTL_S)
    fork = ("tenant-a", "sess:1", "fork")
    assert await store.put_hold(fork, hold(0), ttl_s=TTL_S)
    assert await store.put_hold(KEY, hold(1), ttl_s=1000 * TTL_S)
    shared, capped = await store.peek_hold(fork), await store.peek_hold(KEY)
    assert shared is not None and 0 < shared.expires_in_s <= TTL_S
    assert capped is not None and TTL_S < capped.expires_in_s <= 10 * TTL_S

    async def held() -> bool:
        return await store.peek_hold(fork) is not None

    await run_out(backend, clock, held)
    assert await store.peek_hold(KEY) is not None


async def test_chain_round_trip(store: SessionStore) -> None:
    hashes = [(b"\x01" * 24 + i.to_bytes(8, "big")).hex() for i in (7, 2**64 - 1, 0, 12345)]
    assert await store.put_hold(KEY, hold(1, hashes=hashes))
    want = chain_of(hold(1, hashes=hashes).params)
    assert want == [7, 2**64 - 1, 0, 12345]
    assert (await store.begin_turn(KEY)).chain == want
    assert (await store.begin_turn(KEY)).chain == want  # outlives the hold
    assert (await store.begin_turn(("tenant-a", "sess:1", "alt"))).chain == []


async def test_home(store: SessionStore) -> None:
    assert (await store.begin_turn(KEY)).home is None
    await store.set_home("tenant-a", "sess:1", "p-7")
    assert (await store.begin_turn(KEY)).home == "p-7"
    assert (await store.begin_turn(("tenant-a", "sess:1", "other-branch"))).home == "p-7"
    assert (await store.begin_turn(("tenant-b", "sess:1", "main"))).home is None


async def test_peek_home_reads_the_home_and_starts_no_turn(store: SessionStore) -> None:
    assert await store.peek_home("tenant-a", "sess:1") is None
    await store.set_home("tenant-a", "sess:1", "r-2")
    assert await store.put_hold(KEY, hold(1))
    assert await store.peek_home("tenant-a", "sess:1") == "r-2"
    assert await store.peek_home("tenant-b", "sess:1") is None
    assert await store.peek_hold(KEY) is not None  # the hold is left for the replica to take
    start = await store.begin_turn(KEY)
    assert start.turn == 1 and start.home == "r-2"  # no turn was numbered by the peek
    await store.drop_session("tenant-a", "sess:1")
    assert await store.peek_home("tenant-a", "sess:1") is None


async def test_session_placement_is_capped(store: SessionStore) -> None:
    assert await store.session_instances("tenant-a", "sess:1") == set()
    await store.set_home("tenant-a", "sess:1", "home-is-not-an-instance-entry")
    await store.add_session_instances("tenant-a", "sess:1", ["p1", "d1", "p1"])
    assert await store.session_instances("tenant-a", "sess:1") == {"p1", "d1"}
    many = [f"x{i}" for i in range(MAX_SESSION_INSTANCES + 10)]
    await store.add_session_instances("tenant-a", "sess:1", many)
    have = await store.session_instances("tenant-a", "sess:1")
    assert len(have) == MAX_SESSION_INSTANCES and {"p1", "d1"} <= have
    assert await store.session_instances("tenant-a", "sess:2") == set()


async def test_drop_session_drops_its_holds(store: SessionStore) -> None:
    other: Key = ("tenant-a", "sess:2", "main")
    for k in (KEY, ("tenant-a", "sess:1", "alt"), other):
        assert await store.put_hold(k, hold(1))
    await store.set_home("tenant-a", "sess:1", "p1")
    await store.add_session_instances("tenant-a", "sess:1", ["p1"])
    assert await store.drop_session("tenant-a", "sess:1") == 2
    assert await store.peek_hold(KEY) is None
    assert await store.peek_hold(("tenant-a", "sess:1", "alt")) is None
    assert await store.peek_hold(other) is not None
    assert await store.session_instances("tenant-a", "sess:1") == set()
    assert (await store.begin_turn(KEY)).home is None
    assert await store.drop_session("tenant-a", "sess:1") == 0


async def test_snapshot_lists_live_holds(store: SessionStore) -> None:
    await store.put_hold(KEY, hold(1))
    await store.put_hold(("tenant-a", "sess:1", "alt"), hold(1))
    await store.put_hold(("tenant-b", "s2", "main"), hold(1))
    assert {e["branch_id"] for e in await store.snapshot("tenant-a")} == {"main", "alt"}
    assert [e["session_id"] for e in await store.snapshot("tenant-b")] == ["s2"]
    await store.begin_turn(KEY)
    assert {e["branch_id"] for e in await store.snapshot("tenant-a")} == {"alt"}
    entry = (await store.snapshot("tenant-b"))[0]
    assert entry["decode"] == "http://d1" and entry["tokens"] == 32
    assert 0 < entry["expires_in_s"] <= 30


# --- across routers --------------------------------------------------------------------------


async def test_routers_race_for_one_hold(make_store: MakeStore) -> None:
    routers = [await make_store() for _ in range(4)]
    for rep in range(50):
        key: Key = ("tenant-a", f"race-{rep}", "main")
        assert await routers[rep % 4].put_hold(key, hold(1))
        starts = await asyncio.gather(*(r.begin_turn(key) for r in routers))
        assert sum(s.hold is not None for s in starts) == 1, rep
        assert sorted(s.turn for s in starts) == [1, 2, 3, 4]


@pytest.mark.parametrize("backend", ["memory", "redis"])
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    ops=st.lists(
        st.tuples(st.integers(0, 3), st.one_of(st.none(), st.integers(0, 6))),
        min_size=1,
        max_size=25,
    )
)
def test_any_interleaving_takes_once_and_keeps_the_newest(
    backend: str, redis_server: RedisServer, ops: list[tuple[int, int | None]]
) -> None:
    """Router ``r`` files a hold of turn ``t`` (None: starts a turn, taking whatever is
    there). A model with one slot says what each step must see."""

    async def run() -> None:
        cluster = f"prop{next(names)}"
        if backend == "memory":
            shared = MemoryIndexStore(30.0)
            routers: list[SessionStore] = [shared] * 4
        else:
            routers = [
                RedisIndexStore.from_url(redis_server.url, hold_ttl_s=30.0, cluster=cluster)
                for _ in range(4)
            ]
            if backend == "guarded":
                routers = [GuardedStore(r) for r in routers]
        slot: int | None = None
        try:
            for r, turn in ops:
                if turn is None:
                    got = (await routers[r].begin_turn(KEY)).hold
                    assert (got.turn if got else None) == slot
                    slot = None
                else:
                    filed = await routers[r].put_hold(KEY, hold(turn))
                    assert filed == (slot is None or slot <= turn)
                    slot = turn if filed else slot
        finally:
            if backend != "memory":
                for store in routers:
                    await store.close()

    asyncio.run(run())
