"""The instance side of the cluster index (docs/kv_events.md): one asyncio task in the kvbranch
plugin of every instance started with a shared ``--index``. An instance with several
data-parallel engines is one member per engine (:func:`~server.index.membership.member_id`):
each engine core has its own connector, host store, KV-event publisher and NIXL side channel,
so each is a member with its own record, block entries and generation, all sharing the API
server's URL.

* **heartbeat** every :data:`HEARTBEAT_INTERVAL_S`: the instance's
  :class:`~server.index.membership.InstanceRecord` (identity, URL, role, model, block size,
  NIXL side channel, block generation, load) with a
  :data:`~server.index.membership.DEFAULT_HEARTBEAT_TTL_S` TTL, sealed with the cluster secret
  (:mod:`server.index.record_seal`: routers list no record whose seal fails, so a writer of the
  shared index cannot add an instance);
* **block events**: one :class:`~server.index.events.EventConsumer` per engine's KV event
  publisher (vLLM's ``get_kv_event_sources``), feeding ``publish_blocks`` under this instance's
  identity and generation;
* **index unreachable**: one warning per outage, the instance keeps serving, retries back off;
  block batches wait in a bounded queue — when it overflows they are dropped and the generation
  bumped (the entries would be incomplete, so the older ones must go invisible too);
* **shutdown**: deregister, best effort, for at most :data:`DEREGISTER_TIMEOUT_S`.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from server.common.engine_choice import engine_count
from server.connector.pd.transfer_auth import load_cluster_secret
from server.index import record_seal
from server.index.blocks import Tier
from server.index.events import EventConsumer, Generation
from server.index.membership import DEFAULT_HEARTBEAT_TTL_S, InstanceRecord, Role, member_id
from server.index.sessions import offered_hold_ttl_s
from server.index.store import InstanceIndex

logger = logging.getLogger("kvbranch.index.publisher")

HEARTBEAT_INTERVAL_S = 2.0
DEREGISTER_TIMEOUT_S = 1.0
#: One index call may take this long before it counts as a failure.
CALL_TIMEOUT_S = 5.0
#: Block batches kept while the index is unreachable.
MAX_PENDING_BATCHES = 10_000
MAX_BACKOFF_S = 5.0

#: (endpoint, replay endpoint or None, topic): one engine's KV event publisher.
Source = tuple[str, str | None, str]


def role_of(launcher_role: str) -> Role:
    """The launcher's ``--role`` as the index records it (a single instance does both)."""
    return (
        "prefill"
        if launcher_role == "prefill"
        else "decode"
        if launcher_role == "decode"
        else "both"
    )


def sources_of(engine_client: Any) -> list[Source]:
    """The KV event publishers of this instance's engines (one per DP rank, in rank order),
    from vLLM's resolved configs (``/kv_event_sources``), else from the configured one; []
    when events are off or not published over ZMQ."""
    configs: list[Any] = []
    try:
        by_rank = engine_client.get_kv_event_sources() or {}
        configs = [by_rank[rank] for rank in sorted(by_rank)]
    except Exception:  # noqa: BLE001 - an older client or a render-only server
        configs = []
    if not configs:
        config = getattr(getattr(engine_client, "vllm_config", None), "kv_events_config", None)
        configs = [config] if config is not None else []
    out: list[Source] = []
    for config in configs:
        if not getattr(config, "enable_kv_cache_events", False):
            continue
        if getattr(config, "publisher", "zmq") != "zmq" or not getattr(config, "endpoint", ""):
            continue
        endpoint = str(config.endpoint).replace("tcp://*", "tcp://127.0.0.1")
        replay = config.replay_endpoint
        if replay:
            replay = str(replay).replace("tcp://*", "tcp://127.0.0.1")
        out.append((endpoint, replay or None, config.topic or ""))
    return out


@dataclass
class Member:
    """One member this publisher keeps in the index: its record (read fresh at each heartbeat),
    the generation its block entries are stamped with, and its id (fixed: the record's)."""

    record: Callable[[], InstanceRecord]
    generation: Generation
    instance_id: str


class IndexPublisher:
    """Heartbeats and block events of one instance into ``store``: one member per record in
    ``record`` (a data-parallel instance's engines, in rank order), engine ``i``'s events from
    ``sources[i]`` (one member: every source is its own)."""

    # Shape only beside sdk/_stream.py's stream: a constructor that keeps its arguments.
    def __init__(
        self,
        store: InstanceIndex,
        record: Callable[[], InstanceRecord] | Sequence[Callable[[], InstanceRecord]],
        sources: list[Source],
        *,
        interval_s: float = HEARTBEAT_INTERVAL_S,
        ttl_s: float = DEFAULT_HEARTBEAT_TTL_S,
        max_pending: int = MAX_PENDING_BATCHES,
        call_timeout_s: float = CALL_TIMEOUT_S,
        secret: bytes | None = None,
    ) -> None:
        self.store = store
        #: The cluster secret: every heartbeat is sealed with it, or no router lists the record.
        self.secret = secret if secret is not None else load_cluster_secret()
        records = [record] if callable(record) else list(record)
        if not records:
            raise ValueError("an index publisher needs at least one member")
        if len(records) > 1 and sources and len(sources) != len(records):
            raise ValueError(f"{len(records)} members, {len(sources)} KV-event sources")
        #: The members, each with its record and its entries' generation.
        self.members = [Member(r, Generation(), r().instance_id) for r in records]
        #: The heartbeat: how often, how long it lives.
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        #: Bounds: block batches waiting for the index, and the seconds one call may take.
        self.max_pending = max_pending
        self.call_timeout_s = call_timeout_s
        #: Which member each source feeds: engine i's its own, or all the one member's.
        owners = range(len(sources)) if len(self.members) > 1 else [0] * len(sources)
        self.consumers = [
            EventConsumer(
                ep,
                rp,
                partial(self.sink_of, owner),
                topic=topic,
                generation=self.members[owner].generation,
            )
            for owner, (ep, rp, topic) in zip(owners, sources, strict=True)
        ]
        #: (member, generation, tier, stored, removed) batches waiting for the index.
        self.pending: deque[tuple[int, int, Tier, list[int], list[int]]] = deque()
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self.outage = False
        self.heartbeats_sent = 0
        self.heartbeats_failed = 0
        self.batches_applied = 0
        self.hashes_applied = 0
        self.batches_dropped = 0
        self.batches_stale = 0

    @property
    def record(self) -> Callable[[], InstanceRecord]:
        """The first member's record (the instance's own with a single engine)."""
        return self.members[0].record

    @property
    def generation(self) -> Generation:
        """The first member's generation (the instance's own with a single engine)."""
        return self.members[0].generation

    # --- what the consumers feed -----------------------------------------------------------
    async def sink_of(
        self, member: int, generation: int, tier: Tier, stored: list[int], removed: list[int]
    ) -> None:
        if len(self.pending) >= self.max_pending:
            # Entries would be incomplete: drop what waits and make everything older invisible.
            self.batches_dropped += len(self.pending) + 1
            self.pending.clear()
            for m in self.members:
                m.generation.bump("index publisher queue overflowed")
        else:
            self.pending.append((member, generation, tier, stored, removed))
        self._wake.set()

    # --- the task --------------------------------------------------------------------------
    async def run(self) -> None:
        """Heartbeat and apply block batches until cancelled; then deregister."""
        self._tasks = [asyncio.create_task(c.run()) for c in self.consumers]
        backoff = 0.0
        next_beat = 0.0
        loop = asyncio.get_running_loop()
        try:
            while True:
                try:
                    if loop.time() >= next_beat:
                        await self.heartbeat()
                        next_beat = loop.time() + self.interval_s
                    await self.flush()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the index is advisory: keep serving
                    if not self.outage:
                        logger.warning(
                            "kvbranch index %s unreachable (%s); serving on, retrying",
                            self.store.kind,
                            exc,
                        )
                    self.outage = True
                    backoff = min(max(backoff * 2, 0.5), MAX_BACKOFF_S)
                    next_beat = min(next_beat, loop.time() + backoff)
                    await asyncio.sleep(backoff)
                    continue
                if self.outage:
                    logger.warning("kvbranch index %s reachable again", self.store.kind)
                    self.outage = False
                backoff = 0.0
                self._wake.clear()
                if self.pending:
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), max(next_beat - loop.time(), 0.0))
                except asyncio.TimeoutError:
                    pass
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            await self.shutdown()

    async def heartbeat(self) -> None:
        for member in self.members:
            record = record_seal.seal(
                replace(
                    member.record(),
                    generation=member.generation.of("device"),
                    host_generation=member.generation.of("host"),
                ),
                self.secret,
            )
            try:
                await asyncio.wait_for(
                    self.store.heartbeat(record, self.ttl_s), self.call_timeout_s
                )
            except Exception:
                self.heartbeats_failed += 1
                raise
        self.heartbeats_sent += 1
        logger.debug("kvbranch index publisher: %s", self.counters())

    async def flush(self) -> None:
        """Apply waiting batches in order; one that fails stays first in line."""
        while self.pending:
            index, generation, tier, stored, removed = self.pending[0]
            member = self.members[index]
            if generation < member.generation.of(tier):
                self.pending.popleft()  # invisible anyway
                self.batches_stale += 1
                continue
            await asyncio.wait_for(
                self.store.publish_blocks(member.instance_id, generation, tier, stored, removed),
                self.call_timeout_s,
            )
            self.pending.popleft()
            self.batches_applied += 1
            self.hashes_applied += len(stored) + len(removed)

    async def shutdown(self) -> None:
        """Leave the cluster (best effort, bounded) and release the store."""
        for member in self.members:
            try:
                await asyncio.wait_for(
                    self.store.deregister(member.instance_id), DEREGISTER_TIMEOUT_S
                )
            except Exception as exc:  # noqa: BLE001 - its record expires by TTL anyway
                logger.info("kvbranch index: deregister skipped (%s)", exc)
        try:
            await asyncio.wait_for(self.store.close(), DEREGISTER_TIMEOUT_S)
        except Exception:  # noqa: BLE001
            pass

    def counters(self) -> dict[str, Any]:
        consumers = [c.counters for c in self.consumers]
        return {
            "index": self.store.kind,
            "generation": self.generation.of("device"),
            "host_generation": self.generation.of("host"),
            "heartbeats_sent": self.heartbeats_sent,
            "heartbeats_failed": self.heartbeats_failed,
            "batches_applied": self.batches_applied,
            "hashes_applied": self.hashes_applied,
            "batches_pending": len(self.pending),
            "batches_dropped": self.batches_dropped,
            "batches_stale": self.batches_stale,
            "replays": sum(c.replays for c in consumers),
            "replay_failures": sum(c.replay_failures for c in consumers),
            "restarts": sum(c.restarts for c in consumers),
            "event_sources": len(self.consumers),
            "members": len(self.members),
            "outage": self.outage,
        }


def nixl_side_channel(role: str, engine: int = 0) -> str:
    """P/D and aggregated replicas: the NIXL side channel (host:port) the launcher gave vLLM,
    for data-parallel engine ``engine`` (vLLM offsets the port by the engine's rank); ""
    otherwise."""
    from server.common.env import ENV_NIXL_HOST, ENV_PEER_PULL, nixl_side_channel_port

    if role not in ("prefill", "decode") and os.environ.get(ENV_PEER_PULL) != "1":
        return ""
    host = os.environ.get(ENV_NIXL_HOST, "")
    port = nixl_side_channel_port()
    if not host or port is None:
        return ""
    return f"{host}:{port + engine}"


def engine_load(engine_client: Any, engine: int, engines: int) -> int:
    """Requests in flight on one engine: with several, the waiting and running counts vLLM's
    data-parallel client balances by (``lb_engines``, vLLM 0.32's ``DPAsyncMPClient``,
    refreshed by its coordinator); else, or when that is missing, the whole instance's."""
    if engines > 1:
        counts = getattr(getattr(engine_client, "engine_core", None), "lb_engines", None)
        try:
            return int(sum(counts[engine]))  # type: ignore[index]
        except (TypeError, IndexError, ValueError):
            pass
    try:
        return int(engine_client.get_num_unfinished_requests())
    except Exception:  # noqa: BLE001 - not an AsyncLLM: no load signal
        return 0


def record_factory(
    state: Any, engine_client: Any, url: str, launcher_role: str, engine: int = 0
) -> Callable[[], InstanceRecord]:
    """The record of the instance's data-parallel engine ``engine`` (the instance's with a
    single engine), read fresh at each heartbeat (load changes)."""
    config = getattr(engine_client, "vllm_config", None)
    cache = getattr(config, "cache_config", None)
    block_size = int(getattr(cache, "block_size", 0) or 0)
    engines = engine_count(engine_client)
    nixl = nixl_side_channel(launcher_role, engine)
    role = role_of(launcher_role)
    # Shape only beside router/app.py's Pool(...): keyword arguments named as their values.
    base = InstanceRecord(
        instance_id=member_id(state.instance_id, engine, engines),
        url=url,
        role=role,
        model=state.model_name,
        block_size=block_size,
        nixl=nixl,
        engines=engines,
    )

    def make() -> InstanceRecord:
        return replace(base, load=engine_load(engine_client, engine, engines))

    return make


#: The index offers a hold for this long when the engine's config names none.
DEFAULT_HOLD_TTL_S = 30.0


def index_hold_ttl_s(engine_client: Any) -> float:
    """How long the holds this instance files (an aggregated replica's) are offered: the time
    its NIXL child holds a finished turn's blocks (``decoder_kv_blocks_ttl``, from the launcher's
    ``--pd-hold-ttl-s``) less the margin every hold's offer keeps, so a hold found in the index
    is still held by the instance (:func:`server.index.sessions.offered_hold_ttl_s`)."""
    config = getattr(getattr(engine_client, "vllm_config", None), "kv_transfer_config", None)
    extra = getattr(config, "kv_connector_extra_config", None) or {}
    children = [c for c in extra.get("connectors", []) if isinstance(c, dict)]
    ttl = DEFAULT_HOLD_TTL_S
    for child in [extra, *(c.get("kv_connector_extra_config") or {} for c in children)]:
        value = child.get("decoder_kv_blocks_ttl")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            ttl = float(value)
    return offered_hold_ttl_s(ttl)


def start(state: Any, engine_client: Any, args: Any) -> IndexPublisher | None:
    """Start the publisher task when the launcher named a shared index; None otherwise (or
    when the index URL cannot be opened: logged, the instance serves without it)."""
    from server.common.env import ENV_ADVERTISE_URL, ENV_CLUSTER_NAME, ENV_INDEX_URL, ENV_ROLE
    from server.index import open_store

    url = os.environ.get(ENV_INDEX_URL, "memory")
    if not url or url == "memory":
        return None
    try:
        store = open_store(
            url,
            hold_ttl_s=index_hold_ttl_s(engine_client),
            cluster=os.environ.get(ENV_CLUSTER_NAME, "default"),
        )
    except Exception as exc:  # noqa: BLE001 - a missing backend must not stop serving
        logger.warning("kvbranch index %s not opened (%s): not publishing", url, exc)
        return None
    advertise = (
        os.environ.get(ENV_ADVERTISE_URL) or f"http://127.0.0.1:{getattr(args, 'port', 8000)}"
    )
    sources = sources_of(engine_client)
    if not sources:
        logger.warning("kvbranch index: vLLM KV events are off: publishing heartbeats only")
    role = os.environ.get(ENV_ROLE, "single")
    engines = engine_count(engine_client)
    if engines > 1 and sources and len(sources) != engines:
        logger.warning(
            "kvbranch index: %d KV-event sources for %d engines: publishing heartbeats only",
            len(sources),
            engines,
        )
        sources = []
    publisher = IndexPublisher(
        store,
        [record_factory(state, engine_client, advertise, role, e) for e in range(engines)],
        sources,
    )
    task = asyncio.get_running_loop().create_task(publisher.run(), name="kvbranch-index")
    publisher_task.add(task)
    task.add_done_callback(publisher_task.discard)
    logger.info(
        "kvbranch index publisher: %s cluster=%s as %s (%s), %d event source(s) %s",
        store.kind,
        os.environ.get(ENV_CLUSTER_NAME, "default"),
        advertise,
        ", ".join(m.instance_id for m in publisher.members),
        len(sources),
        [s[0] for s in sources],
    )
    return publisher


#: The running task (kept referenced: asyncio holds tasks weakly).
publisher_task: set[asyncio.Task[None]] = set()
