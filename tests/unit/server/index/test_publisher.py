"""The instance's index publisher against the embedded index: heartbeats, block batches, an
unreachable index, queue overflow, deregistration; plus a real vLLM publisher end to end."""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

import pytest
from vllm.distributed.kv_events import ZmqEventPublisher

from server.connector.vllm_compat import BlockStored, KVEventBatch
from server.index import IndexUnavailable, InstanceRecord, MemoryIndexStore
from server.index.publisher import IndexPublisher, record_factory, role_of, sources_of
from tests.unit.waiting import until

IID = "inst-7"


class FlakyStore(MemoryIndexStore):
    def __init__(self) -> None:
        super().__init__(30.0)
        self.down = False
        self.deregistered: list[str] = []

    async def heartbeat(self, record: InstanceRecord, ttl_s: float) -> None:
        if self.down:
            raise IndexUnavailable("connection refused")
        await super().heartbeat(record, ttl_s)

    async def publish_blocks(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        if self.down:
            raise IndexUnavailable("connection refused")
        await super().publish_blocks(*args, **kwargs)

    async def deregister(self, instance_id: str) -> None:
        self.deregistered.append(instance_id)
        await super().deregister(instance_id)


def record() -> InstanceRecord:
    return InstanceRecord(IID, "http://127.0.0.1:8001", "prefill", model="m", block_size=128)


async def hits(store: MemoryIndexStore, chain: list[int]) -> tuple[int, int]:
    members = {m.instance_id: m for m in await store.members()}
    got = (await store.block_hits(chain, [members[IID]]))[IID]
    return got.device, got.host


@pytest.fixture
async def running():
    store = FlakyStore()
    pub = IndexPublisher(store, record, [], interval_s=0.05)
    task = asyncio.create_task(pub.run())
    yield store, pub, task
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def members_of(store: MemoryIndexStore) -> list[str]:
    return [m.instance_id for m in await store.members()]


async def test_heartbeat_registers_and_shutdown_deregisters(running):
    store, pub, task = running
    await until(lambda: pub.heartbeats_sent >= 2)
    (member,) = await store.members()
    assert (member.instance_id, member.role, member.block_size, member.generation) == (
        IID,
        "prefill",
        128,
        0,
    )
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert store.deregistered == [IID]
    assert await members_of(store) == []


async def test_block_batches_reach_the_index(running):
    store, pub, _ = running
    await pub.sink_of(0, 0, "device", [1, 2, 3], [])
    await pub.sink_of(0, 0, "host", [1, 2], [])
    await pub.sink_of(0, 0, "device", [], [3])
    await until(lambda: pub.batches_applied == 3)
    await until(lambda: pub.heartbeats_sent >= 1)
    assert await hits(store, [1, 2, 3]) == (2, 2)
    assert pub.counters()["hashes_applied"] == 6


async def test_unreachable_index_warns_once_keeps_batches_and_recovers(running, caplog):
    store, pub, _ = running
    await until(lambda: pub.heartbeats_sent >= 1)
    caplog.set_level(logging.WARNING, logger="kvbranch.index.publisher")
    store.down = True
    await pub.sink_of(0, 0, "device", [5, 6], [])
    # A retry while down: the first heartbeat that failed and at least one more (after a
    # back-off of 0.5 s), waited for as a count, not as a time: one warning for both.
    await until(lambda: pub.heartbeats_failed >= 2)
    assert pub.outage and len(pub.pending) == 1
    unreachable = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(unreachable) == 1
    store.down = False
    await until(lambda: not pub.outage and not pub.pending, timeout_s=10)
    assert await hits(store, [5, 6]) == (2, 0)
    assert any("reachable again" in r.getMessage() for r in caplog.records)


async def test_overflow_drops_and_bumps_the_generation():
    store = FlakyStore()
    pub = IndexPublisher(store, record, [], max_pending=2)
    for h in (1, 2, 3):
        await pub.sink_of(0, pub.generation.of("device"), "device", [h], [])
    assert pub.batches_dropped == 3 and not pub.pending
    assert pub.generation.values == {"device": 1, "host": 1}
    await pub.sink_of(0, 0, "device", [9], [])  # consumed under the old generation: stale
    await pub.sink_of(0, 1, "device", [10], [])
    await pub.flush()
    assert pub.batches_stale == 1 and pub.batches_applied == 1
    await pub.heartbeat()
    assert await hits(store, [10]) == (1, 0)
    assert await hits(store, [9]) == (0, 0)


def test_role_and_sources_and_record():
    assert [role_of(r) for r in ("single", "prefill", "decode")] == ["both", "prefill", "decode"]
    on = SimpleNamespace(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint="ipc:///tmp/x/ev.sock",
        replay_endpoint="ipc:///tmp/x/rp.sock",
        topic="kvbranch",
    )
    off = SimpleNamespace(enable_kv_cache_events=False, publisher="zmq", endpoint="tcp://*:5557")
    config = SimpleNamespace(
        kv_events_config=on,
        cache_config=SimpleNamespace(block_size=128),
        parallel_config=SimpleNamespace(data_parallel_size=2),
    )
    client = SimpleNamespace(
        get_kv_event_sources=lambda: {0: on, 1: off},
        vllm_config=config,
        get_num_unfinished_requests=lambda: 3,
    )
    assert sources_of(client) == [("ipc:///tmp/x/ev.sock", "ipc:///tmp/x/rp.sock", "kvbranch")]
    bare = SimpleNamespace(get_kv_event_sources=lambda: {}, vllm_config=config)
    assert len(sources_of(bare)) == 1  # falls back on the configured publisher
    state = SimpleNamespace(instance_id="abc", model_name="m")
    made = record_factory(state, client, "http://127.0.0.1:9", "single")()
    assert (made.role, made.block_size, made.engines, made.load, made.nixl) == (
        "both",
        128,
        2,
        3,
        "",
    )


async def publish_until_applied(
    vllm_pub: ZmqEventPublisher, pub: IndexPublisher, hashes: list[int]
) -> None:
    """Publish host-store blocks ``hashes`` on vLLM's publisher until ``pub`` applied a batch:
    ZMQ drops what is published before the subscriber has joined (waits on its state, not on
    a guess of the join time)."""
    event = BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[],
        block_size=128,
        lora_id=None,
        medium="CPU",
        lora_name=None,
    )
    for _ in range(600):  # the hang guard: 30 s
        vllm_pub.publish(KVEventBatch(ts=time.time(), events=[event]))
        await asyncio.sleep(0.05)
        if pub.batches_applied:
            return


async def test_real_vllm_publisher_end_to_end(tmp_path):
    endpoint, replay = f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/rp.sock"
    vllm_pub = ZmqEventPublisher(0, endpoint=endpoint, replay_endpoint=replay, topic="kvbranch")
    store = FlakyStore()
    pub = IndexPublisher(store, record, [(endpoint, replay, "kvbranch")], interval_s=0.05)
    task = asyncio.create_task(pub.run())
    try:
        await publish_until_applied(vllm_pub, pub, [101, 102])
        await until(lambda: pub.heartbeats_sent >= 1)
        assert await hits(store, [101, 102]) == (0, 2)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        vllm_pub.shutdown()


def test_a_replicas_holds_are_offered_while_its_connector_still_holds_them():
    """The index TTL of the holds an aggregated replica files comes from its own NIXL child's
    hold (the launcher's --pd-hold-ttl-s), less the routers' margin: not vLLM's arguments,
    which have no such field."""
    from types import SimpleNamespace

    from server.index.publisher import DEFAULT_HOLD_TTL_S, index_hold_ttl_s

    def engine(extra):
        transfer = SimpleNamespace(kv_connector_extra_config=extra)
        return SimpleNamespace(vllm_config=SimpleNamespace(kv_transfer_config=transfer))

    nixl = {"kv_connector_extra_config": {"decoder_kv_blocks_ttl": 120}}
    stack = {"connectors": [nixl, {"kv_connector_extra_config": {"host_store_bytes": 1}}]}
    assert index_hold_ttl_s(engine(stack)) == 115.0
    assert index_hold_ttl_s(engine({"decoder_kv_blocks_ttl": 8})) == 4.0
    assert index_hold_ttl_s(engine({})) == DEFAULT_HOLD_TTL_S - 5.0
    assert index_hold_ttl_s(SimpleNamespace()) == DEFAULT_HOLD_TTL_S - 5.0


async def test_each_data_parallel_engine_is_a_member_with_its_own_blocks(tmp_path, monkeypatch):
    """Two engines' real vLLM publishers (engine 1 on its ``_dp1`` ipc sockets): a block engine 1
    stored is listed under engine 1's member only, each member heartbeats with its own NIXL
    side channel, and both leave at shutdown."""
    from server.common.env import ENV_PEER_PULL
    from server.engine import event_endpoints

    original = ZmqEventPublisher.__dict__["offset_endpoint_port"]
    event_endpoints.install()
    monkeypatch.setenv(ENV_PEER_PULL, "1")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_HOST", "127.0.0.1")
    monkeypatch.setenv("VLLM_NIXL_SIDE_CHANNEL_PORT", "18000")
    endpoint, replay = f"ipc://{tmp_path}/ev.sock", f"ipc://{tmp_path}/rp.sock"
    engines = [
        ZmqEventPublisher(rank, endpoint=endpoint, replay_endpoint=replay, topic="kvbranch")
        for rank in (0, 1)
    ]
    configs = {rank: p.get_publisher_config() for rank, p in enumerate(engines)}
    client = SimpleNamespace(
        get_kv_event_sources=lambda: configs,
        vllm_config=SimpleNamespace(
            cache_config=SimpleNamespace(block_size=128),
            parallel_config=SimpleNamespace(data_parallel_size=2),
        ),
        engine_core=SimpleNamespace(lb_engines=[[0, 1], [2, 3]]),
    )
    state = SimpleNamespace(instance_id="abc", model_name="m")
    records = [record_factory(state, client, "http://127.0.0.1:9", "single", e) for e in (0, 1)]
    store = FlakyStore()
    pub = IndexPublisher(store, records, sources_of(client), interval_s=0.05)
    task = asyncio.create_task(pub.run())
    try:
        await publish_until_applied(engines[1], pub, [201])
        await until(lambda: pub.heartbeats_sent >= 1)
        members = {m.instance_id: m for m in await store.members()}
        assert {i: (m.nixl, m.load, m.url) for i, m in members.items()} == {
            "abc-dp0": ("127.0.0.1:18000", 1, "http://127.0.0.1:9"),
            "abc-dp1": ("127.0.0.1:18001", 5, "http://127.0.0.1:9"),
        }
        got = await store.block_hits([201], list(members.values()))
        assert (got["abc-dp0"].host, got["abc-dp1"].host) == (0, 1)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        for p in engines:
            p.shutdown()
        ZmqEventPublisher.offset_endpoint_port = original
    assert sorted(store.deregistered) == ["abc-dp0", "abc-dp1"]


async def test_overflow_bumps_every_members_generation():
    store = FlakyStore()
    pub = IndexPublisher(store, [record, record], [], max_pending=1)
    await pub.sink_of(1, 0, "device", [1], [])
    await pub.sink_of(0, 0, "device", [2], [])
    assert [m.generation.values for m in pub.members] == [{"device": 1, "host": 1}] * 2
