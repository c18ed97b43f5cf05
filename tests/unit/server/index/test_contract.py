"""One contract for every :class:`~server.index.base.IndexStore` backend: the embedded one and
the Redis one on a real redis-server (tests/redis_server.py). Each Redis test gets its own
``cluster`` name, so no two tests share a key; the Redis-only tests at the end check what the
contract cannot say (TTLs on every key, tampered values, schema, outages, round trips)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.index import IndexUnavailable, InstanceRecord, open_store
from server.index.base import MAX_SESSION_INSTANCES, Hold, IndexStore, Key, chain_of
from server.index.guarded import GuardedStore
from server.index.memory import MemoryIndexStore
from server.index.redis_store import (
    RedisIndexStore,
    digest,
    redact,
)
from tests.redis_server import RedisServer
from tests.unit.waiting import HANG_GUARD_S

_names = itertools.count()
#: A chain length well past anything a small pipeline or script loop special-cases.
LONG = 128
KEY: Key = ("tenant-a", "sess:1", "main")
MakeStore = Callable[..., Awaitable[IndexStore]]
#: A TTL the expiry tests let run out. The embedded index runs on the test's clock (moved, never
#: slept on); Redis keeps TTLs on its own clock, so there the test waits for the state, and this
#: leaves the check made before it runs out a second of margin on a loaded machine.
TTL_S = 1.0
#: Just under a TTL (exact in binary, so ``start + TTL_S - JUST`` is below ``start + TTL_S``).
JUST = 2**-10


class FakeClock:
    """The embedded index's clock in these tests: it moves only when the test moves it."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def hold(turn: int, *, url: str = "http://d1", hashes: list[str] | None = None) -> Hold:
    params = {"remote_num_tokens": 32, "token_ids": list(range(40)), "turn": turn}
    if hashes is not None:
        params["kvbranch_block_hashes"] = hashes
    return Hold(url, "d1-id", params, turn=turn)


def member(iid: str, *, gen: int = 1, role: str = "prefill", load: int = 0) -> InstanceRecord:
    return InstanceRecord(
        instance_id=iid,
        url=f"http://{iid}",
        role=role,  # type: ignore[arg-type]
        model="m",
        block_size=16,
        nixl="127.0.0.1:5600",
        generation=gen,
        load=load,
        kv_usage=0.25,
        engines=2,
        started_at=1700000000.125,
    )


@pytest.fixture(params=["memory", "redis", "guarded"])
def backend(request: pytest.FixtureRequest) -> str:
    """``guarded``: the Redis store behind the circuit breaker, as ``open_store`` makes it for
    production; every contract test runs on it too, so each forwarding method is checked."""
    return str(request.param)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def run_out(
    backend: str, clock: FakeClock, still_there: Callable[[], Awaitable[bool]]
) -> None:
    """Let a TTL of ``TTL_S`` that started at ``clock.now`` run out: the embedded index's
    clock is moved to just before it (``still_there`` must hold) and then to it; with Redis,
    ``still_there`` must hold now and stop holding within a hang guard."""
    start = clock.now
    if backend == "memory":
        clock.now = start + TTL_S - JUST
        assert await still_there(), "expired before its TTL"
        clock.now = start + TTL_S
        assert not await still_there(), "still there when its TTL ran out"
        return
    assert await still_there(), "expired before its TTL"
    deadline = time.monotonic() + TTL_S + HANG_GUARD_S
    while await still_there():
        assert time.monotonic() < deadline, "never expired"
        await asyncio.sleep(0.05)


@pytest.fixture
async def make_store(
    backend: str, clock: FakeClock, request: pytest.FixtureRequest
) -> AsyncIterator[MakeStore]:
    """Stores of one index: for Redis each call is another router (its own connections) on
    this test's cluster name; the embedded index lives in one process, so its "routers" share
    the one object."""
    cluster = f"t{next(_names)}-{int(time.time() * 1000) % 10**8}"
    made: list[IndexStore] = []
    memory: dict[float, MemoryIndexStore] = {}

    async def make(hold_ttl_s: float = 30.0, **kwargs: float) -> IndexStore:
        if backend == "memory":
            if hold_ttl_s not in memory:
                memory[hold_ttl_s] = MemoryIndexStore(hold_ttl_s, clock=clock, **kwargs)  # type: ignore[arg-type]
            return memory[hold_ttl_s]
        server: RedisServer = request.getfixturevalue("redis_server")
        redis = RedisIndexStore.from_url(
            server.url, hold_ttl_s=hold_ttl_s, cluster=cluster, **kwargs
        )
        store: IndexStore = GuardedStore(redis) if backend == "guarded" else redis
        await store.ping()
        made.append(store)
        return store

    yield make
    for store in made:
        await store.close()


@pytest.fixture
async def store(make_store: MakeStore) -> IndexStore:
    return await make_store()


# --- session level ---------------------------------------------------------------------------


async def test_turn_numbers_increase_per_branch(store: IndexStore) -> None:
    assert [(await store.begin_turn(KEY)).turn for _ in range(3)] == [1, 2, 3]
    assert (await store.begin_turn(("tenant-a", "sess:1", "alt"))).turn == 1
    assert (await store.begin_turn(("tenant-b", "sess:1", "main"))).turn == 1


async def test_take_is_single_use(store: IndexStore) -> None:
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


async def test_older_turn_never_replaces_newer(store: IndexStore) -> None:
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


async def test_chain_round_trip(store: IndexStore) -> None:
    hashes = [(b"\x01" * 24 + i.to_bytes(8, "big")).hex() for i in (7, 2**64 - 1, 0, 12345)]
    assert await store.put_hold(KEY, hold(1, hashes=hashes))
    want = chain_of(hold(1, hashes=hashes).params)
    assert want == [7, 2**64 - 1, 0, 12345]
    assert (await store.begin_turn(KEY)).chain == want
    assert (await store.begin_turn(KEY)).chain == want  # outlives the hold
    assert (await store.begin_turn(("tenant-a", "sess:1", "alt"))).chain == []


async def test_home(store: IndexStore) -> None:
    assert (await store.begin_turn(KEY)).home is None
    await store.set_home("tenant-a", "sess:1", "p-7")
    assert (await store.begin_turn(KEY)).home == "p-7"
    assert (await store.begin_turn(("tenant-a", "sess:1", "other-branch"))).home == "p-7"
    assert (await store.begin_turn(("tenant-b", "sess:1", "main"))).home is None


async def test_session_placement_is_capped(store: IndexStore) -> None:
    assert await store.session_instances("tenant-a", "sess:1") == set()
    await store.set_home("tenant-a", "sess:1", "home-is-not-an-instance-entry")
    await store.add_session_instances("tenant-a", "sess:1", ["p1", "d1", "p1"])
    assert await store.session_instances("tenant-a", "sess:1") == {"p1", "d1"}
    many = [f"x{i}" for i in range(MAX_SESSION_INSTANCES + 10)]
    await store.add_session_instances("tenant-a", "sess:1", many)
    have = await store.session_instances("tenant-a", "sess:1")
    assert len(have) == MAX_SESSION_INSTANCES and {"p1", "d1"} <= have
    assert await store.session_instances("tenant-a", "sess:2") == set()


async def test_drop_session_drops_its_holds(store: IndexStore) -> None:
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


async def test_snapshot_lists_live_holds(store: IndexStore) -> None:
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


# --- instance level --------------------------------------------------------------------------


async def test_membership(store: IndexStore) -> None:
    assert await store.members() == []
    await store.heartbeat(member("p1"), 30)
    await store.heartbeat(member("d1", role="decode"), 30)
    assert sorted(await store.members(), key=lambda r: r.instance_id) == [
        member("d1", role="decode"),
        member("p1"),
    ]
    await store.heartbeat(member("p1", load=9, gen=2), 30)
    by_id = {r.instance_id: r for r in await store.members()}
    assert (by_id["p1"].load, by_id["p1"].generation) == (9, 2)
    await store.deregister("p1")
    assert [r.instance_id for r in await store.members()] == ["d1"]


async def test_membership_expires(store: IndexStore, backend: str, clock: FakeClock) -> None:
    await store.heartbeat(member("p1"), TTL_S)
    await store.heartbeat(member("p2"), 30)

    async def both_listed() -> bool:
        return len(await store.members()) == 2

    await run_out(backend, clock, both_listed)
    assert [r.instance_id for r in await store.members()] == ["p2"]
    await store.heartbeat(member("p1"), 30)  # back after a pause
    assert len(await store.members()) == 2


# --- block level -----------------------------------------------------------------------------


async def test_block_hits_prefix_tier_generation(store: IndexStore) -> None:
    p1, p2 = member("p1", gen=1), member("p2", gen=1)
    await store.publish_blocks("p1", 1, "device", [1, 2, 3, 4], [])
    await store.publish_blocks("p1", 1, "host", [1, 2], [])
    await store.publish_blocks("p2", 1, "device", [2, 3], [])  # not a prefix: no hit
    hits = await store.block_hits([1, 2, 3, 4, 5], [p1, p2])
    assert (hits["p1"].device, hits["p1"].host, hits["p1"].best) == (4, 2, 4)
    assert (hits["p2"].device, hits["p2"].host) == (0, 0)
    assert (await store.block_hits([9, 1, 2], [p1]))["p1"].best == 0
    # a member with another generation (or identity) sees none of the old entries
    assert (await store.block_hits([1, 2], [member("p1", gen=2)]))["p1"].best == 0
    assert (await store.block_hits([1, 2], [member("p9")]))["p9"].best == 0
    # a removed block ends the prefix; the host tier is another record
    await store.publish_blocks("p1", 1, "device", [], [3])
    hits = await store.block_hits([1, 2, 3, 4], [p1])
    assert (hits["p1"].device, hits["p1"].host) == (2, 2)
    # after a generation bump only the new entries count
    await store.publish_blocks("p1", 2, "device", [1], [])
    hits = await store.block_hits([1, 2], [member("p1", gen=2)])
    assert (hits["p1"].device, hits["p1"].host) == (1, 0)
    assert await store.block_hits([], [p1]) == {"p1": hits["p1"].__class__()}
    assert await store.block_hits([1, 2], []) == {}


async def test_block_hits_long_chain(store: IndexStore) -> None:
    n = LONG * 2 + 37
    chain = [(i * 0x9E3779B97F4A7C15) % 2**64 for i in range(1, n + 1)]
    await store.publish_blocks("p1", 1, "device", chain, [])
    await store.publish_blocks("p2", 1, "device", chain[: LONG + 5], [])
    await store.publish_blocks("p3", 1, "host", chain[:10], [])
    hits = await store.block_hits(chain, [member("p1"), member("p2"), member("p3")])
    assert hits["p1"].device == n
    assert hits["p2"].device == LONG + 5
    assert (hits["p3"].device, hits["p3"].host) == (0, 10)


async def test_block_hits_many_members(store: IndexStore) -> None:
    """More (member, tier) pairs than one lookup script call compares."""
    fleet = [member(f"p{i}") for i in range(300)]
    await store.publish_blocks("p299", 1, "host", [5, 6], [])
    await store.publish_blocks("p0", 1, "device", [5], [])
    hits = await store.block_hits([5, 6, 7], fleet)
    assert len(hits) == 300 and (hits["p299"].host, hits["p0"].device) == (2, 1)
    assert sum(h.best for h in hits.values()) == 3


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
        cluster = f"prop{next(_names)}"
        if backend == "memory":
            shared = MemoryIndexStore(30.0)
            routers: list[IndexStore] = [shared] * 4
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


# --- Redis only ------------------------------------------------------------------------------


@pytest.fixture
async def raw_redis(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A plain client on the test's Redis, to read and tamper with what the store wrote."""
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.mark.parametrize("backend", ["redis"])
async def test_redis_every_key_has_a_ttl(make_store: MakeStore, raw_redis: aioredis.Redis) -> None:
    store = await make_store()
    assert isinstance(store, RedisIndexStore)
    hashes = [(i.to_bytes(32, "big")).hex() for i in range(3)]
    await store.put_hold(KEY, hold(1, hashes=hashes))
    await store.put_hold(("tenant-a", "sess:1", "alt"), hold(1))
    await store.begin_turn(KEY)
    await store.begin_turn(("tenant-a", "sess:9", "main"))
    await store.set_home("tenant-a", "sess:1", "p1")
    await store.add_session_instances("tenant-a", "sess:1", ["p1", "d1"])
    await store.heartbeat(member("p1"), 10)
    await store.publish_blocks("p1", 1, "device", [1, 2, 3], [2])
    await store.publish_blocks("p1", 1, "host", [4], [])
    await store.members()
    keys = [k async for k in raw_redis.scan_iter(match=store.keys.prefix + "*")]  # tests only
    assert len(keys) >= 10
    ttls = {k: await raw_redis.pttl(k) for k in keys}
    assert all(t > 0 for t in ttls.values()), ttls
    # no tenant, session or branch text in any key name
    assert not [k for k in keys if b"tenant-a" in k or b"sess:1" in k or b"main" in k]


@pytest.mark.parametrize("backend", ["redis"])
async def test_redis_tampered_values_read_as_absent(
    make_store: MakeStore, raw_redis: aioredis.Redis
) -> None:
    store = await make_store()
    assert isinstance(store, RedisIndexStore)
    ss, sb = digest(*KEY[:2]), digest(*KEY)
    junks = (b"\x00garbage\xff", b"%016x" % 1 + b"not zlib", b"", b"f" * 16)
    for junk in junks:
        await store.put_hold(KEY, hold(1))
        await raw_redis.set(store.keys.hold(ss, sb), junk)
        start = await store.begin_turn(KEY)
        assert start.hold is None
        assert await store.put_hold(KEY, hold(1))  # junk never blocks a new hold
        await store.begin_turn(KEY)
    await raw_redis.set(store.keys.turn(ss, sb), b"not a number")
    assert (await store.begin_turn(KEY)).turn == 1  # a tampered counter restarts
    assert (await store.begin_turn(KEY)).turn == 2
    await raw_redis.set(store.keys.chain(ss, sb), b"odd length")
    assert (await store.begin_turn(KEY)).chain == []
    # Each junk hold was read once; a tampered counter or chain is not a hold and not counted.
    assert store.counters()["corrupt"] == len(junks)


@pytest.mark.parametrize("backend", ["redis"])
async def test_redis_holds_are_sealed_and_bound_to_their_key(
    make_store: MakeStore, redis_server: RedisServer, raw_redis: aioredis.Redis
) -> None:
    """No token id in the clear; a value moved to another branch's key, or read by a router
    with another cluster secret, is no hold (a recompute)."""
    store = await make_store()
    assert isinstance(store, RedisIndexStore)
    params = {"remote_num_tokens": 3, "kvbranch_token_ids": [918273, 645321, 777001]}
    other = (KEY[0], KEY[1], "other-branch")
    await store.put_hold(KEY, Hold("http://d1", "iid", params, turn=1))
    ss = digest(*KEY[:2])
    raw = await raw_redis.get(store.keys.hold(ss, digest(*KEY)))
    assert raw is not None and b"918273" not in raw and b"918273" not in zlib_any(raw)
    await raw_redis.set(store.keys.hold(ss, digest(*other)), raw, px=60_000)
    assert (await store.begin_turn(other)).hold is None  # moved: does not open
    stranger = RedisIndexStore.from_url(
        redis_server.url, hold_ttl_s=30.0, cluster=store.keys.cluster, secret=b"another"
    )
    try:
        assert (await stranger.begin_turn(KEY)).hold is None
    finally:
        await stranger.close()


def zlib_any(raw: bytes) -> bytes:
    """``raw`` inflated from any offset that inflates (b"" when none does)."""
    import zlib

    for i in range(len(raw)):
        try:
            return zlib.decompress(raw[i:])
        except zlib.error:
            continue
    return b""


@pytest.mark.parametrize("backend", ["redis"])
async def test_redis_schema_mismatch(make_store: MakeStore, raw_redis: aioredis.Redis) -> None:
    store = await make_store()
    assert isinstance(store, RedisIndexStore)
    assert await raw_redis.get(store.keys.schema()) == b"1"
    await raw_redis.set(store.keys.schema(), b"2")
    with pytest.raises(IndexUnavailable, match="speaks schema 2, expected 1"):
        await store.ping()


@pytest.mark.parametrize("backend", ["redis"])
async def test_redis_round_trips(make_store: MakeStore) -> None:
    store = await make_store()
    assert isinstance(store, RedisIndexStore)
    await store.put_hold(KEY, hold(0))  # loads the script (EVALSHA misses once)

    def trips() -> int:
        return store.counters()["round_trips"]

    before = trips()
    await store.put_hold(KEY, hold(1))
    assert trips() - before == 1
    before = trips()
    await store.begin_turn(KEY)
    assert trips() - before == 1
    chain = list(range(1, 1001))
    await store.publish_blocks("p1", 1, "device", chain, [])
    await store.block_hits([1], [member("p1")])  # loads the lookup script
    before = trips()
    assert (await store.block_hits(chain, [member("p1")]))["p1"].device == 1000
    assert trips() - before == 1
    before = trips()
    assert (await store.block_hits([1, 2, 5000] + chain, [member("p1")]))["p1"].device == 2
    assert trips() - before == 1


async def test_redis_outage_fails_fast_and_recovers() -> None:
    with RedisServer() as server:
        store = RedisIndexStore.from_url(server.url, hold_ttl_s=30.0, cluster="outage")
        try:
            await store.ping()
            await store.put_hold(KEY, hold(1))
            server.kill()
            for call in (store.begin_turn(KEY), store.put_hold(KEY, hold(2)), store.members()):
                began = time.monotonic()
                with pytest.raises(IndexUnavailable):
                    await call
                assert time.monotonic() - began < 3.0
            with pytest.raises(IndexUnavailable, match="^cannot reach Redis at unix://"):
                await store.ping()
            server.start()  # empty: nothing was saved
            await store.ping()
            assert (await store.begin_turn(KEY)).hold is None
            assert await store.put_hold(KEY, hold(3))
            got = (await store.begin_turn(KEY)).hold
            assert got is not None and got.turn == 3
        finally:
            await store.close()


def test_redis_urls_and_names() -> None:
    for url in ("redis://localhost:6379/0", "rediss://h:6380/2", "unix:///tmp/x.sock"):
        store = open_store(url, hold_ttl_s=5.0, cluster="c1")
        inner = getattr(store, "inner", store)  # behind the circuit breaker (guarded.py)
        assert isinstance(inner, RedisIndexStore) and store.kind == "redis"
    assert redact("redis://u:secret@h:1/0") == "redis://u:***@h:1/0"
    assert "secret" not in RedisIndexStore.from_url("redis://:secret@h:1/0", hold_ttl_s=1.0).url
    with pytest.raises(ValueError):
        RedisIndexStore.from_url("redis://h", hold_ttl_s=1.0, cluster="a{b}")
    assert digest("a\0b", "c") != digest("a", "b\0c")
    assert len(digest("t", "s", "b")) == 32
