"""``KVBranchConnector``: the class vLLM loads through ``kv_transfer_config``.

A thin facade, as vLLM's own ``OffloadingConnector``: every hook delegates to the object of its
role, built in ``__init__``:

* scheduler role — :class:`~server.connector.engine.scheduler_side.KVBranchScheduler`: the planner
  (host block index + session registry; it owns pending loads and builds each step's
  :class:`KVBranchMetadata`) and the control socket for the HTTP routes;
* worker role — :class:`~server.connector.engine.worker_side.KVBranchWorker`: the host pool
  that runs the planned copies — loads before the forward (``start_load_kv``), saves after it
  (``wait_for_save``) — and reports finished tail copies (``get_finished``).

Loads are synchronous (they complete before the forward that reads them), which keeps the
engine's scheduling unchanged; saves are synchronous on CPU and stream-ordered on CUDA. A
finished request's blocks are kept one more step while its tail is copied out (``tails.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, cast

import torch

from server.common.control_path import default_control_socket
from server.connector.config import ConnectorConfig
from server.connector.control.ops import Op
from server.connector.core.block_index import StoreEvent, StoreEventLog
from server.connector.core.kv_groups import WindowRule, state_groups, store_off_reason
from server.connector.core.metadata import KVBranchMetadata, device_blocks
from server.connector.core.part_pool import split_store
from server.connector.core.planner import Planner
from server.connector.engine.scheduler_side import KVBranchScheduler
from server.connector.engine.stats import KVBranchPromMetrics, KVBranchTransferStats
from server.connector.engine.step_trace import StepTrace, scheduled_token_split
from server.connector.engine.worker_side import KVBranchWorker
from server.connector.vllm_compat import (
    MEDIUM_CPU,
    BlockRemoved,
    BlockStored,
    CacheHitSource,
    ClearedOnMedium,
    KVCacheEvent,
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
    group_block_bytes,
    group_windows,
    kv_events_enabled,
    kv_group_block_sizes,
    kv_group_kinds,
    kv_group_layers,
    maybe_convert_block_hash,
    null_block_id,
    prefix_reuse_off_reason,
    states_at_boundaries,
)

if TYPE_CHECKING:
    from server.connector.vllm_compat import (
        AttentionMetadata,
        ForwardContext,
        KVCacheBlocks,
        KVCacheConfig,
        Request,
        SchedulerOutput,
        VllmConfig,
    )

logger = logging.getLogger("kvbranch.connector")

# The pure layer's metadata is a plain dataclass; vLLM's base is an ABC with no members.
KVConnectorMetadata.register(KVBranchMetadata)


def host_events(changes: list[StoreEvent], block_size: int) -> list[KVCacheEvent]:
    """The host store's changes as vLLM KV events (``medium="CPU"``), runs of one kind merged
    into one event. Only the hashes matter to the cluster index: no token ids, no parent, no
    extra keys (token ids and cache salts stay in the instance)."""
    out: list[KVCacheEvent] = []
    run: list[Any] = []
    kind: str | None = None

    def flush() -> None:
        if not run:
            return
        if kind == "stored":
            out.append(
                BlockStored(
                    block_hashes=list(run),
                    parent_block_hash=None,
                    token_ids=[],
                    block_size=block_size,
                    lora_id=None,
                    medium=MEDIUM_CPU,
                    lora_name=None,
                )
            )
        else:
            out.append(BlockRemoved(block_hashes=list(run), medium=MEDIUM_CPU))
        run.clear()

    for what, block_hash in changes:
        if what == "cleared":
            flush()
            kind = None
            out.append(ClearedOnMedium(medium=MEDIUM_CPU))
            continue
        if what != kind:
            flush()
            kind = what
        run.append(maybe_convert_block_hash(block_hash))  # type: ignore[arg-type]
    flush()
    return out


def block_bytes_of(kv_cache_config: KVCacheConfig, groups: frozenset[int] | None = None) -> int:
    """Bytes of one block position of the KV cache groups ``groups`` (all: every layer)."""
    return sum(
        group_block_bytes(group)
        for i, group in enumerate(kv_cache_config.kv_cache_groups)
        if groups is None or i in groups
    )


class KVBranchConnector(KVConnectorBase_V1, SupportsHMA):
    """Declares ``SupportsHMA``: vLLM keeps its hybrid KV cache manager on, and the connector
    saves and loads every KV cache group of a block position together (``core/kv_groups.py``
    says which groups it can store; with any other, the host store stays off)."""

    _cache_hit_source = CacheHitSource.HOST
    #: Per-step timing (``KVBRANCH_STEP_TRACE``; off by default): see ``step_trace.py``.
    _trace = StepTrace("off", folder="")

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = ConnectorConfig.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        if config.control_socket is None and role == KVConnectorRole.SCHEDULER:
            # Started by vLLM's own CLI: the plugin finds it by the same engine id.
            path = default_control_socket(str(self._kv_transfer_config.engine_id), create=True)
            config = config.model_copy(update={"control_socket": path})
        block_size = vllm_config.cache_config.block_size
        kinds = kv_group_kinds(kv_cache_config)
        states = state_groups(kinds)
        sizes = kv_group_block_sizes(kv_cache_config)
        group_sizes = set(sizes)
        if len(group_sizes) == 1:
            # The groups' own size: vLLM's CPU worker raises a hybrid model's attention block
            # size to fit its state page after the engine core's config was copied, and the
            # prompt's block hashes follow the groups.
            (block_size,) = group_sizes
            if states and block_size != vllm_config.cache_config.block_size:
                logger.warning(
                    "kvbranch connector: vLLM's scheduler splits prompts at %d-token blocks "
                    "while this model's states are kept at %d-token blocks, so few states "
                    "are kept to resume from (plain vLLM too); pass -- --block-size %d",
                    vllm_config.cache_config.block_size,
                    block_size,
                    block_size,
                )
        off = store_off_reason(
            kinds, sizes, states_at_boundaries=states_at_boundaries(kv_cache_config)
        ) or prefix_reuse_off_reason(vllm_config)
        enabled = off is None
        if not enabled:
            logger.warning(
                "kvbranch connector: host store disabled (the engine runs as plain vLLM): "
                "%s (docs/models.md)",
                off,
            )
        windows = group_windows(kv_cache_config) if enabled else {}
        window = (
            WindowRule(frozenset(windows), tuple(windows.values()), block_size) if windows else None
        )
        # A slot holds a position's full-attention groups; a window part its windowed groups,
        # a state part its state groups (core/part_pool.py).
        window_ids = frozenset(windows)
        others = frozenset(range(len(kinds))) - window_ids - states
        block_bytes = block_bytes_of(kv_cache_config, others) if enabled else 0
        window_bytes = block_bytes_of(kv_cache_config, window_ids) if window_ids else 0
        state_bytes = block_bytes_of(kv_cache_config, states) if states and enabled else 0
        num_slots, (window_slots, state_slots) = (
            split_store(config.host_store_bytes, block_bytes, [window_bytes, state_bytes])
            if enabled
            else (0, [0, 0])
        )
        self.scheduler_side: KVBranchScheduler | None = None
        self.worker_side: KVBranchWorker | None = None
        self._trace = StepTrace("scheduler" if role == KVConnectorRole.SCHEDULER else "worker")
        self._step: dict[str, float] = {}
        if role == KVConnectorRole.SCHEDULER:
            # In the engine core process: clear the store when weights or adapters change.
            from server.engine import weight_changes

            weight_changes.install()
            parallel = vllm_config.parallel_config
            engine = getattr(parallel, "data_parallel_index", None)
            engine = parallel.data_parallel_rank if engine is None else engine
            self.scheduler_side = KVBranchScheduler(
                block_size=block_size,
                block_bytes=block_bytes,
                num_slots=num_slots,
                enabled=enabled,
                config=config,
                engine_index=int(engine or 0),
                state_groups=states,
                num_groups=len(kinds),
                window=window,
                window_slots=window_slots,
                window_bytes=window_bytes,
                state_slots=state_slots,
                state_bytes=state_bytes,
            )
            if kv_events_enabled(vllm_config):
                # Host-store saves and evictions join vLLM's KV event stream (take_events).
                self.scheduler_side.planner.index.event_log = StoreEventLog()
        else:
            self.worker_side = KVBranchWorker(
                num_slots if enabled else 0,
                block_bytes,
                groups=kv_group_layers(kv_cache_config),
                pools=[(window_ids, window_slots), (states, state_slots)],
            )

    # --- what a composing connector (P/D) reaches ------------------------------------------------
    @property
    def planner(self) -> Planner | None:
        return self.scheduler_side.planner if self.scheduler_side is not None else None

    @property
    def extra_ops(self) -> dict[str, Op[Any]]:
        """Control ops a composing connector adds (P/D: ``claim_hold``); scheduler role."""
        return self.scheduler_side.extra_ops if self.scheduler_side is not None else {}

    @property
    def extra_stats(self) -> dict[str, Any]:
        """Stats sections a composing connector adds (P/D: ``pd``); scheduler role."""
        return self.scheduler_side.extra_stats if self.scheduler_side is not None else {}

    # ==== worker side ============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self.worker_side is not None:
            self.worker_side.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """The first connector hook of a step in model runner V1 (before it zeroes new blocks)."""
        if self.worker_side is not None:
            self.worker_side.fence_for(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Runs before ``start_load_kv`` in every runner, also on steps with no tokens."""
        super().bind_connector_metadata(connector_metadata)
        if self._trace.enabled:
            self._step = {"t": time.perf_counter()}
        if self.worker_side is not None:
            self.worker_side.fence_for(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # vLLM 0.32 calls this after the forward on steps without sync loads (ours are sync:
        # the scheduler then calls it before). Loads run on the pool's stream, behind its saves.
        if self.worker_side is not None:
            started = time.perf_counter()
            self.worker_side.start_load(self._connector_metadata)
            if self._trace.enabled:
                self._step.update(load0=started, load1=time.perf_counter())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before any layer runs

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        return  # whole blocks are saved once per step in wait_for_save

    def wait_for_save(self) -> None:
        if self.worker_side is not None:
            started = time.perf_counter()
            self.worker_side.save(self._connector_metadata)
            if self._trace.enabled:
                self._trace.record(**self._step, save0=started, save1=time.perf_counter())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self.worker_side is None:
            return None, None
        return self.worker_side.finished(), None

    def get_kv_connector_stats(self) -> KVBranchTransferStats | None:
        return self.worker_side.take_stats() if self.worker_side is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVBranchTransferStats:
        return KVBranchTransferStats(data=data) if data is not None else KVBranchTransferStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVBranchPromMetrics:
        return KVBranchPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is only a future miss

    # ==== scheduler side =========================================================================
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.scheduler_side is not None:
            self.scheduler_side.kv_cache_manager = kv_cache_manager
            self.scheduler_side.planner.null_block = null_block_id(kv_cache_manager)

    def on_new_request(self, request: Request) -> None:
        if self.scheduler_side is not None:
            self.scheduler_side.planner.on_new_request(request)

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        if self.scheduler_side is None:
            return 0, False
        started = time.perf_counter()
        matched = self.scheduler_side.num_new_matched_tokens(request, num_computed_tokens)
        if self._trace.enabled:
            self._trace.add_hook_time("match", started)
        return matched, False

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        if self.scheduler_side is None:
            return
        # Also when the store is disabled: this is where a request's split is recorded.
        started = time.perf_counter()
        planner = self.scheduler_side.planner
        block_ids = (
            device_blocks(blocks.get_block_ids(), planner.null_block) if num_external_tokens else []
        )
        planner.after_alloc(request, block_ids, num_external_tokens)
        if self._trace.enabled:
            self._trace.add_hook_time("alloc", started)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        if self.scheduler_side is None:
            return cast(KVConnectorMetadata, KVBranchMetadata())
        started = time.perf_counter()
        meta = self.scheduler_side.build_meta(scheduler_output)
        if self._trace.enabled:
            prefill, decode = scheduled_token_split(scheduler_output.num_scheduled_tokens)
            self._trace.record(
                t=started,
                build_s=round(time.perf_counter() - started, 6),
                prefill=prefill,
                decode=decode,
                loads=len(meta.load_slots),
                saves=len(meta.save_blocks),
            )
        return cast(KVConnectorMetadata, meta)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls :meth:`request_finished_all_groups` instead (``SupportsHMA``); a composing
        connector without it may still call this, with the one group's blocks."""
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler_side is None:
            return False, None
        started = time.perf_counter()
        positions = device_blocks(block_ids, self.scheduler_side.planner.null_block)
        result = self.scheduler_side.request_finished(request, positions)
        if self._trace.enabled:
            self._trace.add_hook_time("finish", started)
        return result

    def take_events(self) -> Iterable[KVCacheEvent]:
        """The host store's saves and evictions since the last step, as ``medium="CPU"``
        events the scheduler publishes with the device cache's own (only with vLLM's KV events
        on; a MultiConnector yields its children's)."""
        if self.scheduler_side is None:
            return ()
        log = self.scheduler_side.planner.index.event_log
        if log is None or not log.events:
            return ()
        return host_events(log.take(), self.scheduler_side.block_size)

    def reset_cache(self) -> bool | None:
        """``POST /reset_prefix_cache?reset_external=true``, vLLM's cache clears (pause, sleep)
        and new weights or LoRA adapters (``server/engine/weight_changes.py``): forget every
        block and tail, pinned or not, and every pin (sessions stay; their KV goes)."""
        return self.scheduler_side.reset_cache() if self.scheduler_side is not None else None

    def shutdown(self) -> None:
        self._trace.close()
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()
