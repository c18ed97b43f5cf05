"""Scheduler-side planning: which prompt blocks (and which stored tail, ``tails.py``) load from
the host store, which computed blocks and finished tails save to it — held as pending loads
and saves and handed to the worker as each step's :class:`KVBranchMetadata` — where each
request's prompt tokens came from, and the session bookkeeping that follows a finished request.

One module (about 400 lines) on purpose: a request's plan (what it loads, saves and is counted
as) is shared by every step above, under one lock; splitting it would spread one state machine.

Kept free of vLLM types beyond duck typing (``request.block_hashes``, ``all_token_ids``,
``session_id``, ``sampling_params.extra_args``, ``cache_salt``, ``num_prompt_tokens``) so that
unit tests can drive it with small fakes and the real engine drives it unchanged.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

# One home for the extension-arg names (the middleware strips the internal ones from clients).
from sdk.contract import BRANCH_XARG, OWNER_XARG, PIN_TTL_XARG, PREFETCH_XARG, TAG_XARG  # noqa: F401
from server.connector.core.block_index import HostBlockIndex
from server.connector.core.kv_groups import WindowRule
from server.connector.core.metadata import (
    SKIPPED,
    DeviceBlock,
    HostSlots,
    KVBranchMetadata,
    device_block,
    device_blocks,
)
from server.connector.core.part_pool import PartPool
from server.connector.core.sessions import DEFAULT_BRANCH, RegistryError, SessionRegistry
from server.connector.core.tails import TailSpec, finished_tail, identity_of, parent_key

logger = logging.getLogger("kvbranch.planner")

SPLIT_HISTORY = 10_000
PARAMS_HISTORY = 256  # transfer params carry token ids: keep few (a router fetches at once)


@dataclass
class RequestPlan:
    request: Any
    arrived_at: float = field(default_factory=time.monotonic)
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    #: A peer's pull (P/D): tokens it should bring, and where it stands: "noted" in the
    #: allocation that starts it, "loading" until vLLM says how much of it landed.
    remote_pending_tokens: int = 0
    remote_state: str | None = None
    load_slots: list[int] | None = None
    load_start_block: int = 0
    #: A tail (partial block) offered after the full blocks: its slot and matched tokens.
    tail_slot: int | None = None
    tail_tokens: int = 0
    next_save_block: int = 0
    #: Running when the store was reset (new weights, a reloaded LoRA): its KV so far may be
    #: the old model's, so nothing of it is saved until vLLM restarts it from token 0.
    stale: bool = False
    #: Windowed groups (``part_pool.py``): the positions this request attached a part to
    #: (those no resume reads are released when it finishes).
    window_attached: list[int] = field(default_factory=list)
    #: State groups: the positions this request attached a state part to (only its resume
    #: points' stay when it finishes).
    state_attached: list[int] = field(default_factory=list)
    recorded: bool = False
    split: dict | None = None


def _extra_args(request: Any) -> dict:
    params = getattr(request, "sampling_params", None)
    extra = getattr(params, "extra_args", None) if params is not None else None
    return extra if isinstance(extra, dict) else {}


def reads_no_cache(request: Any) -> bool:
    """Whether vLLM computes every prompt position of this request itself: prompt logprobs
    (also ``echo`` with ``logprobs`` on ``/v1/completions``) need the logits of each prompt
    token, so vLLM 0.32 skips its prefix cache for them (``Request.skip_reading_prefix_cache``,
    set from ``SamplingParams.prompt_logprobs``; pooling requests with all-token pooling too).
    The host store then offers nothing either: no full blocks, no tail, on every path (chat,
    forks, prefetch, P/D) — they all ask :meth:`Planner.num_new_matched_tokens`."""
    if getattr(request, "skip_reading_prefix_cache", False) is True:
        return True
    params = getattr(request, "sampling_params", None)
    return params is not None and (
        getattr(params, "prompt_logprobs", None) is not None
        or getattr(params, "prompt_logprob_token_ids", None) is not None
    )


def _pin_ttl(extra: dict) -> float | None:
    """The pin lease a client's retention hint asked for (server-set, see dialects.py)."""
    value = extra.get(PIN_TTL_XARG)
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


#: The device blocks that hold the recurrent state after a block, one per state group, as
#: vLLM's prefix cache has them under the block's hash (``None``: it keeps no state there).
StateLookup = Callable[[bytes], dict[int, int] | None]


def _skip(block: DeviceBlock, groups: frozenset[int]) -> DeviceBlock:
    """``block`` with ``groups`` skipped."""
    return tuple(SKIPPED if g in groups else b for g, b in enumerate(block))


def _only(block: DeviceBlock, groups: frozenset[int]) -> DeviceBlock:
    """``block`` with every group but ``groups`` skipped."""
    return tuple(b if g in groups else SKIPPED for g, b in enumerate(block))


def _holds(block: DeviceBlock, groups: frozenset[int]) -> bool:
    """Whether every one of ``groups`` has a block at this position."""
    return all(g < len(block) and block[g] != SKIPPED for g in groups)


class Planner:
    def __init__(
        self,
        index: HostBlockIndex,
        registry: SessionRegistry,
        block_size: int,
        *,
        state_groups: frozenset[int] = frozenset(),
        num_groups: int = 1,
        window: WindowRule | None = None,
    ) -> None:
        self.index = index
        self.registry = registry
        self.block_size = block_size
        #: KV cache groups holding a recurrent state (``kv_groups.py``): a slot holds their
        #: state only where vLLM's prefix cache keeps one; a hit ends at such a slot; no tails.
        self.state_groups = state_groups
        #: Sliding-window / chunked-local groups: their part of a position is kept only near
        #: resume points, in a pool of its own (``part_pool.py``).
        self.window = window if window is not None and window.groups else None
        self.window_groups = self.window.groups if self.window is not None else frozenset()
        self.num_groups = max(num_groups, 1 + max(state_groups | self.window_groups, default=-1))
        self.lock = threading.RLock()
        self.plans: dict[str, RequestPlan] = {}
        self.splits: OrderedDict[str, dict] = OrderedDict()
        self.transfer_params: OrderedDict[str, dict] = OrderedDict()
        self.hits_tokens = {"device": 0, "host": 0, "remote": 0, "recomputed": 0}
        self.requests = 0
        #: Prompt tokens a peer's pull should have brought but did not (recomputed instead).
        self.remote_failed_tokens = 0
        #: Set when a peer connector writes KV blocks this step (outside the CUDA stream):
        #: the worker then waits on its pending save on the host (see ``HostKVPool.fence``).
        self.foreign_loads = False
        self.prefetches = 0
        self.prefetches_skipped = 0
        self.store_resets = 0
        #: Tails of finished requests waiting to be copied out: (request id, device block,
        #: tail). The request's blocks stay allocated until the worker reports the copy done.
        self.pending_tail_saves: list[tuple[str, DeviceBlock, TailSpec | None]] = []
        #: (host slots, device block) loads planned since the last step's metadata, and the
        #: slots and window parts they read (kept from eviction within the step).
        self.pending_loads: list[tuple[HostSlots, DeviceBlock]] = []
        self._loading_slots: set[int] = set()
        self._loading_parts: set[int] = set()
        self._loading_states: set[int] = set()
        #: The block id vLLM's tables use where a group keeps no block (its null block).
        self.null_block = 0

    # --- vLLM scheduler hooks ----------------------------------------------------------------
    def on_new_request(self, request: Any) -> None:
        with self.lock:
            self.plans[request.request_id] = RequestPlan(request)

    def num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> int:
        """Host-store hits right after the device hit: consecutive full blocks, then the
        stored tail that continues them token for token (see ``tails.py``). Never the whole
        prompt: vLLM must compute at least one token, so the last prompt token is left out."""
        with self.lock:
            bs = self.block_size
            start = num_computed_tokens // bs
            limit = request.num_prompt_tokens - 1  # tokens that may come from outside
            loadable = limit // bs - start
            # Record the device hit even when nothing is left to load: it is part of the split.
            plan = self.plans.setdefault(request.request_id, RequestPlan(request))
            if plan.remote_state == "loading":
                # Asked again after a pull started: vLLM (kv_load_failure_policy=recompute)
                # reset the request to 0 computed tokens and freed its blocks; none landed.
                self._settle_remote(plan, landed=0)
            plan.device_hit_tokens = num_computed_tokens
            if plan.stale:  # restarted from token 0 (preempted by the reset): fresh KV
                plan.stale, plan.next_save_block = False, 0
            plan.load_slots = None
            plan.load_start_block = start
            plan.tail_slot, plan.tail_tokens = None, 0
            if limit - start * bs <= 0 or self.index.num_slots == 0 or reads_no_cache(request):
                return 0
            slots = (
                self.index.match(request.block_hashes, request.all_token_ids, bs, start, loadable)
                if loadable > 0
                else []
            )
            if self.state_groups:
                # A resumed state exists only where a slot holds one: end the hit there.
                while slots and not self.index.has_state(slots[-1]):
                    slots.pop()
            plan.load_slots = slots
            end = start + len(slots)
            if not self.state_groups:
                self._match_tail(plan, request, end, limit)
            if self.window is not None:
                self._cut_to_window_parts(plan, start)
            return len(plan.load_slots) * bs + plan.tail_tokens

    def _cut_to_window_parts(self, plan: RequestPlan, start: int) -> None:
        """Shorten the host hit to the longest one the windowed groups can continue from:
        every position they read after it (``WindowRule.first_block``) from ``start`` on must
        have its window part stored, the tail's position too (before ``start`` vLLM's device
        cache has them). With state groups the hit must still end at a slot with a state."""
        rule = self.window
        assert rule is not None
        slots = plan.load_slots or []
        parts = self.index.windows
        missing = [0]
        for slot in slots:
            missing.append(missing[-1] + (parts.part_of(slot) is None))
        bs = self.block_size

        def readable(end: int, tokens: int) -> bool:
            first = min(max(rule.first_block(tokens) - start, 0), end)
            return missing[end] - missing[first] == 0

        n = len(slots)
        if plan.tail_slot is not None:
            tail_read = parts.part_of(plan.tail_slot) is not None and readable(
                n, (start + n) * bs + plan.tail_tokens
            )
            if tail_read:
                return
            plan.tail_slot, plan.tail_tokens = None, 0
        while n and not (
            readable(n, (start + n) * bs)
            and (not self.state_groups or self.index.has_state(slots[n - 1]))
        ):
            n -= 1
        if n < len(slots):
            self.index.counters.window_cuts += 1
            plan.load_slots = slots[:n]

    def _match_tail(self, plan: RequestPlan, request: Any, block: int, limit: int) -> None:
        """Offer the stored tail that continues the prompt's first ``block`` full blocks."""
        identity = identity_of(request)
        start = block * self.block_size
        if identity is None or limit <= start or block > len(request.block_hashes):
            return
        parent = parent_key(request.block_hashes, block, identity)
        found = self.index.match_tail(
            parent, request.all_token_ids[start : min(limit, start + self.block_size)]
        )
        if found is not None:
            # Below a whole block: a stored full block under this parent whose tokens the
            # prompt repeats entirely would have matched by its hash already.
            plan.tail_slot, plan.tail_tokens = found[0], min(found[1], self.block_size - 1)

    def after_alloc(
        self, request: Any, block_ids: Sequence[int | DeviceBlock], num_external_tokens: int
    ) -> None:
        """Queue the loads of what :meth:`num_new_matched_tokens` offered, into the blocks vLLM
        allocated (they go out with the step's metadata, :meth:`build_meta`). ``block_ids``:
        the request's device block per position (a group's skipped block is not loaded)."""
        with self.lock:
            plan = self.plans.setdefault(request.request_id, RequestPlan(request))
            if plan.remote_state == "noted":
                # This allocation starts a peer's asynchronous pull: what it brings is known
                # only when the request comes back (the next allocation) or is asked again.
                plan.remote_state = "loading"
                plan.load_slots = None
                return
            if plan.remote_state == "loading":
                # The pull finished: vLLM truncated num_computed_tokens at the first block
                # that failed to load (invalid_block_ids), so the rest is recomputed.
                self._settle_remote(plan, request.num_computed_tokens - plan.device_hit_tokens)
            n_blocks = num_external_tokens // self.block_size
            tail = num_external_tokens - n_blocks * self.block_size
            start = plan.load_start_block
            if n_blocks and plan.load_slots:
                for i in range(n_blocks):
                    slot = plan.load_slots[i]
                    block = device_block(block_ids[start + i])
                    if self.state_groups and i < n_blocks - 1:
                        # Only the hit's last position brings its state (vLLM gives the
                        # others the null block, or scratch).
                        block = self._attention_only(block)
                    self._queue_load(request, slot, block)
                    self.index.touch(request.block_hashes[start + i])
                self.index.counters.loaded_blocks += n_blocks
                if self.state_groups:
                    self._load_running_state(request, block_ids, start + n_blocks - 1)
            if tail:
                # A partial block past the full ones: a prefix of the next stored full block,
                # or of the tail this planner matched (both exact: KV is causal).
                slot = None
                if n_blocks < len(plan.load_slots or ()):
                    slot = plan.load_slots[n_blocks]
                elif plan.tail_slot is not None and tail <= plan.tail_tokens:
                    slot = plan.tail_slot
                    self.index.counters.loaded_tails += 1
                    self.index.counters.tail_tokens_loaded += tail
                if slot is not None and start + n_blocks < len(block_ids):
                    self._queue_load(request, slot, device_block(block_ids[start + n_blocks]))
                    self.index.touch_slot(slot)
                else:  # never offered: vLLM passes back the connector's own count
                    logger.error(
                        "kvbranch: %d external tokens for request %s past what was offered",
                        num_external_tokens,
                        request.request_id,
                    )
                    tail = 0
            plan.host_hit_tokens = n_blocks * self.block_size + tail
            plan.load_slots = None
            plan.tail_slot, plan.tail_tokens = None, 0
            if not plan.recorded:
                self._record_split(plan)

    def _queue_load(self, request: Any, slot: int, block: DeviceBlock) -> None:
        """Queue one position's load: its slot, its window part where the windowed groups
        hold a block there (``_cut_to_window_parts`` offered only hits that have them), its
        state part where the state groups load one (the hit's end)."""
        self._loading_slots.add(slot)
        state = None
        if self.state_groups:
            state = self.index.states.part_of(slot)
            if state is None:
                block = self._attention_only(block)
            elif any(g < len(block) and block[g] != SKIPPED for g in self.state_groups):
                self._loading_states.add(state)
        part = None
        if self.window is not None:
            part = self.index.windows.part_of(slot)
            reads = any(g < len(block) and block[g] != SKIPPED for g in self.window_groups)
            if part is None:
                if reads:
                    # Not offered that way: vLLM gave the windowed groups a block the store
                    # cannot fill (that group recomputes nothing: counted, logged, never
                    # expected).
                    self.index.counters.window_misses += 1
                    logger.error(
                        "kvbranch: request %s loads a position without its window part",
                        request.request_id,
                    )
                block = self._without_windows(block)
            elif reads:
                self._loading_parts.add(part)
                self.index.windows.loaded += 1
        self.pending_loads.append((self._host_slots(slot, part, state), block))

    def _host_slots(self, slot: int, part: int | None, state: int | None = None) -> HostSlots:
        """Where a position lives in the host store: ``slot``, ``part`` for the windowed
        groups, ``state`` for the state groups (:data:`SKIPPED` where it has none)."""
        if not self.window_groups and not self.state_groups:
            return slot
        window = SKIPPED if part is None else part
        states = SKIPPED if state is None else state
        return tuple(
            window if g in self.window_groups else states if g in self.state_groups else slot
            for g in range(self.num_groups)
        )

    def _without_windows(self, block: DeviceBlock) -> DeviceBlock:
        return _skip(block, self.window_groups)

    def _attention_only(self, block: DeviceBlock) -> DeviceBlock:
        """``block`` with its state groups skipped."""
        return _skip(block, self.state_groups)

    def _states_only(self, block: DeviceBlock) -> DeviceBlock:
        """``block`` with every group but its state groups skipped."""
        return _only(block, self.state_groups)

    def _savable(self, block: DeviceBlock) -> bool:
        """Whether every full-attention group holds this position (state groups hold a block
        only where vLLM keeps a state: found under the block's hash, not in the table; the
        windowed groups' part is optional, ``part_pool.py``)."""
        return all(
            b != SKIPPED
            for g, b in enumerate(block)
            if g not in self.state_groups and g not in self.window_groups
        )

    def _wants_part(self, plan: RequestPlan, k: int) -> bool:
        """Whether position ``k`` of this request should carry its window part: it lies in
        the window before the prompt's end or after (a later hit may end there)."""
        if self.window is None:
            return False
        last_full = (plan.request.num_prompt_tokens - 1) // self.block_size
        return k >= self.window.first_block(last_full * self.block_size)

    def _attach_part(
        self, plan: RequestPlan, k: int, slot: int, block: DeviceBlock, busy_parts: set[int]
    ) -> int | None:
        """A window part for stored ``slot`` (position ``k``), where the windowed groups still
        hold the position on the device; ``busy_parts``: parts this step reads or writes."""
        if not _holds(block, self.window_groups):
            return None
        part = self.index.attach_window(slot, busy_parts)
        if part is not None:
            busy_parts.add(part)
            plan.window_attached.append(k)
        return part

    def _attach_state(
        self, plan: RequestPlan, k: int, slot: int, busy_states: set[int]
    ) -> int | None:
        """A state part for stored ``slot`` (position ``k``): vLLM keeps the state after it."""
        state = self.index.attach_state(slot, busy_states)
        if state is not None:
            busy_states.add(state)
            plan.state_attached.append(k)
        return state

    def _load_running_state(
        self, request: Any, block_ids: Sequence[int | DeviceBlock], last: int
    ) -> None:
        """Also load the hit's last state into the request's running state block.

        vLLM (``align`` mode) keeps a request's running state in the last state block of its
        table and, before each step's forward, copies the state it continues from (the block
        at the hit's end) into it — before any connector load of that step runs (its model
        runner's Mamba pre-processing comes first). A state loaded only at the hit's end
        would be read by that copy before it lands; loaded into the running block too, the
        forward starts from it."""
        blocks = [device_block(b) for b in block_ids]
        if last >= len(blocks) or not self._holds_states(blocks[last]):
            logger.error(
                "kvbranch: request %s loads a hit whose last position has no state block",
                request.request_id,
            )
            return
        slot = self.pending_loads[-1][0]
        running = max(p for p in range(last, len(blocks)) if self._holds_states(blocks[p]))
        if running != last:
            self.pending_loads.append((slot, self._states_only(blocks[running])))
        self.index.counters.loaded_states += 1

    def _holds_states(self, block: DeviceBlock) -> bool:
        return _holds(block, self.state_groups)

    def note_remote_hit(self, request: Any, num_tokens: int, landing_now: bool = False) -> None:
        """A peer connector (NIXL, in P/D) starts pulling ``num_tokens`` prompt tokens for this
        request. Counted as remote hits only once vLLM reports how many landed; a pull the
        step's forward waits for (``landing_now``) is counted at once, and cut by
        :meth:`settle_failed_pull` if it did not land."""
        with self.lock:
            plan = self.plans.setdefault(request.request_id, RequestPlan(request))
            plan.remote_pending_tokens = num_tokens
            plan.remote_hit_tokens = num_tokens if landing_now else 0
            plan.remote_state = None if landing_now else "noted"
            self.foreign_loads = True

    def settle_failed_pull(self, request: Any, landed: int) -> None:
        """A pull the forward waited for landed only its first ``landed`` tokens (vLLM
        recomputes the rest)."""
        with self.lock:
            plan = self.plans.get(request.request_id)
            if plan is None:
                return
            counted = plan.remote_hit_tokens
            self._settle_remote(plan, landed)
            lost = counted - plan.remote_hit_tokens
            split = plan.split if plan.recorded else None
            if lost <= 0 or split is None:
                return
            # Recorded at allocation with the whole pull: those tokens were recomputed.
            lost = min(lost, int(split["remote_hit_tokens"]))
            split["remote_hit_tokens"] -= lost
            split["recomputed_tokens"] += lost
            if not _extra_args(request).get(PREFETCH_XARG):
                self.hits_tokens["remote"] -= lost
                self.hits_tokens["recomputed"] += lost

    def _settle_remote(self, plan: RequestPlan, landed: int) -> None:
        plan.remote_hit_tokens = max(0, min(landed, plan.remote_pending_tokens))
        self.remote_failed_tokens += plan.remote_pending_tokens - plan.remote_hit_tokens
        plan.remote_state = None

    def take_foreign_loads(self) -> bool:
        """Whether a peer connector started writing KV blocks since the last call."""
        with self.lock:
            flag, self.foreign_loads = self.foreign_loads, False
            return flag

    def remember_transfer_params(self, request: Any, params: dict) -> None:
        """Keep a finished request's transfer params by tag, for a streaming response."""
        tag = _extra_args(request).get(TAG_XARG)
        if not tag:
            return
        with self.lock:
            self.transfer_params[str(tag)] = params
            while len(self.transfer_params) > PARAMS_HISTORY:
                self.transfer_params.popitem(last=False)

    def build_meta(
        self,
        scheduled: dict[str, int],
        resolve_block_ids: Callable[[str], Any],
        state_lookup: StateLookup | None = None,
    ) -> KVBranchMetadata:
        """This step's copies for the worker: the loads planned at allocation (before the
        forward), then the saves of blocks that become full and of finished requests' tails
        (after it). No save reuses a slot a load or another save of this step touches."""
        meta = KVBranchMetadata(host_fence=self.take_foreign_loads())
        with self.lock:
            loads, self.pending_loads = self.pending_loads, []
            busy, self._loading_slots = self._loading_slots, set()
            busy_parts, self._loading_parts = self._loading_parts, set()
            busy_states, self._loading_states = self._loading_states, set()
            self.index.windows.new_step()
            self.index.states.new_step()
        for slot, block in loads:
            meta.load_slots.append(slot)
            meta.load_blocks.append(block)
        # ``busy``/``busy_parts`` gain every slot and part this step's saves write.
        saves = self.plan_saves(
            scheduled,
            resolve_block_ids,
            protected=busy,
            state_lookup=state_lookup,
            busy_parts=busy_parts,
            busy_states=busy_states,
        )
        tail_saves, meta.finished_saves = self.plan_tail_saves(busy, busy_parts)
        for block, slot in saves + tail_saves:
            meta.save_blocks.append(block)
            meta.save_slots.append(slot)
        return meta

    def plan_saves(
        self,
        scheduled: dict[str, int],
        resolve_block_ids: Callable[[str], Sequence[Sequence[int]]],
        protected: set[int],
        state_lookup: StateLookup | None = None,
        busy_parts: set[int] | None = None,
        busy_states: set[int] | None = None,
    ) -> list[tuple[DeviceBlock, HostSlots]]:
        """(device block, host slot) copies for every block that becomes full this step.
        ``resolve_block_ids``: a request's block table as vLLM keeps it (block ids per KV cache
        group). A position some group no longer holds (a device hit behind a sliding window)
        is not saved: a slot is whole or absent. ``protected``: the slots this step's loads
        read. With state groups, ``state_lookup`` finds the state vLLM keeps after a block
        (written by this step's forward at the latest, which the save follows): it goes into
        a state part of the block's slot, saved with the block or after it (a block stored
        without one). Windowed groups: their part goes into a window part where
        ``_wants_part`` says so. ``protected``, ``busy_parts`` and ``busy_states`` (the slots,
        window parts and state parts this step reads) gain every one written: two copies into
        one slot in one batch would race."""
        saves: list[tuple[DeviceBlock, HostSlots]] = []
        if self.index.num_slots == 0:
            return saves
        busy_parts = set() if busy_parts is None else busy_parts
        busy_states = set() if busy_states is None else busy_states
        with self.lock:
            bs = self.block_size
            for req_id, n_scheduled in scheduled.items():
                plan = self.plans.get(req_id)
                if plan is None:
                    continue
                if plan.stale:
                    continue
                request = plan.request
                done = request.num_computed_tokens + n_scheduled
                full = min(done // bs, len(request.block_hashes))
                if full <= plan.next_save_block:
                    continue
                block_ids = None
                tokens = request.all_token_ids
                identity = identity_of(request)
                for k in range(plan.next_save_block, full):
                    block_hash = request.block_hashes[k]
                    states = self._states_at(block_hash, state_lookup)
                    stored = self.index.slot_of(block_hash)
                    if stored is not None:
                        self.index.touch(block_hash)
                        if states is not None and not self.index.has_state(stored):
                            state = self._attach_state(plan, k, stored, busy_states)
                            if state is not None:
                                saves.append((states, self._host_slots(stored, None, state)))
                        if self._wants_part(plan, k) and self.index.windows.part_of(stored) is None:
                            if block_ids is None:
                                block_ids = self._positions(resolve_block_ids, req_id)
                            if k < len(block_ids):
                                part = self._attach_part(plan, k, stored, block_ids[k], busy_parts)
                                if part is not None:
                                    only = _only(block_ids[k], self.window_groups)
                                    saves.append((only, self._host_slots(stored, part)))
                        continue
                    if block_ids is None:
                        block_ids = self._positions(resolve_block_ids, req_id)
                    if k >= len(block_ids):  # none (the request is gone) or past its table
                        break
                    if not self._savable(block_ids[k]):
                        continue
                    # Filed under its tail parent too: a later prompt ending inside it loads
                    # the prefix it repeats (tails.py).
                    parent = (
                        parent_key(request.block_hashes, k, identity)
                        if identity is not None
                        else None
                    )
                    slot = self.index.allocate(
                        block_hash, tokens[k * bs : (k + 1) * bs], protected, parent=parent
                    )
                    if slot is not None:
                        block = self._attention_only(block_ids[k])
                        state = (
                            self._attach_state(plan, k, slot, busy_states)
                            if states is not None
                            else None
                        )
                        if states is not None and state is not None:
                            block = tuple(
                                b if b != SKIPPED else s for b, s in zip(block, states, strict=True)
                            )
                        part = (
                            self._attach_part(plan, k, slot, block_ids[k], busy_parts)
                            if self._wants_part(plan, k)
                            else None
                        )
                        if part is None and self.window_groups:
                            block = self._without_windows(block)
                        saves.append((block, self._host_slots(slot, part, state)))
                        protected.add(slot)
                plan.next_save_block = full
        return saves

    def _states_at(self, block_hash: bytes, lookup: StateLookup | None) -> DeviceBlock | None:
        """The state groups' device blocks after ``block_hash`` (every other group
        :data:`SKIPPED`), or ``None`` when vLLM keeps no state there for every state group."""
        if not self.state_groups or lookup is None:
            return None
        found = lookup(block_hash)
        if not found or found.keys() != self.state_groups:
            return None
        return tuple(found.get(g, SKIPPED) for g in range(self.num_groups))

    def request_finished(self, request: Any) -> dict | None:
        """:meth:`finish` without block ids (no tail is kept): the prompt-source split."""
        return self.finish(request, None)[0]

    def finish(
        self, request: Any, block_ids: Sequence[int | DeviceBlock] | None
    ) -> tuple[dict | None, bool]:
        """Forget the request; update its branch (lease renewal, tokens for prefetch/fork);
        plan the copy of its tail. Returns the prompt-source split (also put into
        ``kv_transfer_params``) and whether vLLM must keep the request's blocks until the
        worker reports the tail copied (``get_finished``).

        A request that ends while a peer's pull into its blocks runs (P/D: aborted in vLLM's
        ``WAITING_FOR_REMOTE_KVS``) keeps no tail and never delays: its blocks are the read's
        (what they hold is unknown until it ends), and vLLM itself keeps them until the worker
        reports the read ended, then frees them and forgets the request. A tail copy would
        have been a second report for the same request: the later of the two named a request
        vLLM no longer had, and its assertion killed the engine core (the soak's dead D)."""
        with self.lock:
            plan = self.plans.pop(request.request_id, None)
            extra = _extra_args(request)
            if plan is not None:
                # Never allocated (aborted while waiting, or while its pull ran): nothing was
                # computed or loaded, so nothing is counted.
                split = plan.split if plan.recorded else None
            else:
                split = self.splits.get(str(extra[TAG_XARG])) if extra.get(TAG_XARG) else None
            pulling = plan is not None and plan.remote_state == "loading"
            if plan is not None and plan.window_attached:
                self._release_unread_parts(plan, request)
            if plan is not None and plan.state_attached:
                self._release_unread_states(plan, request)
            tail = (
                finished_tail(request, self.block_size)
                if self.index.num_slots
                and not self.state_groups
                and not (plan is not None and (plan.stale or pulling))
                else None
            )
            session_id = getattr(request, "session_id", None)
            if session_id and not extra.get(PREFETCH_XARG):
                branch_id = str(extra.get(BRANCH_XARG) or DEFAULT_BRANCH)
                try:
                    # Only blocks whose KV exists: the last sampled token is never fed
                    # back, so a block it completes has a hash but no computed KV.
                    computed = min(request.num_computed_tokens, len(request.all_token_ids) - 1)
                    if pulling and plan is not None:  # counts pulled tokens not yet landed
                        computed = min(computed, plan.device_hit_tokens)
                    self.registry.observe_request(
                        session_id,
                        branch_id,
                        request.all_token_ids,
                        request.block_hashes[: computed // self.block_size],
                        getattr(request, "cache_salt", None),
                        owner=extra.get(OWNER_XARG),
                        arrived_at=plan.arrived_at if plan is not None else None,
                        tail=(tail.key, tail.start) if tail is not None else None,
                        pin_ttl_s=_pin_ttl(extra),
                    )
                except RegistryError:
                    pass  # e.g. another tenant's session id: serve the request, keep no state
            self.registry.expire()
            delay = False
            tail_block = (
                device_block(block_ids[tail.block])
                if tail is not None and block_ids is not None and tail.block < len(block_ids)
                else None
            )
            if tail is not None and tail_block is not None and self._savable(tail_block):
                if tail.key in self.index:
                    self.index.touch(tail.key)  # the same tail is stored: nothing to copy
                else:
                    self.pending_tail_saves.append((request.request_id, tail_block, tail))
                    delay = True
            return split, delay

    def _positions(
        self, resolve_block_ids: Callable[[str], Sequence[Sequence[int]]], req_id: str
    ) -> list[DeviceBlock]:
        """A request's device block per position (``[]`` when vLLM has no table for it)."""
        return device_blocks(resolve_block_ids(req_id) or [], self.null_block)

    def _release(self, pool: PartPool, hashes: Sequence[bytes], positions: list[int]) -> None:
        """Free ``pool``'s parts of the stored blocks at ``positions`` (no resume reads them),
        counted as released."""
        for k in positions:
            slot = self.index.slot_of(hashes[k]) if k < len(hashes) else None
            if slot is not None and pool.release(slot):
                pool.released += 1

    def _release_unread_parts(self, plan: RequestPlan, request: Any) -> None:
        """Free the window parts this request attached that no resume reads: those after its
        prompt's window and before the window of its end (a long answer's middle)."""
        assert self.window is not None
        bs = self.block_size
        computed = min(request.num_computed_tokens, len(request.all_token_ids) - 1)
        keep_from = self.window.first_block(computed // bs * bs)
        prompt_last = (request.num_prompt_tokens - 1) // bs
        unread = [k for k in plan.window_attached if prompt_last < k < keep_from]
        self._release(self.index.windows, request.block_hashes, unread)
        plan.window_attached = []

    def _release_unread_states(self, plan: RequestPlan, request: Any) -> None:
        """Free the state parts this request attached but its two resume points: the last
        state a hit within its prompt ends at (a regenerated or edited last step), and its
        last one (the next turn)."""
        bs = self.block_size
        prompt_blocks = (request.num_prompt_tokens - 1) // bs
        positions = sorted(plan.state_attached)
        keep = {positions[-1]}
        in_prompt = [k for k in positions if k < prompt_blocks]
        if in_prompt:
            keep.add(in_prompt[-1])
        unread = [k for k in positions if k not in keep]
        self._release(self.index.states, request.block_hashes, unread)
        plan.state_attached = []

    def plan_tail_saves(
        self, protected: set[int], busy_parts: set[int] | None = None
    ) -> tuple[list[tuple[DeviceBlock, HostSlots]], list[str]]:
        """(device block, host slots) copies of the finished requests' tails, and the ids of
        those requests: the worker reports them done after the copy (also when a tail got no
        slot), which frees their blocks. A tail carries its window part (its position is the
        end of a resume)."""
        saves: list[tuple[DeviceBlock, HostSlots]] = []
        done: list[str] = []
        busy_parts = set() if busy_parts is None else busy_parts
        with self.lock:
            pending, self.pending_tail_saves = self.pending_tail_saves, []
            for request_id, block, tail in pending:
                if tail is None:  # dropped by a store reset: only report the request done
                    done.append(request_id)
                    continue
                slot = self.index.allocate_tail(tail.key, tail.parent, tail.tokens, protected)
                if slot is not None:
                    protected.add(slot)
                    part = None
                    if self.window_groups:
                        if _holds(block, self.window_groups):
                            part = self.index.attach_window(slot, busy_parts)
                        if part is None:
                            block = self._without_windows(block)
                        else:
                            busy_parts.add(part)
                    saves.append((block, self._host_slots(slot, part)))
                done.append(request_id)
        return saves, done

    def reset_store(self) -> int:
        """Forget everything the host store holds — pinned blocks and tails too — and every
        pin (sessions and branches stay, with their tokens: their KV is recomputed, and the
        next request of a branch pins it again). For ``reset_prefix_cache?reset_external=true``
        and whenever the engine's weights or LoRA adapters change (``engine/weight_changes.py``):
        block hashes name tokens, not weights, so old KV would be served under them. Requests
        running now save nothing more (their KV may be the old model's); tails waiting for
        their copy are dropped. Returns how many blocks and tails were stored."""
        with self.lock:
            self.registry.leases.release_all()
            dropped = self.index.clear_all()
            self.pending_tail_saves = [
                (rid, block, None) for rid, block, _ in self.pending_tail_saves
            ]
            for plan in self.plans.values():
                plan.stale = True
            self.store_resets += 1
            return dropped

    # --- accounting --------------------------------------------------------------------------
    def _record_split(self, plan: RequestPlan) -> dict:
        request = plan.request
        extra = _extra_args(request)
        prompt = request.num_prompt_tokens
        device = min(plan.device_hit_tokens, prompt)
        remote = min(plan.remote_hit_tokens, prompt - device)
        host = min(plan.host_hit_tokens, prompt - device - remote)
        split = {
            "session_id": getattr(request, "session_id", None),
            "branch_id": (
                str(extra.get(BRANCH_XARG) or DEFAULT_BRANCH)
                if getattr(request, "session_id", None)
                else None
            ),
            "prompt_tokens": prompt,
            "device_hit_tokens": device,
            "host_hit_tokens": host,
            "remote_hit_tokens": remote,
            "recomputed_tokens": prompt - device - host - remote,
        }
        plan.recorded = True
        plan.split = split
        if extra.get(PREFETCH_XARG):
            self.prefetches += 1
        else:
            self.requests += 1
            self.hits_tokens["device"] += device
            self.hits_tokens["host"] += host
            self.hits_tokens["remote"] += remote
            self.hits_tokens["recomputed"] += split["recomputed_tokens"]
        tag = extra.get(TAG_XARG)
        if tag:
            self.splits[str(tag)] = split
            while len(self.splits) > SPLIT_HISTORY:
                self.splits.popitem(last=False)
        return split

    def split_for(self, tag: str) -> dict | None:
        """The request's split; with ``kv_transfer_params`` when a transfer connector returned
        some (P/D), since a streaming response has no other way to carry them."""
        with self.lock:
            split = self.splits.get(tag)
            params = self.transfer_params.pop(tag, None)
            if split is not None and params is not None:
                split = dict(split, kv_transfer_params=params)
            return split
