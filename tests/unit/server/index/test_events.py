"""The KV-event consumer against vLLM's own ``ZmqEventPublisher`` (pure Python, ipc endpoints in a
temporary folder) and the embedded index."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from vllm.distributed.kv_events import ZmqEventPublisher

from server.connector.vllm_compat import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from server.index import InstanceRecord, MemoryIndexStore
from server.index.events import EventConsumer, Generation, hash64, tier_of
from tests.unit.waiting import until

IID = "inst-1"


def stored(hashes: list[int], medium: str = "GPU") -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=[],
        block_size=128,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def batch(*events: object) -> KVEventBatch:
    return KVEventBatch(ts=time.time(), events=list(events))


class Rig:
    def __init__(self, folder: str) -> None:
        self.endpoint = f"ipc://{folder}/ev.sock"
        self.replay = f"ipc://{folder}/rp.sock"
        self.store = MemoryIndexStore(30.0)
        self.publisher = self.new_publisher()
        self.consumer = EventConsumer(
            self.endpoint, self.replay, self.sink, topic="kvb", generation=Generation()
        )
        self.task: asyncio.Task[None] | None = None

    def new_publisher(self) -> ZmqEventPublisher:
        return ZmqEventPublisher(
            0, endpoint=self.endpoint, replay_endpoint=self.replay, topic="kvb"
        )

    async def sink(self, gen: int, tier: str, s: list[int], r: list[int]) -> None:
        await self.store.publish_blocks(IID, gen, tier, s, r)  # type: ignore[arg-type]

    async def start(self) -> None:
        self.task = asyncio.create_task(self.consumer.run())
        await asyncio.sleep(0.3)  # SUB's subscription reaches PUB (else PUB drops)

    async def hits(self, chain: list[int]) -> tuple[int, int]:
        member = InstanceRecord(IID, "http://x", "both", generation=self.consumer.generation.value)
        got = (await self.store.block_hits(chain, [member]))[IID]
        return got.device, got.host

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.publisher.shutdown()


@pytest.fixture
async def rig(tmp_path):
    r = Rig(str(tmp_path))
    yield r
    await r.close()


def test_hash_and_tier_mapping():
    digest = bytes(range(32))
    assert hash64(digest) == int.from_bytes(digest[-8:], "big")
    assert hash64(5) == 5
    assert tier_of("CPU") == "host"
    assert tier_of("GPU") == tier_of(None) == "device"


async def test_stored_and_removed_reach_the_index(rig):
    await rig.start()
    rig.publisher.publish(batch(stored([1, 2, 3]), stored([1, 2], medium="CPU")))
    await until(lambda: rig.consumer.last_seq == 0)
    assert await rig.hits([1, 2, 3]) == (3, 2)
    rig.publisher.publish(batch(BlockRemoved(block_hashes=[2], medium="GPU")))
    await until(lambda: rig.consumer.last_seq == 1)
    assert await rig.hits([1, 2, 3]) == (1, 2)
    assert rig.consumer.counters.block_size == {"device": 128, "host": 128}
    assert rig.consumer.generation.value == 0


async def test_store_then_remove_in_one_batch_ends_removed(rig):
    await rig.start()
    rig.publisher.publish(batch(stored([7]), BlockRemoved(block_hashes=[7], medium="GPU")))
    await until(lambda: rig.consumer.last_seq == 0)
    assert await rig.hits([7]) == (0, 0)


async def test_bytes_hashes_are_low_64_bits(rig):
    await rig.start()
    digest = bytes(range(32))
    rig.publisher.publish(batch(stored([digest])))  # type: ignore[list-item]
    await until(lambda: rig.consumer.last_seq == 0)
    assert await rig.hits([int.from_bytes(digest[-8:], "big")]) == (1, 0)


async def test_dropped_messages_are_replayed(rig):
    # Published before the consumer subscribed: lost on PUB/SUB, kept in the ring.
    for h in (11, 12, 13):
        rig.publisher.publish(batch(stored([h])))
    await asyncio.sleep(0.2)
    await rig.start()
    rig.publisher.publish(batch(stored([14])))
    await until(lambda: rig.consumer.last_seq == 3)
    assert rig.consumer.counters.replays == 1
    assert rig.consumer.counters.replayed_batches >= 3
    assert rig.consumer.generation.value == 0  # the replay was complete
    assert await rig.hits([11, 12, 13, 14]) == (4, 0)
    # The stream's own copy of what the replay applied is a duplicate, not a restart.
    rig.publisher.publish(batch(stored([15])))
    await until(lambda: rig.consumer.last_seq == 4)
    assert rig.consumer.counters.restarts == 0
    assert await rig.hits([11, 12, 13, 14, 15]) == (5, 0)


async def test_replay_that_times_out_bumps_the_generation(rig):
    consumer = EventConsumer(
        rig.endpoint, f"{rig.replay}-nobody", rig.sink, topic="kvb", replay_timeout_s=0.2
    )
    rig.consumer = consumer
    await rig.start()
    rig.publisher.publish(batch(stored([1])))
    await until(lambda: consumer.last_seq == 0)
    # Seqs 1-4 lost, and nobody answers the replay.
    await consumer.on_message(5, msgspec.msgpack.encode(batch(stored([2]))))
    assert consumer.last_seq == 5
    assert consumer.counters.replay_failures == 1
    assert consumer.generation.value == 1
    assert await rig.hits([2]) == (1, 0)


async def test_restarted_publisher_bumps_the_generation(rig):
    await rig.start()
    for h in (21, 22, 23):
        rig.publisher.publish(batch(stored([h])))
    await until(lambda: rig.consumer.last_seq == 2)
    assert await rig.hits([21, 22, 23]) == (3, 0)
    rig.publisher.shutdown()
    rig.publisher = rig.new_publisher()  # a new engine process: seq from 0 again
    await asyncio.sleep(0.5)  # the SUB reconnects
    for h in (31, 32):  # seqs 0 and 1, both at or below the last one seen
        rig.publisher.publish(batch(stored([h])))
        try:
            await until(lambda: rig.consumer.counters.restarts == 1, timeout_s=1.5)
            break
        except AssertionError:
            continue
    assert rig.consumer.counters.restarts == 1
    assert rig.consumer.generation.value == 1
    # Entries of the old generation are invisible; the new ones count.
    assert await rig.hits([21, 22, 23]) == (0, 0)
    new = 31 if rig.consumer.last_seq == 0 else 32
    assert await rig.hits([new]) == (1, 0)


async def test_all_blocks_cleared_bumps_the_generation(rig):
    await rig.start()
    rig.publisher.publish(batch(stored([41, 42])))
    await until(lambda: rig.consumer.last_seq == 0)
    rig.publisher.publish(batch(AllBlocksCleared(), stored([43])))
    await until(lambda: rig.consumer.last_seq == 1)
    assert rig.consumer.counters.cleared == 1
    assert rig.consumer.generation.value == 1
    assert await rig.hits([41]) == (0, 0)
    assert await rig.hits([43]) == (1, 0)


async def test_undecodable_batch_bumps_the_generation(rig):
    await rig.start()
    await rig.consumer.on_message(0, b"\xc1not msgpack")
    assert rig.consumer.counters.undecodable == 1
    assert rig.consumer.generation.value == 1


def test_host_store_logs_saves_evictions_and_resets_only_when_enabled():
    from server.connector.core.block_index import HostBlockIndex, StoreEventLog
    from server.connector.engine.connector import host_events

    index = HostBlockIndex(2)
    index.allocate(b"\x00" * 31 + b"\x09", [1])  # no log: nothing recorded
    index.event_log = StoreEventLog(cap=10)
    a, b = b"\x01" * 32, b"\x02" * 32
    index.allocate(a, [1])  # fills the second slot
    index.allocate_tail(b"tail-key", b"parent", [2])  # evicts the first block; a tail: silent
    index.allocate(b, [3])  # evicts a
    index.clear_all()
    changes = index.event_log.take()
    assert changes == [
        ("stored", a),
        ("removed", b"\x00" * 31 + b"\x09"),
        ("removed", a),
        ("stored", b),
        ("cleared", None),
    ]
    events = host_events(changes, 128)
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["BlockStored", "BlockRemoved", "BlockStored", "AllBlocksCleared"]
    assert events[0].medium == "CPU" and events[0].token_ids == [] and events[0].block_size == 128
    assert events[1].block_hashes == [9, hash64(a)]
    log = StoreEventLog(cap=2)
    for i in range(3):
        log.add(("stored", bytes([i])))
    assert log.dropped == 1 and [h for _, h in log.take()] == [b"\x01", b"\x02"]
