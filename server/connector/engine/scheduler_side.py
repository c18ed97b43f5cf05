"""The connector's scheduler role: the host block index and the session registry behind a
:class:`Planner`, and the control socket the HTTP routes talk to.

The planner answers vLLM's scheduler hooks (matched tokens, allocations, finished requests)
and builds each step's :class:`KVBranchMetadata`; this object adds what is not planning:
settings (a :class:`~server.connector.config.ConnectorConfig`), the control socket and its op
table (``control/ops.py``), the device-residency probe behind prefetch, and store resets.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import TYPE_CHECKING, Any

from server.common.engine_choice import engine_of
from server.common.env import ENV_DATA_PARALLEL_SIZE
from server.connector.config import ConnectorConfig
from server.connector.control.ops import OPS, Op, run_op
from server.connector.control.transport import ControlServer, engine_socket_path
from server.connector.core.block_index import HostBlockIndex
from server.connector.core.kv_groups import WindowRule
from server.connector.core.metadata import DeviceBlock, KVBranchMetadata
from server.connector.core.planner import Planner
from server.connector.core.sessions import SessionRegistry
from server.connector.vllm_compat import cached_state_blocks

if TYPE_CHECKING:
    from server.connector.vllm_compat import SchedulerOutput

logger = logging.getLogger("kvbranch.connector")


class KVBranchScheduler:
    # Shape only beside sdk/testing.py's FakeKVBranchServer: a constructor that keeps its args.
    def __init__(
        self,
        *,
        block_size: int,
        block_bytes: int,
        num_slots: int,
        enabled: bool,
        config: ConnectorConfig,
        engine_index: int = 0,
        state_groups: frozenset[int] = frozenset(),
        num_groups: int = 1,
        window: WindowRule | None = None,
        window_slots: int = 0,
        window_bytes: int = 0,
        state_slots: int = 0,
        state_bytes: int = 0,
    ) -> None:
        #: The engine's KV geometry: tokens per block, bytes per block (every layer), and
        #: the host store's slots (one block each).
        self.block_size = block_size
        self.block_bytes = block_bytes
        self.num_slots = num_slots
        #: Windowed groups' parts (``core/part_pool.py``): how many, bytes of each.
        self.window_slots = window_slots
        self.window_bytes = window_bytes
        #: State groups' parts: how many, bytes of each.
        self.state_slots = state_slots
        self.state_bytes = state_bytes
        #: False when the host store is off (a KV cache layout it cannot serve: plain vLLM).
        self.enabled = enabled
        #: Control ops and stats sections contributed by a composing connector (P/D: holds).
        self.extra_ops: dict[str, Op[Any]] = {}
        self.extra_stats: dict[str, Any] = {}
        #: vLLM's KV cache manager (bound by the facade): the device-residency probe.
        self.kv_cache_manager: Any = None
        index = HostBlockIndex(num_slots, window_slots, state_slots)
        registry = SessionRegistry(
            index,
            block_size=block_size,
            block_bytes=max(block_bytes, 1),
            pin_budget_bytes=config.pin_budget,
            default_ttl_s=config.pin_ttl_s,
            max_sessions_per_tenant=config.max_sessions_per_tenant,
            max_branches_per_session=config.max_branches_per_session,
            tenant_pin_share=config.tenant_pin_share,
            idle_ttl_s=config.session_idle_ttl_s,
            require_owner=config.tenants,
        )
        engines = data_parallel_size()
        if engines > 1:
            registry.keeps_session = functools.partial(_keeps, engine_index, engines)
        self.planner = Planner(
            index,
            registry,
            block_size,
            state_groups=state_groups,
            num_groups=num_groups,
            window=window,
        )
        self.control: ControlServer | None = None
        path = config.control_socket
        if path:
            # One socket per engine core; the directory must be private (ControlServer
            # refuses to bind otherwise: the socket serves session ops to whoever connects).
            self.control = ControlServer(
                engine_socket_path(path, engine_index), self.handle_control
            )
        logger.info(
            "kvbranch connector (scheduler): block_size=%d block_bytes=%d "
            "host slots=%d window parts=%d of %d bytes state parts=%d of %d bytes (%.2f GiB) "
            "pin budget=%d bytes",
            block_size,
            block_bytes,
            num_slots,
            window_slots,
            window_bytes,
            state_slots,
            state_bytes,
            (num_slots * block_bytes + window_slots * window_bytes + state_slots * state_bytes)
            / (1 << 30),
            registry.leases.pin_budget_bytes,
        )

    # --- vLLM scheduler hooks ----------------------------------------------------------------
    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        if not self.enabled:
            return 0
        return self.planner.num_new_matched_tokens(request, num_computed_tokens)

    def build_meta(self, scheduler_output: SchedulerOutput) -> KVBranchMetadata:
        if not self.enabled:
            return KVBranchMetadata()
        block_state = scheduler_output.kv_connector_block_state
        resolve = (
            block_state.get_block_ids
            if block_state is not None
            else self.kv_cache_manager.get_block_ids
        )
        return self.planner.build_meta(
            scheduler_output.num_scheduled_tokens,
            resolve,
            self.cached_states if self.planner.state_groups else None,
        )

    def cached_states(self, block_hash: bytes) -> dict[int, int] | None:
        """Where vLLM's prefix cache keeps the recurrent states after this block (hybrid
        models: the planner saves them with the block)."""
        return cached_state_blocks(self.kv_cache_manager, block_hash, self.planner.state_groups)

    def request_finished(
        self, request: Any, block_ids: list[DeviceBlock]
    ) -> tuple[bool, dict | None]:
        # Blocks stay allocated while the tail is copied out (one step; see tails.py).
        split, delay = self.planner.finish(request, block_ids if self.enabled else None)
        return delay, ({"kvbranch": split} if split else None)

    def reset_cache(self) -> bool:
        """``POST /reset_prefix_cache?reset_external=true`` (and vLLM's own cache clears: a
        pause or sleep that clears caches, and ``engine/weight_changes.py`` after new weights or a
        reloaded LoRA): forget every block and tail, pinned or not, and every pin. Sessions
        and branches stay; their KV is recomputed."""
        dropped = self.planner.reset_store()
        logger.info("kvbranch: host store reset (%d blocks and tails dropped, pins too)", dropped)
        return True

    def shutdown(self) -> None:
        if self.control is not None:
            self.control.close()
            self.control = None

    # --- control socket ------------------------------------------------------------------------
    def handle_control(self, req: dict) -> Any:
        """One control line (a decoded JSON object) -> its JSON-able answer: the op table and
        the composing connector's ops, typed and validated by :func:`run_op`."""
        return run_op(self, {**OPS, **self.extra_ops} if self.extra_ops else OPS, req)

    def device_resident(self, block_hashes: list[bytes]) -> bool:
        """Whether every full block of a branch is still in vLLM's device prefix cache.

        Then a prefetch would only bring the partial last block (which the next turn loads
        from the host store anyway) and take an engine step from other sessions, so it is
        skipped. Read from the control thread without the scheduler's lock: a stale answer
        only costs one unneeded or one missing prefetch, never a wrong result."""
        manager = self.kv_cache_manager
        if manager is None or not block_hashes:
            return False
        pool = manager.block_pool
        try:
            return all(pool.get_cached_block(h, [0]) is not None for h in block_hashes)
        except Exception:  # noqa: BLE001 - a heuristic: on any doubt, prefetch
            return False


def data_parallel_size() -> int:
    """The data-parallel engines of this server, as the launcher passed them (vLLM resets its own
    count to 1 in a dense model's engine core); 1 when unset or not a number."""
    value = os.environ.get(ENV_DATA_PARALLEL_SIZE, "")
    return int(value) if value.isdigit() and int(value) > 0 else 1


def _keeps(engine_index: int, engines: int, owner: str | None, session_id: str) -> bool:
    return engine_of(owner, session_id, engines) == engine_index
