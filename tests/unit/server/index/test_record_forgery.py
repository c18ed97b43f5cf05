"""Redis as a hostile store: records written straight into a real redis-server by someone who can
write to it but lacks the cluster secret never reach the router's pool.

An instance heartbeats through the real publisher and the production store (``open_store``:
the Redis backend behind its circuit breaker); the attacker adds records of its own with a raw
Redis client. The pool's membership read must list the instance and nothing else, count every
refused record in its metric, and warn once (rate-limited), not once per record. The fake
transport answers every probe 200 with JSON, as an attacker's server would: only the seal keeps
its URL out.
"""

from __future__ import annotations

import itertools
import logging
import time

import httpx
import pytest
import redis.asyncio as aioredis
from prometheus_client import CollectorRegistry

from server.index import IndexStore, InstanceRecord, open_store, record_seal
from server.index.guarded import GuardedStore
from server.index.publisher import IndexPublisher
from server.index.redis_store import RedisIndexStore
from server.router.pool import Pool
from tests.redis_server import RedisServer

SECRET = b"the cluster's secret, 32 bytes.."
GENUINE = "http://10.0.0.5:8000"
EVIL = "http://attacker.example:8000"
_names = itertools.count()


def answer_everything(request: httpx.Request) -> httpx.Response:
    return httpx.Response(200, json={"instance_id": f"iid@{request.url.host}"})


def genuine_record() -> InstanceRecord:
    return InstanceRecord("iid-genuine", GENUINE, "prefill", model="m", block_size=16)


async def write_raw(
    client: aioredis.Redis, store: RedisIndexStore, iid: str, fields: dict[str, str]
) -> None:
    """What a Redis writer can do without the secret: an instance hash and a members entry,
    live for a minute by Redis's own clock."""
    seconds, micros = await client.time()
    expiry_ms = seconds * 1000 + micros // 1000 + 60_000
    await client.hset(store.keys.instance(iid), mapping=fields)  # type: ignore[arg-type]
    await client.pexpire(store.keys.instance(iid), 60_000)
    await client.zadd(store.keys.members(), {iid: expiry_ms})


def fields_of(rec: InstanceRecord) -> dict[str, str]:
    return {
        "url": rec.url,
        "role": rec.role,
        "model": rec.model,
        "block_size": str(rec.block_size),
        "nixl": rec.nixl,
        "generation": str(rec.generation),
        "host_generation": str(rec.host_generation),
        "load": str(rec.load),
        "kv_usage": repr(rec.kv_usage),
        "engines": str(rec.engines),
        "started_at": repr(rec.started_at),
        "mac": rec.mac,
    }


@pytest.fixture
async def shared(redis_server: RedisServer):
    store = open_store(
        redis_server.url, hold_ttl_s=30.0, cluster=f"forge{next(_names)}-{time.time_ns() % 10**9}"
    )
    await store.ping()
    client = aioredis.Redis.from_url(redis_server.url)
    yield store, client
    await client.aclose()
    await store.close()


def redis_of(store: IndexStore) -> RedisIndexStore:
    assert isinstance(store, GuardedStore) and isinstance(store.inner, RedisIndexStore)
    return store.inner


def refused_metric(registry: CollectorRegistry) -> float:
    value = registry.get_sample_value("kvbranch_router_index_records_refused_total")
    return -1.0 if value is None else value


async def test_records_without_a_valid_seal_never_reach_the_pool(shared, caplog) -> None:
    store, client = shared
    raw = redis_of(store)
    publisher = IndexPublisher(store, genuine_record, [], secret=SECRET)
    await publisher.heartbeat()  # the real instance, sealed by the real publisher

    sealed = record_seal.seal(genuine_record(), SECRET)
    forged = {
        # a brand-new instance, no seal at all
        "evil-1": fields_of(InstanceRecord("evil-1", EVIL, "prefill")),
        # a made-up seal
        "evil-2": {**fields_of(InstanceRecord("evil-2", EVIL, "decode")), "mac": "1.abcd"},
        # the genuine record's seal on another identity with the attacker's URL
        "evil-3": {**fields_of(sealed), "url": EVIL},
        # the genuine record's fields and seal under another identity (a copy): its URL is
        # the genuine one, but the identity is not what the instance sealed
        "evil-4": fields_of(sealed),
    }
    for iid, fields in forged.items():
        await write_raw(client, raw, iid, fields)
    # and one sealed with another cluster's secret, through the store's own heartbeat
    await store.heartbeat(
        record_seal.seal(InstanceRecord("evil-5", EVIL, "decode"), b"another secret"), 10.0
    )

    registry = CollectorRegistry()
    pool = Pool(
        [],
        [],
        client=httpx.AsyncClient(transport=httpx.MockTransport(answer_everything)),
        store=store,
        secret=SECRET,
        registry=registry,
    )
    with caplog.at_level(logging.WARNING, logger="kvbranch.router"):
        for _ in range(3):
            await pool.refresh_members(max_age=0)
    assert [(i.url, i.role) for i in pool.all] == [(GENUINE, "prefill")]
    assert [i.url for i in await pool.live(pool.prefills)] == [GENUINE]
    assert await pool.live(pool.decodes) == []
    assert pool.records_refused == 3 * 5
    assert refused_metric(registry) == 3 * 5
    warnings = [r for r in caplog.records if "seal does not verify" in r.getMessage()]
    assert len(warnings) == 1  # rate-limited: once, not once per record or per read
    assert "another KVBRANCH_CLUSTER_SECRET" in warnings[0].getMessage()


async def test_a_genuine_record_edited_in_redis_is_dropped_not_followed(shared) -> None:
    """The writer rewrites a real instance's URL in place: the router stops following that
    record (the instance is left out: turns recompute elsewhere), and never goes to the URL."""
    store, client = shared
    raw = redis_of(store)
    publisher = IndexPublisher(store, genuine_record, [], secret=SECRET)
    await publisher.heartbeat()
    pool = Pool(
        [],
        [],
        client=httpx.AsyncClient(transport=httpx.MockTransport(answer_everything)),
        store=store,
        secret=SECRET,
    )
    await pool.refresh_members(max_age=0)
    assert [i.url for i in pool.all] == [GENUINE]
    await client.hset(raw.keys.instance("iid-genuine"), "url", EVIL)
    await pool.refresh_members(max_age=0)
    assert EVIL not in [i.url for i in pool.all]
    assert pool.records_refused == 1
    await publisher.heartbeat()  # the instance's next heartbeat restores it
    await pool.refresh_members(max_age=0)
    assert [i.url for i in await pool.live(pool.prefills)] == [GENUINE]
