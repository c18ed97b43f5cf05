"""P/D, the NIXL child: upstream ``NixlConnector`` with verified, claimed, single-use handles.

(The composition, ``KVBranchPDConnector``, is in :mod:`server.connector.pd.connector`.)

``KVBranchPDConnector`` is a ``MultiConnector`` of two children, in this order:

1. :class:`VerifiedNixlConnector` — upstream ``NixlConnector`` (bidirectional mode: D keeps a
   finished conversation's blocks under a TTL and P pulls them back on the next turn), plus
   what upstream lacks for correctness and for these machines:

   * **handles checked on first sight**: the client's ``kv_transfer_params`` are cut to an
     allow-list before upstream reads them (no client-set marker survives), a
     handle naming a peer must be sealed, fresh, claimed (P), unused and of this engine's
     identity (tenant, adapter, model, KV dtype, block size), and the verdict is kept here,
     per engine request, not in the params (:mod:`~server.connector.pd.transfer_params`,
     :mod:`~server.connector.pd.transfer_auth`). A declined handle is stripped of every field
     that names a peer: the request recomputes and NIXL contacts nobody.
   * **token-prefix check**: D's returned transfer params carry the token ids its blocks hold;
     P pulls only the longest prefix of its prompt that equals them (upstream reads the first
     ``min(remote_num_tokens, prompt_len)`` positions unchecked, so a re-rendered chat history
     silently gets wrong KV — docs/pd_notes.md pitfall 5). Params without token ids pull nothing.
     A request that reads no prefix cache (prompt logprobs) pulls nothing.
   * **hooks that never kill the engine**: an exception of ours or of upstream's on vLLM's
     scheduler thread declines the handle instead; a read the scheduler waits on but
     upstream never queued is reported received-with-nothing (recompute), and a read in
     flight past ``pull_timeout_s`` is failed through upstream's failure path.
   * NIXL's UCX **progress thread paced** (pitfall 3: upstream's busy-spins and halves a shared
     core; with none, a peer's read waits for the end of the engine's current forward, so the
     thread polls every ``nixl_progress_delay_us``), and the forward thread's **CPU affinity kept**
     (pitfall 4: NIXL's worker re-pins it to the last core of each NUMA node).
2. :class:`~server.connector.engine.connector.KVBranchConnector` — the host block store, sessions,
   pins, forks, prefetch, unchanged. MultiConnector asks NIXL first, so a D→P pull (which also
   covers the partial last block and D's generated tokens) wins over a host-store hit.

The composition adds two things across the children: the prompt split counts tokens pulled
from a peer as ``remote_hit_tokens``, and the finished request's transfer params (NIXL's) are
kept by request tag so that a *streaming* response can still return them (vLLM 0.32 returns
``kv_transfer_params`` only on non-streaming responses — pitfall 2).

(Over 400 lines on purpose: the class overrides NIXL's hooks that must all see the same handle
checks and hold registry within one request's life; the pure handle logic lives in
``transfer_params.py`` and ``transfer_auth.py``, the holds in ``hold_registry.py``. Splitting
the hooks apart would spread one request's verification over files.)
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from server.connector.config import NixlChildConfig
from server.connector.control.models import ClaimHold
from server.connector.control.transport import ControlError
from server.connector.pd import side_channel
from server.connector.pd.hold_registry import CLAIM_MARGIN_S, Hold, HoldRegistry
from server.connector.pd.late_reads import LateReads, PinnedReads, ReadReport
from server.connector.pd.read_bounds import fail_slow_reads, report_unqueued
from server.connector.pd.sync_reads import (
    READ_DONE,
    READ_FAILED,
    SYNC_READS_ATTR,
    wait_for_reads,
)
from server.connector.pd.transfer_auth import (
    CLAIM_FIELD,
    EXPIRES_FIELD,
    HASHES_FIELD,
    IDENTITY_FIELD,
    MAC_FIELD,
    TOKENS_FIELD,
    ConsumedHandles,
    claim_valid,
    is_sealed,
    load_cluster_secret,
    make_claim,
    seal,
)
from server.connector.pd.transfer_auth import expired as transfer_expired
from server.connector.pd.transfer_params import (
    INCOMING_KEYS,
    block_hashes_hex,
    compat_of,
    identity_of,
    names_a_peer,
    pullable_tokens,
    sanitize,
    strip,
    trim_block_ids,
)
from server.connector.vllm_compat import (
    NixlConnector,
    announce_in_batch,
    block_ids_of,
    forget_unprocessed,
    host_buffer_reads,
    lease_duration_s,
    make_read_synchronous,
    nixl_progress_thread,
    read_in_flight,
    read_tracked,
    reads_need_post_processing,
    set_send_deadline,
    skip_unstarted_read,
    transfer_group_kinds,
    waits_for_read,
)

if TYPE_CHECKING:
    from server.connector.vllm_compat import KVCacheConfig, KVConnectorRole, Request, VllmConfig

logger = logging.getLogger("kvbranch.pd")

#: NIXL's own keys and ours, the only ones a router needs to carry from D to P.
NIXL_PARAM_KEYS = tuple(sorted(INCOMING_KEYS))
# The defaults of claim_ttl_s, decoder_kv_blocks_ttl, pull_timeout_s: server/connector/config.py.
#: Requests whose verdict is kept at once (each entry ends with its request; the bound only
#: matters if vLLM never reported some request finished).
MAX_TRACKED_REQUESTS = 65536
#: Why a handle was declined (the ``reason`` label of the metric, the log's words).
DECLINE_REASONS = {
    "unsealed": "not issued by this cluster (bad or missing seal)",
    "expired": "expired",
    "unclaimed": "no valid claim from the decode instance",
    "claim_ended": "the claim ran out while the request waited",
    "reused": "handle already used",
    "identity": "another cache salt, LoRA adapter, input kind, model, KV dtype or block size",
    "tokens": "the prompt differs from the tokens the peer computed",
    "malformed": "names a peer without one direction (pull or be pulled from)",
    "no_prefix_cache": "the request reads no prefix cache (e.g. prompt logprobs)",
    "error": "a check or upstream's connector failed on it (logged)",
}
#: D stamps its handle to expire this long before its own hold ends.
EXPIRY_MARGIN_S = 2.0


def _finished(request: Any) -> bool:
    try:
        return bool(request.is_finished())
    except Exception:
        return True


def _forget_checked(params: dict[str, Any]) -> None:
    """Checked once per request: the token ids and hashes are done with (keep it small)."""
    for key in (TOKENS_FIELD, HASHES_FIELD):
        params.pop(key, None)


@dataclass
class _Seen:
    """This instance's verdict on one engine request's handle. Kept here, keyed by the Request
    object, never in the request's params (the client writes those) nor by request id (vLLM
    0.32 appends 8 random characters to the client's id, unless
    ``VLLM_DISABLE_REQUEST_ID_RANDOMIZATION``: then a client picks it whole)."""

    request: Any  # held: its id() is not reused while the entry lives
    pull: bool = False  # P: a verified handle of D's, pulled only while its claim holds
    processed: bool = False  # upstream has had its one allocation for this request
    local_tokens: int = 0  # the block-aligned local hit the scheduler last offered
    sync: bool = False  # P: the pull is loaded before this step's forward (sync_reads.py)


class VerifiedNixlConnector(NixlConnector):
    """Upstream ``NixlConnector`` with verified, claimed, single-use handles and CPU-friendly
    threading (see the module docstring and :mod:`server.connector.pd.transfer_auth`).

    Every scheduler hook first *admits* the request (once: :meth:`_admit`), then calls
    upstream. No exception of ours or of upstream's on a hostile handle leaves a hook: the
    handle is declined (stripped: recompute) and upstream is called again without it, since an
    exception on vLLM's scheduler thread kills the engine core."""

    #: Set from the config in ``__init__`` (see there); upstream's asynchronous loads until then.
    sync_pulls = False
    sync_pull_wait_s = 0.0

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        config = NixlChildConfig.from_extra(
            vllm_config.kv_transfer_config.kv_connector_extra_config
        )
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        quiet = (
            contextlib.nullcontext()  # upstream's busy-spinning thread, asked for
            if config.nixl_progress_thread
            else nixl_progress_thread(  # 0: none
                config.nixl_progress_delay_us or None, lowered=config.nixl_threads_lowered
            )
        )
        try:
            with quiet:
                super().__init__(vllm_config, role, kv_cache_config)
        finally:
            if affinity is not None and os.sched_getaffinity(0) != affinity:
                os.sched_setaffinity(0, affinity)
                logger.info(
                    "kvbranch: kept the forward thread on cores %s (NIXL re-pinned it)",
                    sorted(affinity),
                )
        self.block_size = vllm_config.cache_config.block_size
        #: The kind of each KV cache group a handle's block lists address, in order.
        self.group_kinds = transfer_group_kinds(kv_cache_config)
        if len(self.group_kinds) > 1:
            logger.info(
                "kvbranch: NIXL pulls address %d KV cache groups (%s)",
                len(self.group_kinds),
                ", ".join(self.group_kinds),
            )
        self.compat = compat_of(vllm_config)
        self.secret = load_cluster_secret()
        # NIXL's handshake listener and requester: authenticated, and no frame kills them.
        self.side_channel = side_channel.install(
            self.connector_scheduler, self.connector_worker, self.secret
        )
        self.consumed = ConsumedHandles()
        self.holds = HoldRegistry(config.claim_ttl_s)
        self.hold_ttl_s = float(config.decoder_kv_blocks_ttl)
        self.pull_timeout_s = config.pull_timeout_s
        self.aggregated = config.aggregated
        self.sync_pull_wait_s = config.sync_pull_wait_s
        #: Synchronous pulls need what a failed one relies on: one KV cache group (vLLM maps
        #: a load error back to requests by block id only then), vLLM's recompute policy, and
        #: reads that land where the forward reads them (no host buffer).
        self.sync_pulls = (
            self.sync_pull_wait_s > 0
            and len(self.group_kinds) == 1
            and vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
            and not host_buffer_reads(self.connector_scheduler)
        )
        self.declined: dict[str, int] = {}
        self._init_tracking()

    def _init_tracking(self) -> None:
        self._seen: dict[int, _Seen] = {}
        #: Requests the scheduler waits on for a read upstream never queued: request id ->
        #: (request, tokens valid locally). Reported received-with-nothing at the next output.
        self._unqueued: dict[str, tuple[Any, int]] = {}
        #: Worker: when each read in flight was first seen (monotonic).
        self._read_started: dict[str, float] = {}
        self.reads_timed_out = 0  # worker process
        self.reads_not_queued = 0
        #: Scheduler: this step's synchronous reads, for the worker (see ``SYNC_READS_ATTR``).
        self._sync_next: dict[str, list[int] | None] = {}
        #: Worker: synchronous reads upstream has not reported yet (never to the scheduler,
        #: which asserts that a reported request is parked or finished).
        self._sync_ids: set[str] = set()
        #: Worker: blocks of synchronous reads that did not land, this step's load errors.
        self._sync_invalid: set[int] = set()
        #: Worker: whether each of this step's synchronous reads landed, for the scheduler.
        self._sync_landed: dict[str, bool] = {}
        #: Scheduler: synchronous reads (their requests) until a worker's report says whether
        #: they landed (reported by request id: with asynchronous scheduling the next step's
        #: reads are queued before this step's output arrives); then (request, tokens landed).
        self._sync_inflight: dict[str, Any] = {}
        self._sync_failed: list[tuple[Any, int]] = []
        self.sync_reads = 0  # scheduler
        self.sync_reads_not_landed = 0  # scheduler, from the workers' reports
        #: Worker: pulls given up while in flight, polled until they end (late_reads.py).
        self.late_reads = LateReads()
        #: Scheduler: their blocks, pinned until then.
        self.pinned_reads = PinnedReads()

    # --- first sight ----------------------------------------------------------------------
    def _admit(self, request: Request) -> _Seen:
        """The server's record of ``request``, made on first sight: the client's params cut
        to :data:`~server.connector.pd.transfer_params.INCOMING_KEYS` and a handle naming a peer
        checked, before upstream reads any of it."""
        key = id(request)
        seen = self._seen.get(key)
        if seen is not None and seen.request is request:
            return seen
        if len(self._seen) >= MAX_TRACKED_REQUESTS:
            self._seen = {k: v for k, v in self._seen.items() if not _finished(v.request)}
        seen = self._seen[key] = _Seen(request)
        params = request.kv_transfer_params
        if params is None:
            return seen
        if not isinstance(params, dict):
            request.kv_transfer_params = None  # upstream calls .get() on it
            return seen
        dropped = sanitize(params)
        if dropped:
            logger.warning(
                "kvbranch: request %s: dropped transfer params a client may not set: %s",
                request.request_id,
                ", ".join(sorted(str(k)[:40] for k in dropped)[:8]),
            )
        if names_a_peer(params):
            try:
                self._check_first(request, params, seen)
            except Exception:
                logger.exception(
                    "kvbranch: checking request %s's handle failed", request.request_id
                )
                self._decline(request, params, "error")
        return seen

    def _check_first(self, request: Request, params: dict[str, Any], seen: _Seen) -> None:
        if params.get("do_remote_decode"):
            if params.get("do_remote_prefill"):
                self._decline(request, params, "malformed")
            elif getattr(request, "skip_reading_prefix_cache", False):
                # vLLM computes such a request's whole prompt (prompt logprobs need it) and
                # would drop the pulled tokens; upstream would still contact D for them.
                self._decline(request, params, "no_prefix_cache")
            else:
                seen.pull = self._check_pull(request, params)
        elif params.get("do_remote_prefill"):
            # (D with no prefix cache read: vLLM loads nothing and upstream only tells P to
            # free its blocks, which is right: checked like any other handle.)
            self._check_prefill_handle(request, params)
        else:
            self._decline(request, params, "malformed")

    def _hook_failed(self, request: Request, hook: str) -> None:
        """An exception in a scheduler hook: log it, decline the handle, never re-raise."""
        logger.exception(
            "kvbranch: %s failed for request %s: its transfer handle is declined",
            hook,
            getattr(request, "request_id", "?"),
        )
        try:
            seen = self._seen.get(id(request))
            if seen is not None:
                seen.pull = False
            params = request.kv_transfer_params
            if isinstance(params, dict):
                self._decline(request, params, "error")
        except Exception:
            request.kv_transfer_params = None  # nothing left for upstream to act on

    def _upstream(self, request: Request, hook: str, call: Callable[[], Any], default: Any) -> Any:
        """Upstream's hook; if it raises (on params a client shaped), again without a handle."""
        try:
            return call()
        except Exception:
            self._hook_failed(request, f"upstream {hook}")
        try:
            return call()
        except Exception:
            logger.exception("kvbranch: upstream %s failed again without a handle", hook)
            return default

    def on_new_request(self, request: Request) -> None:
        # vLLM's first connector call for a request: upstream starts heartbeats to the peer the
        # params name here, so they are admitted first.
        try:
            self._admit(request)
        except Exception:
            self._hook_failed(request, "on_new_request")
        upstream = super().on_new_request
        self._upstream(request, "on_new_request", lambda: upstream(request), None)

    # --- P: pulling D's blocks; D: reading P's blocks ---------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        seen: _Seen | None = None
        try:
            seen = self._admit(request)
            if seen.processed:
                # One read per request. Upstream leaves D's block list in the params after it
                # queued the read; a P request asked again would be told to wait for a second
                # read upstream never queues: "KV fetch in progress" for good. Asked again:
                # preempted, or put back in the queue after its read failed (the recompute
                # policy: the hold ended before the read, D died), which must recompute
                # (docs/pd.md, "A pull that fails").
                return 0, False
            seen.local_tokens = num_computed_tokens
            params = request.kv_transfer_params
            if seen.pull and isinstance(params, dict):
                # Every time the scheduler asks: a request that waits for blocks may see
                # its claim run out.
                if not claim_valid(params, self.secret, CLAIM_MARGIN_S):
                    seen.pull = False
                    self._decline(request, params, "claim_ended")
        except Exception:
            self._hook_failed(request, "get_num_new_matched_tokens")
        upstream = super().get_num_new_matched_tokens
        count, load_async = self._upstream(
            request,
            "get_num_new_matched_tokens",
            lambda: upstream(request, num_computed_tokens),
            (0, False),
        )
        if seen is not None:
            seen.sync = bool(load_async and count and seen.pull and self.sync_pulls)
            if seen.sync:
                return count, False
        return count, load_async

    def _decline(self, request: Request, params: dict[str, Any], why: str) -> None:
        self.declined[why] = self.declined.get(why, 0) + 1
        logger.info(
            "kvbranch: request %s declines the peer's transfer handle (%s): recomputing",
            request.request_id,
            DECLINE_REASONS.get(why, why),
        )
        strip(params)

    def _verify(self, params: dict[str, Any]) -> str | None:
        """Why a handle cannot be honoured at all (forged, expired), or None."""
        if not is_sealed(params, self.secret):
            return "unsealed"
        if transfer_expired(params):
            return "expired"
        return None

    def _consume_or_decline(
        self, request: Request, params: dict[str, Any], why: str | None
    ) -> bool:
        """The last check of both directions: a handle that passed every other one is used
        now (a replay is declined). False when the handle was declined."""
        if why is None and not self.consumed.consume(
            params[MAC_FIELD], float(params[EXPIRES_FIELD])
        ):
            why = "reused"
        if why is not None:
            self._decline(request, params, why)
            return False
        return True

    def _check_pull(self, request: Request, params: dict[str, Any]) -> bool:
        """P, on first sight, before pulling D's blocks: sealed, fresh, claimed, same identity,
        unused; then cut to the verified token prefix. False when declined."""
        why = self._verify(params)
        if why is None and not claim_valid(params, self.secret, CLAIM_MARGIN_S):
            why = "unclaimed"
        if why is None and params.get(IDENTITY_FIELD) != identity_of(request, self.compat):
            why = "identity"
        if not self._consume_or_decline(request, params, why):
            return False
        held = params.get("remote_num_tokens")
        pull = pullable_tokens(params, request, self.block_size, self.compat)
        trimmed = (
            trim_block_ids(
                params.get("remote_block_ids"),
                pull,
                self.block_size,
                self.group_kinds,
                held if isinstance(held, int) and not isinstance(held, bool) else None,
            )
            if pull
            else None
        )
        if not pull or trimmed is None:
            pull = 0  # D frees its blocks on P's notification (upstream's full-hit path)
        else:
            params["remote_block_ids"] = trimmed
        claim_perf = params[CLAIM_FIELD].get("until_perf")
        if isinstance(claim_perf, (int, float)):
            # NIXL's worker declines a read that would start after D's deadline: make that
            # deadline the claim's, which is when D may release the hold for new work.
            current = params.get("remote_blocks_expiry_time")
            params["remote_blocks_expiry_time"] = (
                min(current, claim_perf) if isinstance(current, (int, float)) else claim_perf
            )
        params["remote_num_tokens"] = pull
        _forget_checked(params)
        if isinstance(held, int) and pull < held and pull < len(request.prompt_token_ids or []) - 1:
            logger.info(
                "kvbranch: request %s pulls %d of the %d tokens the peer holds "
                "(tokens or identity differ after that)",
                request.request_id,
                pull,
                held,
            )
        return True

    def _check_prefill_handle(self, request: Request, params: dict[str, Any]) -> None:
        """D, before reading P's blocks for its prompt: sealed, fresh, unused, and P's blocks
        encode exactly this prompt with this identity."""
        why = self._verify(params)
        if why is None and params.get(IDENTITY_FIELD) != identity_of(request, self.compat):
            why = "identity"
        if why is None:
            prompt = list(request.prompt_token_ids or [])
            held = params.get("remote_num_tokens")
            tokens = params.get(TOKENS_FIELD)
            if (
                not isinstance(held, int)
                or not isinstance(tokens, list)
                or held > len(prompt)
                or tokens[:held] != prompt[:held]
            ):
                why = "tokens"
        if self._consume_or_decline(request, params, why):
            _forget_checked(params)

    # --- the worker's lease tracking ------------------------------------------------------
    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        try:
            seen: _Seen | None = self._admit(request)
        except Exception:
            seen = None
            self._hook_failed(request, "update_state_after_alloc")
        upstream = super().update_state_after_alloc
        self._upstream(
            request,
            "update_state_after_alloc",
            lambda: upstream(request, blocks, num_external_tokens),
            None,
        )
        try:
            if seen is not None:
                seen.processed = True
            sched = self.connector_scheduler
            if seen is not None and seen.sync and num_external_tokens and sched is not None:
                self._queue_sync_read(sched, request, blocks, num_external_tokens, seen)
            elif (
                num_external_tokens
                and sched is not None
                and not waits_for_read(sched, request.request_id)
            ):
                # The scheduler now waits for a read (this connector said "load async") that
                # upstream did not queue (it failed, or a path of its skips the read): that
                # wait never ends. No read can start, so it is safe to report the request
                # received with only its local tokens valid: vLLM recomputes the rest.
                local = seen.local_tokens if seen is not None else 0
                self._unqueued[request.request_id] = (request, local)
                logger.warning(
                    "kvbranch: request %s: no read was queued for its %d remote tokens: "
                    "recomputing them",
                    request.request_id,
                    num_external_tokens,
                )
            if self._held_when_finished(request):
                # Upstream's worker sets (and reaps) the lease of a finished request only if
                # the request was announced "in batch", which upstream does only for a request
                # that reads a peer's blocks. D's decode-only turns (the router's fallback
                # while P is unreachable: ``do_remote_prefill: false``) and turns whose handle
                # D declined read nothing, yet D holds their blocks too: unannounced, those
                # blocks were never freed, not by P's read, not by the hold's TTL, not by a
                # release under pressure, until D's cache filled and new turns waited forever.
                announce_in_batch(sched, request.request_id)
        except Exception:
            self._hook_failed(request, "update_state_after_alloc")

    def _queue_sync_read(
        self, sched: Any, request: Request, blocks: Any, num_external_tokens: int, seen: _Seen
    ) -> None:
        """The read of a synchronous pull goes into the blocks of the pulled range (the
        scheduler already cached them: upstream would find none unhashed), for the worker to
        wait for before this step's forward. No read queued (upstream skipped it): those blocks
        are reported as load errors, so vLLM recomputes them rather than read them empty."""
        first = seen.local_tokens // self.block_size
        count = -(-num_external_tokens // self.block_size)
        ids = list(blocks.get_block_ids()[0][first : first + count])
        request_id = request.request_id
        self.sync_reads += 1
        self._sync_inflight[request_id] = request
        if make_read_synchronous(sched, request_id, [ids], (first,)):
            self._sync_next[request_id] = None
            return
        self._sync_next[request_id] = ids
        logger.warning(
            "kvbranch: request %s: no read was queued for its %d remote tokens: recomputing them",
            request_id,
            num_external_tokens,
        )

    def loads_synchronously(self, request: Request) -> bool:
        """Scheduler: ``request``'s pull is loaded before its step's forward."""
        seen = self._seen.get(id(request))
        return seen is not None and seen.request is request and seen.sync

    def take_failed_sync_reads(self) -> list[tuple[Any, int]]:
        """Scheduler: the synchronous reads the last step's output reported not landed, as
        (request, tokens that did land), once."""
        failed, self._sync_failed = self._sync_failed, []
        return failed

    def _settle_sync_reads(self, landed: dict[str, bool]) -> None:
        """A read that did not land had all its blocks reported as load errors: none landed."""
        for request_id, ok in landed.items():
            request = self._sync_inflight.pop(request_id, None)
            if request is not None and not ok:
                self.sync_reads_not_landed += 1
                self._sync_failed.append((request, 0))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        meta = super().build_connector_meta(scheduler_output)
        if self._sync_next:
            setattr(meta, SYNC_READS_ATTR, self._sync_next)
            self._sync_next = {}
        return meta

    def _is_d_turn(self, request: Request) -> bool:
        """A turn that D (bidirectional mode) would hold when it finishes: it carries transfer
        params and is not P's prefill leg. Held only when it is in a session."""
        sched = self.connector_scheduler
        params = request.kv_transfer_params
        return (
            sched is not None
            and sched.is_bidirectional_kv_xfer_enabled
            and bool(params)
            and not params.get("do_remote_decode")
        )

    def _held_when_finished(self, request: Request) -> bool:
        """D will hold this request's blocks for a pull when it finishes."""
        return self._is_d_turn(request) and bool(getattr(request, "session_id", None))

    def _forget_unheld(self, request: Request, delay: bool) -> None:
        """A request that ends without a hold leaves the worker's tracking (upstream forgets
        only aborted ones: a session-less D turn stayed in the worker's set for good)."""
        sched = self.connector_scheduler
        if sched is not None and not delay and request.kv_transfer_params:
            forget_unprocessed(sched, request.request_id)

    # --- issuing handles ------------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        upstream = super().request_finished
        return self._finish(request, "request_finished", lambda: upstream(request, block_ids))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        upstream = super().request_finished_all_groups
        return self._finish(
            request, "request_finished_all_groups", lambda: upstream(request, block_ids)
        )

    def _finish(
        self, request: Request, hook: str, upstream: Callable[[], tuple[bool, Any]]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Upstream's finish under the session rule, then our handle; the request's record
        ends here (whatever vLLM asks afterwards names it by id only)."""
        try:
            self._admit(request)  # aborted before the scheduler ever looked at it
        except Exception:
            self._hook_failed(request, hook)

        def finish() -> tuple[bool, Any]:
            self._finish_as_replica(request)
            with self._hold_only_for_sessions(request):
                return upstream()

        delay, params = self._upstream(request, hook, finish, (False, None))
        try:
            self._forget_unheld(request, delay)
            return delay, self._issue(request, delay, params)
        except Exception:
            logger.exception("kvbranch: sealing request %s's handle failed", request.request_id)
            return delay, None  # nobody can use an unsealed handle; D's hold ends by its TTL
        finally:
            entry = self._seen.get(id(request))
            if entry is not None and entry.request is request:
                del self._seen[id(request)]
            self._sync_inflight.pop(request.request_id, None)

    def _finish_as_replica(self, request: Request) -> None:
        """An aggregated replica's turn ends as D's turns do, whichever way its history came:
        upstream reads ``do_remote_decode`` (set for the pull) as "a P's prefill leg" and would
        hold the blocks for a D's read of the prompt, with P's lease and a handle for D. Its
        read is done by now (one per request), so the flag has no other use left."""
        params = request.kv_transfer_params
        if self.aggregated and isinstance(params, dict) and params.get("do_remote_decode"):
            params["do_remote_decode"] = False

    @contextlib.contextmanager
    def _hold_only_for_sessions(self, request: Request) -> Iterator[None]:
        """D holds a finished request's blocks (and keeps its engine stepping, pitfall 7) only
        for a request in a session: nobody will ever pull a session-less request's KV."""
        sched = self.connector_scheduler
        skip = self._is_d_turn(request) and not getattr(request, "session_id", None)
        if skip:
            sched.is_bidirectional_kv_xfer_enabled = False  # the scheduler is single-threaded
        try:
            yield
        finally:
            if skip:
                sched.is_bidirectional_kv_xfer_enabled = True

    def _issue(
        self, request: Request, delay: bool, params: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """Seal the handle this instance gives out: the tokens and block hashes its blocks
        encode, the request's identity, an expiry; D also registers the hold."""
        if not params or not delay or not params.get("remote_block_ids"):
            return params
        n = int(params.get("remote_num_tokens") or 0)
        params[TOKENS_FIELD] = list(request.all_token_ids[:n])
        params[HASHES_FIELD] = block_hashes_hex(request, n // self.block_size)
        params[IDENTITY_FIELD] = identity_of(request, self.compat)
        is_d = bool(params.get("do_remote_decode"))
        sched = self.connector_scheduler
        lease = self.hold_ttl_s if is_d else lease_duration_s(sched)
        params[EXPIRES_FIELD] = round(time.time() + lease - EXPIRY_MARGIN_S, 3)
        seal(params, self.secret)
        if is_d:
            groups = params["remote_block_ids"]
            blocks = (
                sum(len(g) for g in groups if isinstance(g, list))
                if groups and isinstance(groups[0], list)
                else len(groups)
            )
            self.holds.add(Hold(request.request_id, params[MAC_FIELD], blocks))
        return params

    # --- holds: claims and release under pressure ----------------------------------------
    def claim_hold(self, req: ClaimHold) -> dict:
        """Control op: the router claims D's handle right before P's pull."""
        handle = req.handle
        if not is_sealed(handle, self.secret):
            raise ControlError(400, "handle: not a transfer handle issued by this cluster")
        if transfer_expired(handle):
            raise ControlError(410, "handle expired: the hold has ended")
        until = self.holds.claim(
            str(handle.get("remote_request_id")), handle[MAC_FIELD], float(handle[EXPIRES_FIELD])
        )
        if until is None:
            raise ControlError(410, "hold released, unknown or already claimed: recompute")
        return {CLAIM_FIELD: make_claim(handle, until, self.secret)}

    def release_holds(self, need_blocks: int) -> int:
        """Scheduler thread: end the oldest releasable holds now (their blocks are freed when
        the worker reports them sent, at the next step). Returns how many were released."""
        sched = self.connector_scheduler
        if sched is None or need_blocks <= 0:
            return 0
        ids = self.holds.release_oldest(need_blocks)
        if ids:
            past = time.perf_counter() - 1.0
            for request_id in ids:
                # The worker rebases the deadline onto its clock and reaps it as expired.
                # Announced again, so that the worker tracks it even if it never did (a
                # released hold the worker ignored would keep its blocks for good); it is still
                # held here, so the worker reports it sent exactly once.
                announce_in_batch(sched, request_id)
                set_send_deadline(sched, request_id, past)
            logger.warning(
                "kvbranch: released %d held conversation(s) for new work (device "
                "KV full); their next turn recomputes or uses the host store",
                len(ids),
            )
        return len(ids)

    def update_connector_output(self, connector_output: Any) -> None:
        try:
            for request_id in connector_output.finished_sending or ():
                self.holds.done(request_id)
            self._report_unqueued(connector_output)
            report = getattr(connector_output, "kv_connector_worker_meta", None)
            if isinstance(report, ReadReport):
                self.pinned_reads.apply(report)
                self._settle_sync_reads(report.sync_landed)
        except Exception:
            logger.exception("kvbranch: update_connector_output")
        super().update_connector_output(connector_output)

    def _report_unqueued(self, connector_output: Any) -> None:
        if self._unqueued:
            pending, self._unqueued = self._unqueued, {}
            self.reads_not_queued += report_unqueued(pending, connector_output)

    # --- worker: synchronous reads land before the forward ---------------------------------
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        super().start_load_kv(forward_context, **kwargs)
        meta = self._connector_metadata
        sync = getattr(meta, SYNC_READS_ATTR, None)
        worker = self.connector_worker
        if sync and worker is not None:
            self._wait_for_sync_reads(worker, meta, sync)

    def _wait_for_sync_reads(
        self, worker: Any, meta: Any, sync: dict[str, list[int] | None]
    ) -> None:
        """Before the forward: wait for this step's synchronous reads; the blocks of those that
        did not land become this step's load errors (vLLM recomputes them)."""
        reads: dict[str, Any] = {}
        for request_id, unqueued in sync.items():
            if unqueued is not None:
                self._sync_invalid.update(unqueued)
                self._sync_landed[request_id] = False
            elif request_id in meta.reqs_to_recv:
                reads[request_id] = meta.reqs_to_recv[request_id]
                self._sync_ids.add(request_id)
        if not reads:
            return
        try:
            states = (
                {r: "unsupported" for r in reads}
                if reads_need_post_processing(worker)
                else wait_for_reads(worker, list(reads), self.sync_pull_wait_s)
            )
        except Exception:
            logger.exception("kvbranch: waiting for synchronous reads failed")
            states = {r: "error" for r in reads}
        for request_id, state in states.items():
            self._sync_landed[request_id] = state == READ_DONE
            if state == READ_DONE:
                continue
            read = reads[request_id]
            self._sync_invalid.update(read.local_block_ids[0])
            logger.warning(
                "kvbranch: request %s: its pull did not land before the forward (%s): "
                "recomputing those tokens",
                request_id,
                state,
            )
            if read_in_flight(worker, request_id):
                # Kept running against pinned blocks (late_reads.py); a failed read may have
                # other transfers still in flight.
                self.late_reads.give_up(worker, request_id, block_ids_of(read))
            elif state != READ_FAILED:
                skip_unstarted_read(worker, request_id, read)
            if not read_tracked(worker, request_id):
                self._sync_ids.discard(request_id)  # upstream will never report it

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors: set[int] = set(super().get_block_ids_with_load_errors())
        if self._sync_invalid:
            errors |= self._sync_invalid
            self._sync_invalid = set()
        return errors

    # --- worker: a read in flight ends in bounded time ------------------------------------
    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        # The step's finished reads first: only a read still in flight can be too slow (a
        # failure is reported with the next step's results).
        results = super().get_transfer_results(finished_req_ids)
        worker = self.connector_worker
        if worker is not None:
            try:
                self.late_reads.poll(worker)
                if self.pull_timeout_s > 0:
                    self._fail_slow_reads(worker, time.monotonic())
            except Exception:
                logger.exception("kvbranch: checking reads in flight failed")
        if self._sync_ids:
            # A synchronous read's request runs: reported received, vLLM's scheduler would
            # take it for a parked one (an assertion in the engine core).
            ours = (results.finished_recving | results.failed_recving) & self._sync_ids
            if ours:
                results.finished_recving -= ours
                results.failed_recving -= ours
                self._sync_ids -= ours
        return results

    def _fail_slow_reads(self, worker: Any, now: float) -> None:
        self.reads_timed_out += fail_slow_reads(
            worker, self._read_started, now, self.pull_timeout_s, self.late_reads
        )

    # --- late reads: worker -> scheduler ----------------------------------------------------
    def build_connector_worker_meta(self) -> Any:
        # Upstream's NixlConnector reports no worker metadata of its own (vLLM 0.32).
        report = self.late_reads.report()
        if self._sync_landed:
            report = report or ReadReport()
            report.sync_landed, self._sync_landed = self._sync_landed, {}
        return report

    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        super().bind_gpu_block_pool(gpu_block_pool)
        self.pinned_reads.block_pool = gpu_block_pool
