"""``KVBranchConnector``: the class vLLM loads through ``kv_transfer_config``.

Scheduler role: a :class:`Planner` (host block index + session registry) plans loads and saves
into :class:`KVBranchMetadata` each step and serves the control socket for the HTTP routes.
Worker role: a :class:`HostKVPool` runs the planned copies — loads before the forward
(``start_load_kv``), saves after it (``wait_for_save``).

Loads are synchronous (they complete before the forward that reads them), which keeps the
engine's scheduling unchanged; saves are synchronous on CPU and stream-ordered on CUDA.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from server.connector.block_index import HostBlockIndex
from server.connector.control import ControlError, ControlServer, engine_socket_path
from server.connector.host_pool import HostKVPool
from server.connector.metadata import KVBranchMetadata
from server.connector.planner import Planner
from server.connector.sessions import (
    DEFAULT_IDLE_TTL_S,
    DEFAULT_MAX_BRANCHES_PER_SESSION,
    DEFAULT_MAX_SESSIONS_PER_TENANT,
    RegistryError,
    SessionRegistry,
)
from server.connector.stats import KVBranchPromMetrics, KVBranchTransferStats

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvbranch.connector")

DEFAULT_HOST_STORE_BYTES = 2 << 30


def block_bytes_of(kv_cache_config: "KVCacheConfig") -> int:
    """Bytes of one block across all layers of the (single) KV cache group."""
    group = kv_cache_config.kv_cache_groups[0]
    return group.kv_cache_spec.page_size_bytes * len(group.layer_names)


class KVBranchConnector(KVConnectorBase_V1):
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.block_size = vllm_config.cache_config.block_size
        groups = kv_cache_config.kv_cache_groups if kv_cache_config else []
        self.enabled = len(groups) == 1
        if not self.enabled:
            logger.warning("kvbranch connector supports models with one KV cache group; "
                           "found %d: host store disabled (the engine runs unchanged)",
                           len(groups))
        self.block_bytes = block_bytes_of(kv_cache_config) if self.enabled else 0
        store_bytes = int(extra.get("host_store_bytes", DEFAULT_HOST_STORE_BYTES))
        self.num_slots = store_bytes // self.block_bytes if self.enabled else 0
        self.pool: HostKVPool | None = None
        self.planner: Planner | None = None
        self.control: ControlServer | None = None
        self._pending_loads: list[tuple[int, int]] = []
        #: Control ops and stats sections contributed by a composing connector (P/D: holds).
        self.extra_ops: dict[str, Any] = {}
        self.extra_stats: dict[str, Any] = {}
        self._transfer_stats = KVBranchTransferStats()
        if role == KVConnectorRole.SCHEDULER:
            index = HostBlockIndex(self.num_slots)
            registry = SessionRegistry(
                index,
                block_size=self.block_size,
                block_bytes=max(self.block_bytes, 1),
                pin_budget_bytes=int(extra.get("pin_budget_bytes", store_bytes // 2)),
                default_ttl_s=float(extra.get("pin_ttl_s", 300.0)),
                # Tenants (the launcher's flags; the registry's defaults otherwise).
                max_sessions_per_tenant=int(extra.get("max_sessions_per_tenant",
                                                      DEFAULT_MAX_SESSIONS_PER_TENANT)),
                max_branches_per_session=int(extra.get("max_branches_per_session",
                                                       DEFAULT_MAX_BRANCHES_PER_SESSION)),
                tenant_pin_share=float(extra.get("tenant_pin_share", 1.0)),
                idle_ttl_s=float(extra.get("session_idle_ttl_s", DEFAULT_IDLE_TTL_S)),
                require_owner=bool(extra.get("tenants", False)),
            )
            self.planner = Planner(index, registry, self.block_size)
            path = extra.get("control_socket")
            if path:
                # One socket per engine core; the directory must be private (ControlServer
                # refuses to bind otherwise: the socket serves session ops to whoever connects).
                parallel = vllm_config.parallel_config
                engine = getattr(parallel, "data_parallel_index", None)
                engine = parallel.data_parallel_rank if engine is None else engine
                self.control = ControlServer(engine_socket_path(path, int(engine)),
                                             self._handle_control)
            logger.info("kvbranch connector (scheduler): block_size=%d block_bytes=%d "
                        "host slots=%d (%.2f GiB) pin budget=%d bytes", self.block_size,
                        self.block_bytes, self.num_slots,
                        self.num_slots * self.block_bytes / (1 << 30), registry.pin_budget_bytes)

    # ==== worker side ============================================================================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if not self.enabled or self.num_slots == 0:
            return
        self.pool = HostKVPool(kv_caches, self._kv_cache_config.num_blocks, self.num_slots)
        if self.pool.block_bytes != self.block_bytes:
            logger.warning("kvbranch: worker block bytes %d differ from planned %d",
                           self.pool.block_bytes, self.block_bytes)
        logger.info("kvbranch connector (worker): %d host slots on %s, %s copies",
                    self.num_slots, self.pool.device, "CUDA stream" if self.pool.cuda else "CPU")

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """The first connector hook of a step in model runner V1 (before it zeroes new blocks)."""
        self._fence_for(kv_connector_metadata)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Runs before ``start_load_kv`` in every runner, also on steps with no tokens."""
        super().bind_connector_metadata(connector_metadata)
        self._fence_for(connector_metadata)

    def _fence_for(self, meta: KVConnectorMetadata) -> None:
        """Wait on the host for the previous step's save when a peer connector writes KV
        blocks this step: its writes (NIXL/UCX) are not ordered by any CUDA stream, and a block
        freed after the save was planned may be one of them. Writes on the compute stream need
        no wait here: ``HostKVPool.save`` orders that stream after the save on the GPU, so the
        host is not stalled (async scheduling keeps overlapping)."""
        if self.pool is not None and isinstance(meta, KVBranchMetadata) and meta.host_fence:
            self.pool.fence()

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        # vLLM 0.32 calls this after the forward on steps without sync loads (ours are sync:
        # the scheduler then calls it before). Loads run on the pool's stream, behind its saves.
        if self.pool is None:
            return
        meta = self._connector_metadata
        if isinstance(meta, KVBranchMetadata) and meta.load_slots:
            started = time.perf_counter()
            self.pool.load(meta.load_slots, meta.load_blocks)
            self._transfer_stats.record("load", time.perf_counter() - started,
                                        len(meta.load_slots))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv, before any layer runs

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # whole blocks are saved once per step in wait_for_save

    def wait_for_save(self) -> None:
        if self.pool is None:
            return
        meta = self._connector_metadata
        if isinstance(meta, KVBranchMetadata) and meta.save_blocks:
            started = time.perf_counter()
            self.pool.save(meta.save_blocks, meta.save_slots)  # on CUDA: time to enqueue
            self._transfer_stats.record("save", time.perf_counter() - started,
                                        len(meta.save_blocks))

    def get_kv_connector_stats(self) -> KVBranchTransferStats | None:
        if self._transfer_stats.is_empty():
            return None
        stats, self._transfer_stats = self._transfer_stats, KVBranchTransferStats()
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVBranchTransferStats:
        return KVBranchTransferStats(data=data) if data is not None else KVBranchTransferStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: dict,
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVBranchPromMetrics:
        return KVBranchPromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a best-effort cache: a dropped save is only a future miss

    # ==== scheduler side =========================================================================
    def on_new_request(self, request: "Request") -> None:
        if self.planner is not None:
            self.planner.on_new_request(request)

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self.planner is None or not self.enabled:
            return 0, False
        return self.planner.num_new_matched_tokens(request, num_computed_tokens), False

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if self.planner is None:
            return
        # Also when the store is disabled: this is where a request's split is recorded.
        block_ids = blocks.get_block_ids()[0] if num_external_tokens else []
        self.planner.after_alloc(request, block_ids, num_external_tokens, self._pending_loads)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVBranchMetadata()
        if self.planner is None or not self.enabled:
            return meta
        meta.host_fence = self.planner.take_foreign_loads()
        loads, self._pending_loads = self._pending_loads, []
        for slot, block in loads:
            meta.load_slots.append(slot)
            meta.load_blocks.append(block)
        block_state = scheduler_output.kv_connector_block_state
        resolve = (block_state.get_block_ids if block_state is not None
                   else self._kv_cache_manager.get_block_ids)
        saves = self.planner.plan_saves(scheduler_output.num_scheduled_tokens, resolve,
                                        protected=set(meta.load_slots))
        for block, slot in saves:
            meta.save_blocks.append(block)
            meta.save_slots.append(slot)
        return meta

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.planner is None:
            return False, None
        split = self.planner.request_finished(request)
        return False, ({"kvbranch": split} if split else None)

    def reset_cache(self) -> bool | None:
        """``POST /reset_prefix_cache?reset_external=true``: forget every unpinned block."""
        if self.planner is None:
            return None
        with self.planner.lock:
            self.planner.index.clear()
        return True

    def shutdown(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None

    # ==== control socket ops (scheduler side) =====================================================
    def _handle_control(self, req: dict) -> Any:
        planner = self.planner
        assert planner is not None
        op = req["op"]
        owner = req.get("owner")
        reg = planner.registry
        with planner.lock:
            reg.expire()
            try:
                if op == "info":
                    return {"block_size": self.block_size, "block_bytes": self.block_bytes,
                            "num_slots": self.num_slots, "enabled": self.enabled,
                            "store_capacity_bytes": self.num_slots * self.block_bytes,
                            "pin_budget_bytes": reg.pin_budget_bytes,
                            "platform": "cuda" if torch.cuda.is_available() else "cpu"}
                if op == "create_session":
                    session = reg.create_session(req.get("session_id"),
                                                 auto_pin=bool(req.get("auto_pin", True)),
                                                 pin_ttl_s=req.get("pin_ttl_s"), owner=owner)
                    return reg.session_info(session)
                if op == "get_session":
                    return reg.session_info(reg.get_session(req["session_id"], owner))
                if op == "delete_session":
                    return {"deleted": req["session_id"],
                            "released_blocks": reg.delete_session(req["session_id"], owner)}
                if op == "list_branches":
                    session = reg.get_session(req["session_id"], owner)
                    return [reg.branch_info(b) for b in session.branches.values()]
                if op == "get_branch":
                    return reg.branch_info(reg.get_branch(req["session_id"], req["branch_id"],
                                                          owner))
                if op == "fork":
                    branch = reg.fork(req["session_id"], req.get("parent") or "main",
                                      req.get("branch_id"), token_offset=req.get("token_offset"),
                                      token_prefix=req.get("token_prefix"), owner=owner)
                    return reg.branch_info(branch)
                if op == "delete_branch":
                    return {"deleted": req["branch_id"],
                            "released_blocks": reg.delete_branch(req["session_id"],
                                                                 req["branch_id"], owner)}
                if op == "pin":
                    return reg.branch_info(reg.pin(req["session_id"], req["branch_id"],
                                                   float(req["ttl_s"]), owner))
                if op == "unpin":
                    return reg.branch_info(reg.unpin(req["session_id"], req["branch_id"], owner))
                if op == "prefetch_plan":
                    branch = reg.get_branch(req["session_id"], req["branch_id"], owner)
                    resident = self._device_resident(branch.block_hashes)
                    if resident:
                        planner.prefetches_skipped += 1
                    return {"token_ids": list(branch.token_ids), "cache_salt": branch.cache_salt,
                            "device_resident": resident}
                if op == "split":
                    return planner.split_for(str(req.get("tag", "")))
                if op == "stats":
                    return self._stats(owner, all_owners=bool(req.get("all_owners")))
                if op == "reset_store":
                    return {"dropped_blocks": planner.index.clear()}
            except RegistryError as exc:
                raise ControlError(exc.status, exc.message) from None
            except KeyError as exc:
                raise ControlError(400, f"missing field {exc.args[0]!r}") from None
        extra = self.extra_ops.get(op)
        if extra is not None:
            return extra(req)
        raise ControlError(400, f"unknown control op {op!r}")

    def _device_resident(self, block_hashes: list[bytes]) -> bool:
        """Whether every full block of a branch is still in vLLM's device prefix cache.

        Then a prefetch would only recompute the partial last block (which the next turn
        recomputes anyway) and take an engine step from other sessions, so it is skipped.
        Read from the control thread without the scheduler's lock: a stale answer only costs
        one unneeded or one missing prefetch, never a wrong result."""
        manager = self._kv_cache_manager
        if manager is None or not block_hashes:
            return False
        pool = manager.block_pool
        try:
            return all(pool.get_cached_block(h, [0]) is not None for h in block_hashes)
        except Exception:  # noqa: BLE001 - a heuristic: on any doubt, prefetch
            return False

    def _stats(self, owner: str | None, all_owners: bool = False) -> dict:
        planner = self.planner
        assert planner is not None
        index, reg = planner.index, planner.registry
        counters = index.counters
        sessions = [] if all_owners else [reg.session_info(s) for s in reg.sessions_of(owner)]
        return {
            "store": {
                "capacity_blocks": index.num_slots,
                "used_blocks": index.used_slots,
                "pinned_blocks": index.pinned_stored_slots,
                "block_bytes": self.block_bytes,
                "used_bytes": index.used_slots * self.block_bytes,
                "pin_budget_bytes": reg.pin_budget_bytes,
                # The same blocks as pinned_blocks: pinned and stored in host memory.
                "pinned_bytes": index.pinned_stored_slots * self.block_bytes,
                # What the pin budget is charged: also pins on blocks not stored (yet).
                "pin_budget_used_bytes": index.pinned_hashes * self.block_bytes,
                "evictions": counters.evictions,
                "saved_blocks": counters.saved_blocks,
                "loaded_blocks": counters.loaded_blocks,
            },
            "hits_tokens": dict(planner.hits_tokens),
            "requests": planner.requests,
            "remote_failed_tokens": planner.remote_failed_tokens,
            "pins_degraded": reg.pins_degraded,
            "pins_refused": reg.pins_refused,
            "prefetches": planner.prefetches,
            "prefetches_skipped": planner.prefetches_skipped,
            "num_sessions": len(reg.sessions),
            "sessions": sessions,
            "time": time.time(),
            **{name: section() for name, section in self.extra_stats.items()},
        }
