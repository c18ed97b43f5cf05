"""P/D, the composition: ``KVBranchPDConnector``, a ``MultiConnector`` of
:class:`~server.connector.pd.verified_nixl.VerifiedNixlConnector` (NIXL with checked handles)
and :class:`~server.connector.engine.connector.KVBranchConnector` (the host store), in that
order; and the by-name registration MultiConnector needs in the API server.

The composition adds two things across the children: the prompt split counts tokens pulled
from a peer as ``remote_hit_tokens``, and the finished request's transfer params (NIXL's) are
kept by request tag so that a *streaming* response can still return them (vLLM 0.32 returns
``kv_transfer_params`` only on non-streaming responses — pitfall 2). Holds D keeps for P yield
to waiting work; an idle step sleeps a few ms instead of spinning a core (pitfall 7).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from server.connector.control.models import ClaimHold, HostCoverage, RunCoverage
from server.connector.control.ops import Op
from server.connector.engine.connector import KVBranchConnector
from server.connector.pd.host_coverage import host_coverage, run_coverage
from server.connector.pd.verified_nixl import NIXL_PARAM_KEYS, VerifiedNixlConnector
from server.connector.vllm_compat import (
    MultiConnector,
    NixlConnector,
    child_index_of,
    children_of,
    prompt_block_hasher,
    register_connector_by_name,
)

if TYPE_CHECKING:
    from server.connector.vllm_compat import (
        KVCacheBlocks,
        KVCacheConfig,
        KVConnectorRole,
        Request,
        SchedulerOutput,
        VllmConfig,
    )

logger = logging.getLogger("kvbranch.pd")

#: An empty engine step (a hold or a pull pending) sleeps this long.
IDLE_STEP_SLEEP_S = 0.005


class KVBranchPDConnector(MultiConnector):
    """``MultiConnector([VerifiedNixlConnector, KVBranchConnector])`` with shared accounting,
    the router's claim op, and holds that yield to new work."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        children = children_of(self)
        self._nixl_index = next(
            (i for i, c in enumerate(children) if isinstance(c, NixlConnector)), None
        )
        self._kvbranch = next((c for c in children if isinstance(c, KVBranchConnector)), None)
        if self._nixl_index is None or self._kvbranch is None:
            raise ValueError(
                "KVBranchPDConnector needs a NixlConnector and a "
                "KVBranchConnector among its connectors"
            )
        self._nixl = children[self._nixl_index]
        self.block_size = vllm_config.cache_config.block_size
        #: Requests the scheduler looked at this step and has not (yet) allocated.
        self._waiting: dict[str, Any] = {}
        self.stalled_steps = 0
        if isinstance(self._nixl, VerifiedNixlConnector):
            nixl = self._nixl
            self._kvbranch.extra_ops[ClaimHold.op] = Op(
                ClaimHold, lambda _side, req: nixl.claim_hold(req), locked=False
            )
            self._kvbranch.extra_ops[HostCoverage.op] = Op(
                HostCoverage, lambda side, req: host_coverage(req, side.planner.index, nixl.compat)
            )
            hasher = prompt_block_hasher(vllm_config, self.block_size)
            block_size = self.block_size
            self._kvbranch.extra_ops[RunCoverage.op] = Op(
                RunCoverage,
                lambda side, req: run_coverage(
                    req, side.planner.index, nixl.compat, hasher, block_size
                ),
            )
            self._kvbranch.extra_stats["pd"] = self._pd_stats

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        # MultiConnector binds only its children; the hold release reads the block pool too.
        super().bind_kv_cache_manager(kv_cache_manager)
        self._kv_cache_manager = kv_cache_manager

    def _pd_stats(self) -> dict[str, Any]:
        nixl = self._nixl
        holds = nixl.holds
        return {
            "holds": len(holds),
            "holds_placed": holds.placed,
            "held_blocks": holds.held_blocks(),
            "holds_released_for_new_work": holds.released_for_pressure,
            "claims": holds.claims,
            "claims_refused": holds.claims_refused,
            "stalled_steps": self.stalled_steps,
            "handles_declined": dict(nixl.declined),
            "reads_not_queued": nixl.reads_not_queued,
            "sync_reads": nixl.sync_reads,
            "sync_reads_not_landed": nixl.sync_reads_not_landed,
            "late_reads": nixl.pinned_reads.reads_reported,
            "late_read_blocks_pinned": nixl.pinned_reads.blocks_pinned,
        }

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._waiting[request.request_id] = request
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        try:
            self._yield_holds_to_waiting_work()
        except Exception:  # the scheduler thread: an exception here kills the engine core
            logger.exception("kvbranch: releasing holds for waiting work failed")
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Nothing to compute, yet the engine keeps stepping: D while it holds a turn's
            # blocks for P, P while it waits for a pull (docs/pd_notes.md pitfall 7).
            # Unthrottled, those empty steps spin a core for the whole hold; a few ms per step
            # costs a pull or a new request at most that much.
            time.sleep(IDLE_STEP_SLEEP_S)
        return super().build_connector_meta(scheduler_output)

    def _yield_holds_to_waiting_work(self) -> None:
        """A request the scheduler tried and could not allocate this step, while the device
        cache lacks the blocks it needs: release the oldest holds to cover it. (The scheduler
        has no hook for a failed allocation of a *waiting* request; ``get_num_new_matched_
        tokens`` without ``update_state_after_alloc`` in the same step is exactly that.)"""
        waiting, self._waiting = self._waiting, {}
        manager = self._kv_cache_manager
        nixl = self._nixl
        if (
            not waiting
            or manager is None
            or not isinstance(nixl, VerifiedNixlConnector)
            or not len(nixl.holds)
        ):
            return
        free = manager.block_pool.get_num_free_blocks()
        need = 0
        for request in waiting.values():
            need += (
                -(-max(request.num_tokens - request.num_computed_tokens, 1) // self.block_size) + 1
            )
        if need <= free:
            return  # not held back by KV (token budget, max-num-seqs): holds stay
        self.stalled_steps += 1
        nixl.release_holds(need - free)

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self._waiting.pop(request.request_id, None)
        planner = self._kvbranch.planner
        if (
            planner is not None
            and num_external_tokens
            and child_index_of(self, request.request_id) == self._nixl_index
        ):
            try:
                sync = self._nixl_sync(request)
                planner.note_remote_hit(request, num_external_tokens, landing_now=sync)
            except Exception:
                logger.exception("kvbranch: counting request %s's pull", request.request_id)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def _nixl_sync(self, request: Request) -> bool:
        nixl = self._nixl
        return isinstance(nixl, VerifiedNixlConnector) and nixl.loads_synchronously(request)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        planner = self._kvbranch.planner
        nixl = self._nixl
        if planner is None or not isinstance(nixl, VerifiedNixlConnector):
            return
        for request, landed in nixl.take_failed_sync_reads():
            try:
                planner.settle_failed_pull(request, landed)
            except Exception:
                logger.exception("kvbranch: counting request %s's pull", request.request_id)

    def request_finished(
        self, request: Request, blocks: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._waiting.pop(request.request_id, None)
        return self._keep_params(request, *super().request_finished(request, blocks))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM calls this one (every child declares ``SupportsHMA``); one group goes through
        :meth:`request_finished` as before."""
        if len(block_ids) == 1:
            return self.request_finished(request, block_ids[0])
        self._waiting.pop(request.request_id, None)
        finished = super().request_finished_all_groups(request, block_ids)
        return self._keep_params(request, *finished)

    def _keep_params(
        self, request: Request, delay: bool, params: dict[str, Any] | None
    ) -> tuple[bool, dict[str, Any] | None]:
        """D's handle kept by request tag, for the next turn's P (a streamed answer cannot
        carry it)."""
        planner = self._kvbranch.planner
        if planner is not None and params:
            nixl = {k: v for k, v in params.items() if k in NIXL_PARAM_KEYS}
            try:
                if nixl:
                    planner.remember_transfer_params(request, nixl)
            except Exception:
                logger.exception("kvbranch: keeping request %s's params", request.request_id)
        return delay, params


def _register_by_name() -> None:
    """MultiConnector rebuilds its children's stats in the API server by *registered name*
    (``KVConnectorFactory.get_connector_class_by_name``), which module-path connectors lack."""
    for name, module in (
        ("VerifiedNixlConnector", "server.connector.pd.verified_nixl"),
        ("KVBranchConnector", "server.connector.engine.connector"),
        ("KVBranchPDConnector", __name__),
    ):
        register_connector_by_name(name, module)


_register_by_name()
