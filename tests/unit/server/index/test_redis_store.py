"""What only the Redis backend can be asked: a TTL on every key, no tenant text in key names,
tampered and moved values read as absent, the schema check, round trips, an outage and URLs.
What every backend shares is in the role contract suites (test_*_contract.py)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from server.index import IndexUnavailable, open_store
from server.index.redis_store import RedisIndexStore, digest, redact
from server.index.sessions import Hold
from tests.redis_server import RedisServer
from tests.unit.server.index.backends import KEY, MakeStore, hold, member


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
