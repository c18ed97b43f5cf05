"""Prefill/decode disaggregation: vLLM's NIXL transport composed with the kvbranch connector.

``KVBranchPDConnector`` is a ``MultiConnector`` of two children, in this order:

1. :class:`VerifiedNixlConnector` — upstream ``NixlConnector`` (bidirectional mode: D keeps a
   finished conversation's blocks under a TTL and P pulls them back on the next turn), plus
   what upstream lacks for correctness and for these machines:

   * **token-prefix check**: D's returned transfer params carry the token ids its blocks hold;
     P pulls only the longest prefix of its prompt that equals them (upstream reads the first
     ``min(remote_num_tokens, prompt_len)`` positions unchecked, so a re-rendered chat history
     silently gets wrong KV — PD_NOTES pitfall 5). Params without token ids pull nothing.
   * NIXL's UCX **progress thread off** (pitfall 3: it busy-spins and halves a shared core; the
     engine polls NIXL every step anyway), and the forward thread's **CPU affinity kept**
     (pitfall 4: NIXL's worker re-pins it to the last core of each NUMA node).
2. :class:`~server.connector.connector.KVBranchConnector` — the host block store, sessions,
   pins, forks, prefetch, unchanged. MultiConnector asks NIXL first, so a D→P pull (which also
   covers the partial last block and D's generated tokens) wins over a host-store hit.

The composition adds two things across the children: the prompt split counts tokens pulled
from a peer as ``remote_hit_tokens``, and the finished request's transfer params (NIXL's) are
kept by request tag so that a *streaming* response can still return them (vLLM 0.32 returns
``kv_transfer_params`` only on non-streaming responses — pitfall 2).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as nixl_base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from server.connector.connector import KVBranchConnector

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvbranch.pd")

#: Key in D's transfer params: the token ids whose KV D holds (what P verifies against).
TOKENS_PARAM = "kvbranch_token_ids"
#: NIXL's own keys, the only ones a router needs to carry from D to P.
IDLE_STEP_SLEEP_S = 0.005
NIXL_PARAM_KEYS = ("do_remote_prefill", "do_remote_decode", "remote_block_ids",
                   "remote_engine_id", "remote_request_id", "remote_host", "remote_port",
                   "tp_size", "dcp_size", "pp_size", "remote_num_tokens",
                   "remote_blocks_expiry_time", "transfer_mode")


def verified_prefix(remote_tokens: Any, prompt_tokens: list[int]) -> int:
    """How many leading prompt tokens equal the tokens D holds KV for (0 if unknown).

    At most ``len(prompt) - 1``: the engine must compute the last prompt token itself."""
    if not isinstance(remote_tokens, list) or not prompt_tokens:
        return 0
    limit = min(len(remote_tokens), len(prompt_tokens) - 1)
    n = 0
    while n < limit and remote_tokens[n] == prompt_tokens[n]:
        n += 1
    return n


def _agent_config_without_progress_thread(original: Any) -> Any:
    if original is None:
        return None

    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        return original(*args, **kwargs)

    return make


class VerifiedNixlConnector(NixlConnector):
    """Upstream ``NixlConnector`` with the token-prefix check and CPU-friendly threading."""

    def __init__(self, vllm_config: "VllmConfig", role: "KVConnectorRole",
                 kv_cache_config: "KVCacheConfig") -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        patched = False
        if not extra.get("nixl_progress_thread", False):
            # vLLM builds the agent config inside the worker's __init__ and offers no switch.
            original = nixl_base_worker.nixl_agent_config
            nixl_base_worker.nixl_agent_config = _agent_config_without_progress_thread(original)
            patched = True
        try:
            super().__init__(vllm_config, role, kv_cache_config)
        finally:
            if patched:
                nixl_base_worker.nixl_agent_config = original
            if affinity is not None and os.sched_getaffinity(0) != affinity:
                os.sched_setaffinity(0, affinity)
                logger.info("kvbranch: kept the forward thread on cores %s (NIXL re-pinned it)",
                            sorted(affinity))

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if (params and params.get("do_remote_decode") and params.get("remote_block_ids")
                and "kvbranch_verified" not in params):
            held = int(params.get("remote_num_tokens") or 0)
            verified = verified_prefix(params.get(TOKENS_PARAM), request.prompt_token_ids or [])
            params["remote_num_tokens"] = min(held, verified)
            params["kvbranch_verified"] = params["remote_num_tokens"]
            params.pop(TOKENS_PARAM, None)  # done with them; keep the request small
            if verified < held and verified < len(request.prompt_token_ids or []) - 1:
                logger.info("kvbranch: request %s pulls %d of the %d tokens the peer holds "
                            "(token prefix differs after that)", request.request_id,
                            verified, held)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        with self._hold_only_for_sessions(request):
            delay, params = super().request_finished(request, block_ids)
        return delay, self._with_tokens(request, params)

    def request_finished_all_groups(self, request: "Request", block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        with self._hold_only_for_sessions(request):
            delay, params = super().request_finished_all_groups(request, block_ids)
        return delay, self._with_tokens(request, params)

    @contextlib.contextmanager
    def _hold_only_for_sessions(self, request: "Request") -> Iterator[None]:
        """D holds a finished request's blocks (and keeps its engine stepping, pitfall 7) only
        for a request in a session: nobody will ever pull a session-less request's KV."""
        sched = self.connector_scheduler
        params = request.kv_transfer_params
        skip = (sched is not None and sched.is_bidirectional_kv_xfer_enabled and bool(params)
                and not params.get("do_remote_decode")
                and not getattr(request, "session_id", None))
        if skip:
            sched.is_bidirectional_kv_xfer_enabled = False  # the scheduler is single-threaded
        try:
            yield
        finally:
            if skip:
                sched.is_bidirectional_kv_xfer_enabled = True

    @staticmethod
    def _with_tokens(request: "Request", params: dict[str, Any] | None) -> dict | None:
        # D's answer for the next turn: say exactly which tokens the held blocks encode.
        if params and params.get("do_remote_decode") and params.get("remote_num_tokens"):
            params[TOKENS_PARAM] = list(request.all_token_ids[:params["remote_num_tokens"]])
        return params


class KVBranchPDConnector(MultiConnector):
    """``MultiConnector([VerifiedNixlConnector, KVBranchConnector])`` with shared accounting."""

    def __init__(self, vllm_config: "VllmConfig", role: "KVConnectorRole",
                 kv_cache_config: "KVCacheConfig") -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._nixl_index = next((i for i, c in enumerate(self._connectors)
                                 if isinstance(c, NixlConnector)), None)
        self._kvbranch = next((c for c in self._connectors
                               if isinstance(c, KVBranchConnector)), None)
        if self._nixl_index is None or self._kvbranch is None:
            raise ValueError("KVBranchPDConnector needs a NixlConnector and a "
                             "KVBranchConnector among its connectors")

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> Any:
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Nothing to compute, yet the engine keeps stepping: D while it holds a turn's
            # blocks for P, P while it waits for a pull (PD_NOTES pitfall 7). Unthrottled, those
            # empty steps spin a core for the whole hold; a few ms per step costs a pull or a
            # new request at most that much.
            time.sleep(IDLE_STEP_SLEEP_S)
        return super().build_connector_meta(scheduler_output)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        planner = self._kvbranch.planner
        if (planner is not None and num_external_tokens
                and self._requests_to_connector.get(request.request_id) == self._nixl_index):
            planner.note_remote_hit(request, num_external_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(self, request: "Request",
                         blocks: list[int]) -> tuple[bool, dict[str, Any] | None]:
        delay, params = super().request_finished(request, blocks)
        planner = self._kvbranch.planner
        if planner is not None and params:
            nixl = {k: v for k, v in params.items() if k in NIXL_PARAM_KEYS or k == TOKENS_PARAM}
            if nixl:
                planner.remember_transfer_params(request, nixl)
        return delay, params


def _register_by_name() -> None:
    """MultiConnector rebuilds its children's stats in the API server by *registered name*
    (``KVConnectorFactory.get_connector_class_by_name``), which module-path connectors lack."""
    for name, module in (("VerifiedNixlConnector", __name__),
                         ("KVBranchConnector", "server.connector.connector"),
                         ("KVBranchPDConnector", __name__)):
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, name)


_register_by_name()
