"""The KV-event consumer against vLLM's own ``ZmqEventPublisher`` (pure Python, ipc endpoints in a
temporary folder) and the embedded index."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import suppress

import msgspec
import pytest
import zmq
import zmq.asyncio
from vllm.distributed.kv_events import ZmqEventPublisher

from server.connector.vllm_compat import (
    MEDIUM_CPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ClearedOnMedium,
    KVEventBatch,
)
from server.index import InstanceRecord, MemoryIndexStore
from server.index.events import END_SEQ, EventConsumer, Generation, hash64, tier_of
from tests.unit.waiting import HANG_GUARD_S, until

IID = "inst-1"
#: How long one probe batch is given to reach the consumer before the next goes out: a retry
#: cadence, not a bound (probing goes on until the state comes, or the hang guard).
PROBE_EVERY_S = 0.05


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
        """A publisher on the rig's sockets, counting seqs from 0 (a new engine process)."""
        #: Batches the current publisher was given: the next one's seq.
        self.sent = 0
        return ZmqEventPublisher(
            0, endpoint=self.endpoint, replay_endpoint=self.replay, topic="kvb"
        )

    def publish(self, *events: object) -> int:
        """Hand one batch to the publisher; its seq."""
        self.publisher.publish(batch(*events))
        self.sent += 1
        return self.sent - 1

    async def send(self, *events: object) -> None:
        """Publish one batch and wait until the consumer has applied it."""
        seq = self.publish(*events)
        await until(lambda: self.consumer.last_seq == seq)

    async def probe(self, reached: Callable[[], bool], most: int = 10**6) -> None:
        """Publish empty batches until ``reached()``, at most ``most`` of them in this
        publisher's stream: PUB drops what it sends before the consumer's subscription reaches
        it (its first connection, or its reconnection to a new publisher), and nothing but a
        batch that arrives tells when it has."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + HANG_GUARD_S
        while not reached():
            assert self.sent < most, f"the stream reached the consumer only after seq {most}"
            assert loop.time() < deadline, "the stream never reached the consumer"
            self.publish()
            with suppress(AssertionError):
                await until(reached, timeout_s=PROBE_EVERY_S)

    async def ring_holds(self, seqs: list[int]) -> None:
        """Wait until the publisher's replay ring holds ``seqs``: until then the publisher may
        not have sent them yet."""

        async def poll() -> None:
            while await self.ring_seqs() != seqs:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(poll(), HANG_GUARD_S)

    async def ring_seqs(self) -> list[int]:
        """The seqs the publisher's replay ring holds, asked over its own replay socket."""
        dealer = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay)
        seqs: list[int] = []
        try:
            await dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while True:  # ("", topic, seq, payload) per batch, then one with END_SEQ
                frames = await asyncio.wait_for(dealer.recv_multipart(), HANG_GUARD_S)
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return seqs
                seqs.append(seq)
        finally:
            dealer.close(linger=0)

    async def sink(self, gen: int, tier: str, s: list[int], r: list[int]) -> None:
        await self.store.publish_blocks(IID, gen, tier, s, r)  # type: ignore[arg-type]

    async def start(self) -> None:
        """Run the consumer; return once the stream reaches it and every probe is applied."""
        self.task = asyncio.create_task(self.consumer.run())
        await self.probe(lambda: self.consumer.last_seq >= 0)
        await until(lambda: self.consumer.last_seq == self.sent - 1)

    async def hits(self, chain: list[int]) -> tuple[int, int]:
        gen = self.consumer.generation
        member = InstanceRecord(
            IID, "http://x", "both", generation=gen.of("device"), host_generation=gen.of("host")
        )
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
    await rig.send(stored([1, 2, 3]), stored([1, 2], medium="CPU"))
    assert await rig.hits([1, 2, 3]) == (3, 2)
    await rig.send(BlockRemoved(block_hashes=[2], medium="GPU"))
    assert await rig.hits([1, 2, 3]) == (1, 2)
    assert rig.consumer.counters.block_size == {"device": 128, "host": 128}
    assert rig.consumer.generation.values == {"device": 0, "host": 0}


async def test_store_then_remove_in_one_batch_ends_removed(rig):
    await rig.start()
    await rig.send(stored([7]), BlockRemoved(block_hashes=[7], medium="GPU"))
    assert await rig.hits([7]) == (0, 0)


async def test_bytes_hashes_are_low_64_bits(rig):
    await rig.start()
    digest = bytes(range(32))
    await rig.send(stored([digest]))  # type: ignore[list-item]
    assert await rig.hits([int.from_bytes(digest[-8:], "big")]) == (1, 0)


async def test_dropped_messages_are_replayed(rig):
    # Sent before the consumer subscribed: lost on PUB/SUB, kept in the ring.
    for h in (11, 12, 13):
        rig.publish(stored([h]))
    await rig.ring_holds([0, 1, 2])
    await rig.start()  # the first batch it gets has a gap behind it
    await rig.send(stored([14]))
    assert rig.consumer.counters.replays == 1
    assert rig.consumer.counters.replayed_batches >= 3
    assert rig.consumer.generation.of("device") == 0  # the replay was complete
    assert await rig.hits([11, 12, 13, 14]) == (4, 0)
    # The stream's own copy of what the replay applied is a duplicate, not a restart.
    await rig.send(stored([15]))
    assert rig.consumer.counters.restarts == 0
    assert await rig.hits([11, 12, 13, 14, 15]) == (5, 0)


async def test_replay_that_times_out_bumps_the_generation(rig):
    consumer = EventConsumer(
        rig.endpoint, f"{rig.replay}-nobody", rig.sink, topic="kvb", replay_timeout_s=0.2
    )
    rig.consumer = consumer
    await rig.start()  # a probe lost on the way in costs a failed replay too: counted from here
    await rig.send(stored([1]))
    failures, before = consumer.counters.replay_failures, dict(consumer.generation.values)
    # Four seqs lost, and nobody answers the replay.
    lost = consumer.last_seq + 5
    await consumer.on_message(lost, msgspec.msgpack.encode(batch(stored([2]))))
    assert consumer.last_seq == lost
    assert consumer.counters.replay_failures == failures + 1
    assert consumer.generation.values == {t: g + 1 for t, g in before.items()}  # both tiers
    assert await rig.hits([2]) == (1, 0)


async def test_restarted_publisher_bumps_the_generation(rig):
    await rig.start()
    for h in (21, 22, 23):
        await rig.send(stored([h]))
    assert await rig.hits([21, 22, 23]) == (3, 0)
    # The new stream reads as a restart while its seqs are at or below the old one's last: the
    # old one goes on long enough that the SUB may take the whole hang guard to reconnect.
    room = int(HANG_GUARD_S / PROBE_EVERY_S)
    for _ in range(room):
        rig.publish()
    await until(lambda: rig.consumer.last_seq == rig.sent - 1)
    rig.publisher.shutdown()
    rig.publisher = rig.new_publisher()  # a new engine process: seq from 0 again
    await rig.probe(lambda: rig.consumer.counters.restarts == 1, most=room)
    assert rig.consumer.counters.restarts == 1
    assert rig.consumer.generation.values == {"device": 1, "host": 1}
    # Entries of the old generation are invisible; the new ones count.
    assert await rig.hits([21, 22, 23]) == (0, 0)
    await rig.send(stored([31]))
    assert await rig.hits([31]) == (1, 0)


async def test_a_device_reset_hides_the_device_tier_only(rig):
    """vLLM's own ``AllBlocksCleared`` (no medium): the device cache was emptied, the host
    store was not, so its entries stay visible."""
    await rig.start()
    await rig.send(stored([41, 42]), stored([41, 42], medium="CPU"))
    await rig.send(AllBlocksCleared(), stored([43]))
    assert rig.consumer.counters.cleared == 1
    assert rig.consumer.generation.values == {"device": 1, "host": 0}
    assert await rig.hits([41, 42]) == (0, 2)
    assert await rig.hits([43]) == (1, 0)


async def test_a_host_store_reset_hides_the_host_tier_only(rig):
    """The connector's clear (``medium="CPU"``), as its host store's event log sends it."""
    from server.connector.engine.connector import host_events

    await rig.start()
    await rig.send(stored([51, 52]), stored([51, 52], medium="CPU"))
    await rig.send(*host_events([("cleared", None)], 128), stored([53], medium="CPU"))
    assert rig.consumer.counters.cleared == 1
    assert rig.consumer.generation.values == {"device": 0, "host": 1}
    assert await rig.hits([51, 52]) == (2, 0)
    assert await rig.hits([53]) == (0, 1)


def test_a_host_clear_reads_as_vllms_own_event_elsewhere():
    """On the wire the connector's clear is an ``AllBlocksCleared`` with one more field:
    vLLM's own decoder reads it unchanged, the index's decoder reads its medium."""
    from server.connector.vllm_compat import MediumEventBatch

    raw = msgspec.msgpack.encode(batch(ClearedOnMedium(medium=MEDIUM_CPU), AllBlocksCleared()))
    theirs = msgspec.msgpack.Decoder(type=KVEventBatch).decode(raw).events
    assert [type(e) for e in theirs] == [AllBlocksCleared, AllBlocksCleared]
    ours = msgspec.msgpack.Decoder(type=MediumEventBatch).decode(raw).events
    assert [tier_of(e.medium) for e in ours] == ["host", "device"]


async def test_undecodable_batch_bumps_the_generation(rig):
    await rig.start()
    await rig.consumer.on_message(rig.sent, b"\xc1not msgpack")  # the stream's next seq
    assert rig.consumer.counters.undecodable == 1
    assert rig.consumer.generation.values == {"device": 1, "host": 1}


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
    assert kinds == ["BlockStored", "BlockRemoved", "BlockStored", "ClearedOnMedium"]
    assert events[-1].medium == "CPU"  # the host tier's clear, not the device's
    assert events[0].medium == "CPU" and events[0].token_ids == [] and events[0].block_size == 128
    assert events[1].block_hashes == [9, hash64(a)]
    log = StoreEventLog(cap=2)
    for i in range(3):
        log.add(("stored", bytes([i])))
    assert log.dropped == 1 and [h for _, h in log.take()] == [b"\x01", b"\x02"]
