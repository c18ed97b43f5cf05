"""A consumer of one vLLM engine's KV event stream (docs/kv_events.md): what the instance's
index publisher feeds into the cluster index.

vLLM 0.32's ``ZmqEventPublisher`` sends each batch on a PUB socket as ``(topic, seq as 8 bytes
big-endian, msgpack(KVEventBatch))``, ``seq`` counting from 0 per publisher process, and keeps
its last batches in a ring it replays over a ROUTER socket: the request is one 8-byte start
seq, the answer one ``("", topic, seq, payload)`` per batch then ``("", "", -1, "")``. PUB/SUB
is lossy, so the consumer:

* tracks the last seq applied; a gap asks the ring for the rest (from last + 1, for at most
  :data:`REPLAY_TIMEOUT_S`), applying only what is newer than the last applied seq;
* a replay that fails, times out, or starts past last + 1 (the ring no longer has them),
  a seq that goes backwards on the stream (the publisher restarted: a new engine process, an
  empty cache) and an undecodable batch bump the *generation* of both tiers: every entry
  published under an older one is invisible to readers at once
  (:meth:`~server.index.blocks.BlockIndex.block_hits` counts only the instance's current one);
* ``AllBlocksCleared`` bumps the generation of its own tier only. vLLM's device reset sends it
  without a medium (the device tier); the connector's host store sends it with ``"CPU"`` when
  the store is cleared (``reset_prefix_cache?reset_external=true``). A device reset leaves the
  host store's blocks in place, so their entries must stay visible, and the other way round.

Events map to tiers by medium: ``"CPU"`` (the connector's host store, and vLLM's own CPU
offload) is ``"host"``, anything else (vLLM labels its device pool ``"GPU"`` even on the CPU
backend) is ``"device"``. Hashes are the low 64 bits of vLLM's block hashes (what vLLM sends
with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``, its default; bytes are converted).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from server.index.blocks import TIERS, Tier

logger = logging.getLogger("kvbranch.index.events")

#: How long a replay may take before the consumer gives up on it (and bumps the generation).
REPLAY_TIMEOUT_S = 2.0
MASK64 = (1 << 64) - 1
END_SEQ = -1

#: ``publish(generation, tier, stored, removed)``: one batch of one tier, in stream order.
Sink = Callable[[int, Tier, list[int], list[int]], Awaitable[None]]


def hash64(value: Any) -> int:
    """A block hash as the index keys it: the low 64 bits (bytes are big-endian, as vLLM's
    own ``maybe_convert_block_hash``)."""
    if isinstance(value, (bytes, bytearray)):
        return int.from_bytes(value, "big") & MASK64
    return int(value) & MASK64


def tier_of(medium: str | None) -> Tier:
    return "host" if (medium or "").upper() == "CPU" else "device"


class Generation:
    """The instance's block-entry generation per tier, shared by its consumers (one per DP
    engine). Per tier because the two tiers are emptied apart: a device reset keeps the host
    store, a host-store reset keeps the device cache."""

    def __init__(self, device: int = 0, host: int = 0) -> None:
        self.values: dict[Tier, int] = {"device": device, "host": host}

    def of(self, tier: Tier) -> int:
        return self.values[tier]

    def bump(self, why: str, tier: Tier | None = None) -> None:
        """Bump ``tier``'s generation, or both when ``tier`` is None (entries of either tier
        may be incomplete: a lost batch, a restarted engine)."""
        for t in TIERS if tier is None else (tier,):
            self.values[t] += 1
        logger.info("kvbranch index: block generations %s (%s)", self.values, why)


# Shape only beside connector/core/block_index.py's IndexCounters: two records of counters.
@dataclass
class ConsumerCounters:
    batches: int = 0
    duplicates: int = 0
    stored: int = 0
    removed: int = 0
    cleared: int = 0
    gaps: int = 0
    replays: int = 0
    replayed_batches: int = 0
    replay_failures: int = 0
    restarts: int = 0
    undecodable: int = 0
    #: Last ``block_size`` a ``BlockStored`` said, per tier.
    block_size: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}


def _decoder() -> msgspec.msgpack.Decoder[Any]:
    from server.connector.vllm_compat import MediumEventBatch

    return msgspec.msgpack.Decoder(type=MediumEventBatch)


class EventConsumer:
    """SUB on ``endpoint`` (``topic`` filter), DEALER on ``replay_endpoint``; every decoded
    batch goes to ``sink`` under the current generation."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        sink: Sink,
        *,
        topic: str = "",
        generation: Generation | None = None,
        replay_timeout_s: float = REPLAY_TIMEOUT_S,
        context: zmq.asyncio.Context | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.sink = sink
        self.topic = topic.encode()
        self.generation = generation or Generation()
        self.replay_timeout_s = replay_timeout_s
        self.counters = ConsumerCounters()
        #: Last seq applied (from the stream or a replay); -1: none yet.
        self.last_seq = -1
        #: Last seq the stream itself delivered: it going backwards is a publisher restart.
        self._stream_seq = -1
        self._ctx = context or zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._decode = _decoder()

    # --- sockets ---------------------------------------------------------------------------
    def connect(self) -> None:
        if self._sub is None:
            sub = self._ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, self.topic)
            sub.setsockopt(zmq.LINGER, 0)
            sub.connect(self.endpoint)
            self._sub = sub
        if self.replay_endpoint:
            self._replay_socket()  # connected early: ready when the first gap comes

    def _replay_socket(self) -> zmq.asyncio.Socket:
        if self._dealer is None:
            dealer = self._ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            assert self.replay_endpoint is not None
            dealer.connect(self.replay_endpoint)
            self._dealer = dealer
        return self._dealer

    def _drop_replay_socket(self) -> None:
        # A timed-out replay may still answer later: a fresh socket never reads those.
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def close(self) -> None:
        for sock in (self._sub, self._dealer):
            if sock is not None:
                sock.close(linger=0)
        self._sub = self._dealer = None

    # --- the loop --------------------------------------------------------------------------
    async def run(self) -> None:
        """Consume until cancelled."""
        self.connect()
        assert self._sub is not None
        try:
            while True:
                frames = await self._sub.recv_multipart()
                if len(frames) != 3:
                    self.counters.undecodable += 1
                    continue
                _, seq_bytes, payload = frames
                await self.on_message(int.from_bytes(seq_bytes, "big", signed=True), payload)
        finally:
            self.close()

    async def on_message(self, seq: int, payload: bytes) -> None:
        """One batch from the stream: dedupe, detect restarts and gaps, apply."""
        if seq <= self._stream_seq:
            self.counters.restarts += 1
            self.generation.bump(f"publisher restarted: seq {seq} after {self._stream_seq}")
            self.last_seq = seq - 1
        self._stream_seq = seq
        if seq <= self.last_seq:
            self.counters.duplicates += 1  # already applied by a replay
            return
        if seq > self.last_seq + 1:
            self.counters.gaps += 1
            await self._replay(self.last_seq + 1, seq)
            if seq <= self.last_seq:
                return  # the replay had it
        await self._apply(seq, payload)

    async def _replay(self, start: int, upto: int) -> None:
        """Ask the ring for ``start..``; a miss bumps the generation (entries incomplete)."""
        if not self.replay_endpoint:
            self.counters.replay_failures += 1
            self.generation.bump(f"lost batches {start}..{upto - 1} (no replay endpoint)")
            self.last_seq = upto - 1
            return
        self.counters.replays += 1
        dealer = self._replay_socket()
        complete = False
        first: int | None = None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.replay_timeout_s
        try:
            await asyncio.wait_for(
                dealer.send_multipart((b"", start.to_bytes(8, "big"))), self.replay_timeout_s
            )
            while True:
                left = deadline - loop.time()
                if left <= 0 or not await dealer.poll(int(left * 1000)):
                    break
                frames = await dealer.recv_multipart()
                if frames and frames[0] == b"":
                    frames = frames[1:]
                if len(frames) != 3:
                    continue
                _, seq_bytes, payload = frames
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == END_SEQ:
                    complete = True
                    break
                if first is None:
                    first = seq
                if seq > self.last_seq:
                    self.counters.replayed_batches += 1
                    await self._apply(seq, payload)
        except (zmq.ZMQError, asyncio.TimeoutError) as exc:
            logger.warning("kvbranch index: replay from %s failed: %s", self.replay_endpoint, exc)
        if not complete:
            self._drop_replay_socket()
        if not complete or first is None or first > start:
            self.counters.replay_failures += 1
            why = "timed out" if not complete else "ring too short"
            self.generation.bump(f"replay of {start}..{upto - 1} {why}")
            self.last_seq = max(self.last_seq, upto - 1)

    async def _apply(self, seq: int, payload: bytes) -> None:
        self.last_seq = seq
        self.counters.batches += 1
        try:
            batch = self._decode.decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.counters.undecodable += 1
            self.generation.bump(f"undecodable batch {seq}: {exc}")
            return
        await self.apply_events(batch.events)

    async def apply_events(self, events: list[Any]) -> None:
        """Map one batch's events to the sink, per tier, in order (a removal that follows a
        store of the same tier flushes it first: the sink applies removals before stores)."""
        stored: dict[Tier, list[int]] = {}
        removed: dict[Tier, list[int]] = {}

        async def flush(tier: Tier | None = None) -> None:
            for t in [tier] if tier is not None else list({*stored, *removed}):
                s, r = stored.pop(t, []), removed.pop(t, [])
                if s or r:
                    await self.sink(self.generation.of(t), t, s, r)

        for event in events:
            name = type(event).__name__
            tier = tier_of(getattr(event, "medium", None))
            if name in ("AllBlocksCleared", "ClearedOnMedium"):
                await flush()
                self.counters.cleared += 1
                self.generation.bump(f"all {tier} blocks cleared", tier)
                continue
            hashes = [hash64(h) for h in getattr(event, "block_hashes", None) or ()]
            if name == "BlockStored":
                self.counters.stored += len(hashes)
                self.counters.block_size[tier] = int(event.block_size)
                stored.setdefault(tier, []).extend(hashes)
            elif name == "BlockRemoved":
                if stored.get(tier):
                    await flush(tier)
                self.counters.removed += len(hashes)
                removed.setdefault(tier, []).extend(hashes)
        await flush()
