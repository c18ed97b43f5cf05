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

(Over 400 lines on purpose: the two connector classes override NIXL's hooks that must see the
same handle checks and hold registry within one request's life; the pure handle logic already
lives in ``transfer_auth.py``. Splitting the subclasses apart would spread one request's
verification over files. Next split candidate: ``HoldRegistry`` into its own module.)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import base_worker as nixl_base_worker
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlConnector

from server.connector.connector import KVBranchConnector
from server.connector.control import ControlError
from server.connector.transfer_auth import (
    CLAIM_FIELD,
    EXPIRES_FIELD,
    HASHES_FIELD,
    IDENTITY_FIELD,
    MAC_FIELD,
    REMOTE_BLOCK_FIELDS,
    TOKENS_FIELD,
    ConsumedHandles,
    claim_valid,
    is_sealed,
    load_cluster_secret,
    make_claim,
    seal,
)
from server.connector.transfer_auth import expired as transfer_expired

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = logging.getLogger("kvbranch.pd")

IDLE_STEP_SLEEP_S = 0.005
#: NIXL's own keys and ours, the only ones a router needs to carry from D to P.
NIXL_PARAM_KEYS = (
    "do_remote_prefill",
    "do_remote_decode",
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "tp_size",
    "dcp_size",
    "pp_size",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
    "transfer_mode",
    MAC_FIELD,
    EXPIRES_FIELD,
    TOKENS_FIELD,
    HASHES_FIELD,
    IDENTITY_FIELD,
    CLAIM_FIELD,
)
#: Fields that name a peer's memory: dropped from a handle this instance will not honour.
REMOTE_FIELDS = (*REMOTE_BLOCK_FIELDS, TOKENS_FIELD, HASHES_FIELD, CLAIM_FIELD)
#: A pull starts only while the claim has at least this much time left (the read itself
#: takes milliseconds; upstream's worker checks D's deadline again right before reading).
CLAIM_MARGIN_S = 6.0
DEFAULT_CLAIM_TTL_S = 30.0
#: Why a handle was declined (the ``reason`` label of the metric, the log's words).
DECLINE_REASONS = {
    "unsealed": "not issued by this cluster (bad or missing seal)",
    "expired": "expired",
    "unclaimed": "no valid claim from the decode instance",
    "claim_ended": "the claim ran out while the request waited",
    "reused": "handle already used",
    "identity": "another cache salt, LoRA adapter or input kind",
    "tokens": "the prompt differs from the tokens the peer computed",
}
#: D stamps its handle to expire this long before its own hold ends.
EXPIRY_MARGIN_S = 2.0


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


def block_hashes_hex(request: Any, num_blocks: int) -> list[str]:
    return [bytes(h).hex() for h in list(getattr(request, "block_hashes", []) or [])[:num_blocks]]


def identity_of(request: Any) -> str:
    """What the KV of a token sequence depends on besides the tokens: the cache salt (tenant),
    the LoRA adapter, multimodal inputs and prompt embeddings."""
    lora = getattr(request, "lora_request", None)
    ident = {
        "salt": getattr(request, "cache_salt", None),
        "lora": getattr(lora, "lora_name", None) if lora is not None else None,
        "mm": bool(getattr(request, "mm_features", None)),
        "embeds": getattr(request, "prompt_embeds", None) is not None,
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


def pullable_tokens(params: dict[str, Any], request: Any, block_size: int) -> int:
    """Tokens of D's handle that P may read for ``request``: the longest token-identical prefix
    (capped at prompt length - 1), kept only when the identity (salt, LoRA, ...) is the same
    and D's chained block hash of the last full verified block equals P's own. Pure."""
    if params.get(IDENTITY_FIELD) != identity_of(request):
        return 0
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return 0  # placeholder token ids do not identify the media: whole blocks only, not here
    prompt = list(request.prompt_token_ids or [])
    held = params.get("remote_num_tokens")
    if not isinstance(held, int) or isinstance(held, bool) or held <= 0:
        return 0
    n = min(held, verified_prefix(params.get(TOKENS_FIELD), prompt))
    full = n // block_size
    if full:
        theirs = params.get(HASHES_FIELD)
        ours = block_hashes_hex(request, full)
        if (
            not isinstance(theirs, list)
            or len(theirs) < full
            or len(ours) < full
            or theirs[full - 1] != ours[full - 1]
        ):
            return 0
    return n


def trim_block_ids(block_ids: Any, num_tokens: int, block_size: int) -> list[list[int]] | None:
    """D's block list cut to the blocks that hold the first ``num_tokens`` tokens, or None when
    the layout is not one full-attention group of int ids (then nothing is pulled).

    Needed because NIXL's worker pairs P's *unfilled* blocks with the *last* ones of D's list
    (``_apply_prefix_caching`` end-trims): an untrimmed list would put D's last blocks into
    P's first positions whenever the verified prefix is shorter than what D holds."""
    if not isinstance(block_ids, list) or len(block_ids) != 1 or not isinstance(block_ids[0], list):
        return None
    group = block_ids[0]
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in group):
        return None
    need = -(-num_tokens // block_size)
    if need > len(group):
        return None
    return [group[:need]]


@dataclass
class Hold:
    """D's blocks kept after a turn for P's next pull: a lease that yields to new work."""

    request_id: str
    handle: str
    num_blocks: int
    created: float = field(default_factory=time.monotonic)
    claimed_until: float = 0.0  # wall clock
    releasing: bool = False


class HoldRegistry:
    """D's holds, oldest first. Claimed by the router (control thread), released under
    pressure by the scheduler thread: one lock orders the two, so a claimed hold is never
    released before its claim ends and a released hold can never be claimed."""

    def __init__(self, claim_ttl_s: float) -> None:
        self.claim_ttl_s = claim_ttl_s
        self._holds: OrderedDict[str, Hold] = OrderedDict()
        self._lock = threading.Lock()
        self.released_for_pressure = 0
        self.claims = 0
        self.claims_refused = 0

    def add(self, hold: Hold) -> None:
        with self._lock:
            self._holds[hold.request_id] = hold

    def done(self, request_id: str) -> None:
        with self._lock:
            self._holds.pop(request_id, None)

    def claim(self, request_id: str, handle: str, hold_expires_wall: float) -> float | None:
        """The claim's deadline (wall clock), or None if the hold is gone or being released."""
        with self._lock:
            hold = self._holds.get(request_id)
            if hold is None or hold.releasing or hold.handle != handle or hold.claimed_until:
                self.claims_refused += 1
                return None
            hold.claimed_until = min(time.time() + self.claim_ttl_s, hold_expires_wall)
            self.claims += 1
            return hold.claimed_until

    def release_oldest(self, need_blocks: int) -> list[str]:
        """Mark the oldest unclaimed holds (or claims past their deadline) for release until
        ``need_blocks`` blocks are covered; returns their request ids."""
        out: list[str] = []
        freed = 0
        now = time.time()
        with self._lock:
            for hold in self._holds.values():
                if freed >= need_blocks:
                    break
                if hold.releasing or (
                    hold.claimed_until and hold.claimed_until + CLAIM_MARGIN_S > now
                ):
                    continue
                hold.releasing = True
                out.append(hold.request_id)
                freed += hold.num_blocks
            self.released_for_pressure += len(out)
        return out

    def held_blocks(self) -> int:
        with self._lock:
            return sum(h.num_blocks for h in self._holds.values() if not h.releasing)

    def __len__(self) -> int:
        with self._lock:
            return len(self._holds)


def _agent_config_without_progress_thread(original: Any) -> Any:
    if original is None:
        return None

    def make(*args: Any, **kwargs: Any) -> Any:
        kwargs["enable_prog_thread"] = False
        return original(*args, **kwargs)

    return make


def _mark_verified(params: dict[str, Any], tokens: Any) -> None:
    """Checked once per request; the token ids and hashes are done with (keep it small)."""
    params["kvbranch_verified"] = tokens
    for key in (TOKENS_FIELD, HASHES_FIELD):
        params.pop(key, None)


def _strip(params: dict[str, Any]) -> None:
    """Forget a peer handle this instance will not honour: nothing is read, no peer contacted."""
    for key in REMOTE_FIELDS:
        params.pop(key, None)
    params["do_remote_prefill"] = False


class VerifiedNixlConnector(NixlConnector):
    """Upstream ``NixlConnector`` with verified, claimed, single-use handles and CPU-friendly
    threading (see the module docstring and :mod:`server.connector.transfer_auth`)."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
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
                logger.info(
                    "kvbranch: kept the forward thread on cores %s (NIXL re-pinned it)",
                    sorted(affinity),
                )
        self.block_size = vllm_config.cache_config.block_size
        self.secret = load_cluster_secret()
        self.consumed = ConsumedHandles()
        self.holds = HoldRegistry(float(extra.get("claim_ttl_s", DEFAULT_CLAIM_TTL_S)))
        self.hold_ttl_s = float(extra.get("decoder_kv_blocks_ttl", 480))
        self.declined: dict[str, int] = {}

    # --- P: pulling D's blocks; D: reading P's blocks ---------------------------------------
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        params = request.kv_transfer_params
        if (
            isinstance(params, dict)
            and params.get("remote_block_ids")
            and not params.get("_remote_blocks_processed")
        ):
            if params.get("do_remote_decode"):
                self._check_pull(request, params)
            elif params.get("do_remote_prefill") and "kvbranch_verified" not in params:
                # Once per request: the scheduler asks again while the request waits for
                # blocks, and the first check consumed the handle.
                self._check_prefill_handle(request, params)
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def _decline(self, request: Request, params: dict[str, Any], why: str) -> None:
        self.declined[why] = self.declined.get(why, 0) + 1
        logger.info(
            "kvbranch: request %s declines the peer's transfer handle (%s): recomputing",
            request.request_id,
            DECLINE_REASONS.get(why, why),
        )
        _strip(params)

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

    def _check_pull(self, request: Request, params: dict[str, Any]) -> None:
        """P, before pulling D's blocks: every check, every time the scheduler asks (a request
        that waits for blocks may see its claim run out)."""
        if "kvbranch_verified" in params:
            if not claim_valid(params, self.secret, CLAIM_MARGIN_S):
                self._decline(request, params, "claim_ended")
            return
        why = self._verify(params)
        if why is None and not claim_valid(params, self.secret, CLAIM_MARGIN_S):
            why = "unclaimed"
        if not self._consume_or_decline(request, params, why):
            return
        held = params.get("remote_num_tokens")
        pull = pullable_tokens(params, request, self.block_size)
        trimmed = (
            trim_block_ids(params.get("remote_block_ids"), pull, self.block_size) if pull else None
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
        _mark_verified(params, pull)
        if isinstance(held, int) and pull < held and pull < len(request.prompt_token_ids or []) - 1:
            logger.info(
                "kvbranch: request %s pulls %d of the %d tokens the peer holds "
                "(tokens or identity differ after that)",
                request.request_id,
                pull,
                held,
            )

    def _check_prefill_handle(self, request: Request, params: dict[str, Any]) -> None:
        """D, before reading P's blocks for its prompt: sealed, fresh, unused, and P's blocks
        encode exactly this prompt with this identity."""
        why = self._verify(params)
        if why is None and params.get(IDENTITY_FIELD) != identity_of(request):
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
            _mark_verified(params, params.get("remote_num_tokens"))

    # --- the worker's lease tracking ------------------------------------------------------
    def update_state_after_alloc(
        self, request: Request, blocks: Any, num_external_tokens: int
    ) -> None:
        super().update_state_after_alloc(request, blocks, num_external_tokens)
        sched = self.connector_scheduler
        if self._held_when_finished(request):
            # Upstream's worker sets (and reaps) the lease of a finished request only if the
            # request was announced "in batch", which upstream does only for a request that
            # reads a peer's blocks. D's decode-only turns (the router's fallback while P is
            # unreachable: ``do_remote_prefill: false``) and turns whose handle D declined
            # read nothing, yet D holds their blocks too: unannounced, those blocks were never
            # freed, not by P's read, not by the hold's TTL, not by a release under pressure,
            # until D's cache filled and new turns waited forever.
            sched._reqs_in_batch.add(request.request_id)

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
            sched._reqs_not_processed.add(request.request_id)

    # --- issuing handles ------------------------------------------------------------------
    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        with self._hold_only_for_sessions(request):
            delay, params = super().request_finished(request, block_ids)
        self._forget_unheld(request, delay)
        return delay, self._issue(request, delay, params)

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        with self._hold_only_for_sessions(request):
            delay, params = super().request_finished_all_groups(request, block_ids)
        self._forget_unheld(request, delay)
        return delay, self._issue(request, delay, params)

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
        params[IDENTITY_FIELD] = identity_of(request)
        is_d = bool(params.get("do_remote_decode"))
        sched = self.connector_scheduler
        lease = self.hold_ttl_s if is_d else float(getattr(sched, "_kv_lease_duration", 60) or 60)
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
    def claim_hold(self, req: dict) -> dict:
        """Control op: the router claims D's handle right before P's pull."""
        handle = req.get("handle")
        if not isinstance(handle, dict) or not is_sealed(handle, self.secret):
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
                sched._reqs_in_batch.add(request_id)
                sched._reqs_need_send[request_id] = past
            logger.warning(
                "kvbranch: released %d held conversation(s) for new work (device "
                "KV full); their next turn recomputes or uses the host store",
                len(ids),
            )
        return len(ids)

    def update_connector_output(self, connector_output: Any) -> None:
        for request_id in connector_output.finished_sending or ():
            self.holds.done(request_id)
        super().update_connector_output(connector_output)


class KVBranchPDConnector(MultiConnector):
    """``MultiConnector([VerifiedNixlConnector, KVBranchConnector])`` with shared accounting,
    the router's claim op, and holds that yield to new work."""

    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig
    ) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self._nixl_index = next(
            (i for i, c in enumerate(self._connectors) if isinstance(c, NixlConnector)), None
        )
        self._kvbranch = next(
            (c for c in self._connectors if isinstance(c, KVBranchConnector)), None
        )
        if self._nixl_index is None or self._kvbranch is None:
            raise ValueError(
                "KVBranchPDConnector needs a NixlConnector and a "
                "KVBranchConnector among its connectors"
            )
        self._nixl = self._connectors[self._nixl_index]
        self.block_size = vllm_config.cache_config.block_size
        #: Requests the scheduler looked at this step and has not (yet) allocated.
        self._waiting: dict[str, Any] = {}
        self.stalled_steps = 0
        if isinstance(self._nixl, VerifiedNixlConnector):
            self._kvbranch.extra_ops["claim_hold"] = self._nixl.claim_hold
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
            "held_blocks": holds.held_blocks(),
            "holds_released_for_new_work": holds.released_for_pressure,
            "claims": holds.claims,
            "claims_refused": holds.claims_refused,
            "stalled_steps": self.stalled_steps,
            "handles_declined": dict(nixl.declined),
        }

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._waiting[request.request_id] = request
        return super().get_num_new_matched_tokens(request, num_computed_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> Any:
        self._yield_holds_to_waiting_work()
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Nothing to compute, yet the engine keeps stepping: D while it holds a turn's
            # blocks for P, P while it waits for a pull (PD_NOTES pitfall 7). Unthrottled, those
            # empty steps spin a core for the whole hold; a few ms per step costs a pull or a
            # new request at most that much.
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
            and self._requests_to_connector.get(request.request_id) == self._nixl_index
        ):
            planner.note_remote_hit(request, num_external_tokens)
        super().update_state_after_alloc(request, blocks, num_external_tokens)

    def request_finished(
        self, request: Request, blocks: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        self._waiting.pop(request.request_id, None)
        delay, params = super().request_finished(request, blocks)
        planner = self._kvbranch.planner
        if planner is not None and params:
            nixl = {k: v for k, v in params.items() if k in NIXL_PARAM_KEYS}
            if nixl:
                planner.remember_transfer_params(request, nixl)
        return delay, params


def _register_by_name() -> None:
    """MultiConnector rebuilds its children's stats in the API server by *registered name*
    (``KVConnectorFactory.get_connector_class_by_name``), which module-path connectors lack."""
    for name, module in (
        ("VerifiedNixlConnector", __name__),
        ("KVBranchConnector", "server.connector.connector"),
        ("KVBranchPDConnector", __name__),
    ):
        if name not in KVConnectorFactory._registry:
            KVConnectorFactory.register_connector(name, module, name)


_register_by_name()
