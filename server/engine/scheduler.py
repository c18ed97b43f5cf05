"""The warm-first scheduler: vLLM's priority scheduler, plus preemption of cold prefills for
warmer work and short steps only while cold prefills run (``--agent-priority`` on CPU, the
default there).

Why: an agent's resumed turn has a long history that is already cached and a few new tokens,
so it costs a fraction of a second; a cold prefill costs seconds. vLLM's own rules make the
cheap turn wait for the expensive one in several ways, one rule below for each.
docs/scheduling.md has the measurements behind every rule, the variants tried and reverted, and
the settings (``KVBRANCH_*`` switches for A/B runs: docs/configuration.md).

**Preemption for warmer work.** Under KV pressure a resumed turn waits for *device blocks* to
hold its history (loaded from the host store), not for its place in the queue: vLLM admits a
waiting request only when blocks are free, and preempts only to grow a running request. So
before each step, while the best-ranked waiting request would not fit in the free blocks, the
worst-ranked running *long* prefill (plugin level >= 2: more than ~1024 tokens left to
compute) that ranks behind it is preempted with vLLM's own ``_preempt_request`` (blocks freed,
back to the waiting queue with its arrival and priority). What it computed is not lost: every
full block went to the host store as it filled (and stays in vLLM's prefix cache until
evicted), so it loads them back in one copy and recomputes at most its last partial block.
Decodes and short prefills (resumed turns) are never preempted here: a preempted resumed turn
throws away a prefill about as cheap as the one it makes room for. A cold request is passed
only by requests that rank ahead of it, which the plugin's deadlines bound
(:mod:`server.plugin.priority`: a level-L request only by level-L' requests arriving within
``(L - L') * aging_s`` after it), so it is never starved.

**The chunk only by need, short steps while colds queue.** vLLM's
``--long-prefill-token-threshold`` caps every request's prompt chunk whenever more than one
request exists, so two cold prompts arriving together share every step and both finish late,
where first come first served finishes the first in about half the time. So the threshold
applies only while a request that ranks ahead of a running prefill waits or runs. And while a
long prefill runs *or waits* (more than one request existing), the whole step budget is the
chunk: a resumed turn arriving meanwhile waits at most one short step instead of a full-budget
step of seconds. A long prefill running alone keeps short steps too while a turn finished less
than ``aging_s`` ago: that turn's agent is likely in a tool call and back soon. A cold prefill
on an idle server keeps the whole budget. ``running`` is kept in ``(priority, arrival)`` order
so that the budget goes to the higher-ranked requests first.

**A burst of resumed turns in rank order.** Several resumed turns pending at once (agents whose
tool calls end together) would share one step under vLLM's budget and all get their first token
at its end, which also keeps their agents in lockstep for the next turn. So while more than one
short prefill is pending the step budget is the chunk: the best-ranked turns are computed
first, turns small enough still share a step. ``KVBRANCH_SPLIT_BURSTS=0`` turns it off.

**A resumed turn's step without cold chunks.** Capped, a running cold prefill would still take
its chunk in the step where a resumed turn starts, so the turn's first token would wait for
someone else's prefill. So a running long prefill that ranks behind a short prefill starting
(admittable this step) or running sits out that step (:func:`colds_to_pause`, vLLM's own
per-request skip ``next_decode_eligible_step``); it keeps its blocks and its place and goes on
in the next step. ``KVBRANCH_PAUSE_COLDS=0`` turns it off.

**Colds one after the other.** While warmer work exists every prefill is capped at the chunk
and the step keeps vLLM's budget, so a cold prefill waiting behind a running one would be
admitted beside it and the two would share every step. Besides finishing both late, that
computes twice what they share: vLLM's prefix cache hits only blocks complete when a request is
admitted, so two conversations with the same tools prompt, prefilled side by side, would each
compute it. So a waiting long prefill that ranks behind a running one, or behind one admitted
ahead of it in this step, is not admitted while that one prefills (:func:`colds_to_queue`);
the running one finishes its prompt in at most ``prompt / chunk`` steps, then the next is
admitted and finds the shared blocks cached.

**Backfill.** vLLM admits waiting requests in rank order and stops at the first that does not
fit in the free device blocks. Under a tight device budget that idles blocks a later request
could use: a forking agent's sibling branch shares most of its history with the branch running
(vLLM's prefix cache holds those blocks once for both) and needs only a few blocks of its own,
while the head of the queue, another conversation's history, needs all of its own. So the
scheduler plays vLLM's admission ahead, in rank order, counting each request's blocks net of
the prefix blocks running requests hold *and* of its common prefix with the requests admitted
ahead of it in this step (so the two branches of a fork, both waiting, are admitted together);
a request that does not fit is passed when a short request behind it fits, and keeps its place
for the next step. A request is passed freely during its first ``aging_s`` seconds of waiting;
after that only for a fork's sibling (a request at least half of whose blocks are so shared)
and at most ``MAX_LATE_PASSES`` times, each time delaying it by one short turn beside the one
running; then the blocks drain for it as under vLLM's order, so it is never starved. Long
(cold) prefills are never backfilled: they would hold blocks for seconds.
``KVBRANCH_BACKFILL=0`` turns it off.

**Unranked requests.** A request vLLM receives with priority 0 (a route whose body has no
``priority``, e.g. /v1/messages) would be first in vLLM's order; it ranks as the coldest
request arriving now instead (:meth:`WarmFirstScheduler.add_request`).

Under vLLM's FCFS policy it keeps vLLM's own rules. The launcher selects it with vLLM's own
``--scheduler-cls`` on CPU, where vLLM uses the synchronous scheduler; on CUDA it is not used.

Pinned to vLLM 0.32's ``Scheduler`` (``running``, ``waiting``, ``scheduler_config``, a
request's ``priority``, ``num_computed_tokens``, ``num_prompt_tokens``, ``num_tokens``,
``arrival_time``, ``block_hashes``, ``kv_cache_manager.block_pool.get_num_free_blocks()``,
``kv_cache_manager.coordinator.find_longest_cache_hit``, a block's ``ref_cnt``,
``_preempt_request``, ``_request_blocks_can_be_freed``, ``_handle_blocked_waiting_request``,
``max_num_active_reqs``, ``num_waiting_for_streaming_input``, ``current_step`` and a request's
``next_decode_eligible_step``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from server.common.env import ENV_BACKFILL, ENV_PAUSE_COLDS, ENV_SPLIT_BURSTS, on_unless_zero
from server.common.priority_code import DEFAULT_AGING_S, aging_from_env, level_in, unranked
from server.engine.scheduler_counters import SchedulerCounters, publish

QUALNAME = "server.engine.scheduler.WarmFirstScheduler"

logger = logging.getLogger(__name__)
#: Waiting requests that only wait for blocks and budget.
READY = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
#: Levels whose prefill is long enough to be run in short steps (> 1024 estimated tokens).
LONG_LEVEL = 2
#: How many waiting requests (in rank order) the backfill looks at for one that fits.
BACKFILL_LOOKAHEAD = 16
#: How many times a request that has waited longer than ``aging_s`` may still be passed, each
#: time for a fork's sibling branch admitted beside the branch it shares its history with.
MAX_LATE_PASSES = 2


def cap_needed(running: Iterable[Any], waiting: Iterable[Any]) -> bool:
    """Whether a running prefill has someone ahead of it in priority (waiting or running)."""
    running = list(running)
    prefilling = [r.priority for r in running if is_prefilling(r)]
    if not prefilling:
        return False
    worst = max(prefilling)
    return any(r.priority < worst for r in running) or any(r.priority < worst for r in waiting)


def rank(request: Any) -> tuple[Any, Any]:
    """vLLM's priority order: lower first, then earlier arrival."""
    return (request.priority, request.arrival_time)


def is_prefilling(request: Any) -> bool:
    return request.num_computed_tokens < request.num_prompt_tokens


def blocks_needed(request: Any, block_size: int) -> int:
    """Device blocks a waiting request needs for its whole prompt and its first token (an upper
    bound: blocks it shares with running requests cost nothing)."""
    return -(-(request.num_tokens + 1) // block_size)


def shared_blocks(blocks_per_group: tuple[list[Any], ...]) -> int:
    """Of a request's device prefix-cache hit, the blocks running requests hold (reference
    count > 0): admitting the request shares them. Cached blocks nobody holds sit in vLLM's
    free pool, so taking them costs free blocks like new ones. One KV group only (the
    SmolLM2-class models here); with several, nothing is counted as shared (an upper bound)."""
    if len(blocks_per_group) != 1:
        return 0
    return sum(1 for block in blocks_per_group[0] if block.ref_cnt > 0)


def common_prefix_blocks(a: Any, b: Any) -> int:
    """Full blocks two requests' prompts share from the start (their block hashes agree)."""
    count = 0
    for mine, theirs in zip(a.block_hashes, b.block_hashes, strict=False):
        if mine != theirs:
            break
        count += 1
    return count


def requests_to_pass(
    waiting: Iterable[Any],
    assess: Any,
    free_blocks: int,
    now: float,
    max_wait_s: float,
    lookahead: int,
    late_passes_left: Any,
) -> tuple[set[str], set[str]]:
    """Waiting requests to skip this step so that later ones that fit in the free device
    blocks are admitted, as ``(passed, passed late)``: vLLM's admission in rank order played
    ahead, except that a request that does not fit is passed instead of ending the step's
    admissions, when a *short* request (not a long prefill) behind it fits.

    ``assess(request, admitted)`` gives ``(blocks, pairs)``: the device blocks the request
    would take, net of the prefix blocks running requests hold and of its common prefix with
    the requests ``admitted`` ahead of it this step, and whether at least half of its blocks
    are so shared (a fork's sibling branch). A request is passed during its first
    ``max_wait_s`` of waiting; after that only for such a sibling, and only while
    ``late_passes_left(request)`` > 0 (its bound). Empty when nothing is passed for a request
    that fits, or when a request that may not be passed (or is not ready, or beyond
    ``lookahead``) comes first."""
    admitted: list[Any] = []
    pending: list[tuple[Any, bool]] = []  # passed, until a request behind them fits
    passed: set[str] = set()
    late: set[str] = set()
    free = free_blocks
    for position, request in enumerate(waiting):
        if position >= lookahead or request.status not in READY:
            break
        blocks, pairs = assess(request, admitted)
        if blocks <= free:
            if pending:
                if is_long(request) or (not pairs and any(over for _, over in pending)):
                    break
                passed.update(r.request_id for r, _ in pending)
                late.update(r.request_id for r, over in pending if over)
                pending = []
            free -= blocks
            admitted.append(request)
            continue
        overdue = now - request.arrival_time >= max_wait_s
        if overdue and late_passes_left(request) <= 0:
            break
        pending.append((request, overdue))
    return passed, late


def colds_to_queue(running: Iterable[Any], waiting: Iterable[Any]) -> set[str]:
    """Waiting long prefills not to admit this step (module docstring, "Colds one after the
    other"): those ranked behind a long prefill that runs, or behind the best-ranked waiting
    one, which vLLM admits first. A long prefill ranked ahead of every running one is left to
    vLLM (it was preempted for warmer work, or outranks them by the plugin's deadlines)."""
    ahead = [rank(r) for r in running if is_long(r)]
    queued: set[str] = set()
    for request in waiting:
        if request.status not in READY or not is_long(request):
            continue
        if ahead and rank(request) > min(ahead):
            queued.add(request.request_id)
        ahead.append(rank(request))
    return queued


def colds_to_pause(running: Iterable[Any], waiting: Iterable[Any], fits: Any) -> list[Any]:
    """Running long prefills to leave out of the next step, so that a resumed turn's prefill
    runs without their chunks (module docstring, "A resumed turn's step without cold chunks"):
    those ranked behind the warm request — the best-ranked short prefill running, or, if none
    runs, the best-ranked ready waiting request when it is short and ``fits(request)`` (vLLM
    will admit it this step). Empty when no such warm request exists, so a paused cold is
    never paused for nothing; only requests that outrank it pause it, which the plugin's
    deadlines bound (a cold is never starved)."""
    running = list(running)
    colds = [r for r in running if is_long(r)]
    if not colds:  # most steps: nothing to pause, and no need to look at the queue
        return []
    warm = [r for r in running if is_short_prefill(r)]
    if not warm:
        head = next((r for r in waiting if r.status in READY), None)
        if head is None or is_long(head) or not fits(head):
            return []
        warm = [head]
    best = min(rank(r) for r in warm)
    return [r for r in colds if rank(r) > best]


def preemption_victim(running: Iterable[Any], head: Any) -> Any | None:
    """The running request to preempt for ``head`` (the best-ranked waiting request): the
    worst-ranked *long* (cold) prefill that ranks behind ``head``; ``None`` if there is none.
    Decodes, better-ranked prefills and short prefills (resumed turns, whatever their rank)
    are never preempted: each such preemption would throw away a prefill about as cheap as the
    one it made room for, and resumed turns preempting one another made a forking workload
    slower (docs/scheduling.md, "Forking agents")."""
    behind = [r for r in running if is_long(r) and rank(r) > rank(head)]
    return max(behind, key=rank, default=None)


class WarmFirstScheduler(Scheduler):
    """vLLM's scheduler with preemption of colder prefills for a warmer waiting request, and
    the long-prefill cap applied only for warmer work (see the module docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kvb_cap = self.scheduler_config.long_prefill_token_threshold
        self._kvb_budget = self.max_num_scheduled_tokens
        self._kvb_priority = self.policy == SchedulingPolicy.PRIORITY
        self._kvb_dynamic = self._kvb_priority and self._kvb_cap > 0
        #: Preemptions and backfills made here (``kvbranch_scheduler_*`` on /metrics; vLLM's
        #: own stats count every preemption too).
        self.kvb_counters = SchedulerCounters()
        if self._kvb_priority:
            publish(self.kvb_counters)
        self._kvb_aging_s = aging_from_env() or DEFAULT_AGING_S
        #: Waiting requests skipped in this step for one behind them that fits (backfill).
        self._kvb_passed: set[str] = set()
        #: Times each waiting request was passed after its first ``aging_s`` (for siblings).
        self._kvb_late_passes: dict[str, int] = {}
        self._kvb_backfill = self._kvb_priority and on_unless_zero(ENV_BACKFILL)
        self._kvb_pause_colds = self._kvb_dynamic and on_unless_zero(ENV_PAUSE_COLDS)
        self._kvb_split_bursts = on_unless_zero(ENV_SPLIT_BURSTS)
        #: When a request last finished (monotonic): its agent may be back within ``aging_s``.
        self._kvb_last_done = float("-inf")

    def add_request(self, request: Any) -> None:
        """A request the plugin did not rank (priority 0: a route whose vLLM body has no
        ``priority``, e.g. /v1/messages) ranks as the coldest arriving now, never first."""
        if self._kvb_priority and request.priority <= 0:
            request.priority = unranked(time.monotonic(), self._kvb_aging_s)
        super().add_request(request)

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self._kvb_priority and self.waiting and self.running:
            self._preempt_for_warmer()
        if self._kvb_dynamic:
            self.running.sort(key=rank)
            waiting = [*self.waiting, *getattr(self, "kv_holding_waiting", ())]
            expecting = time.monotonic() - self._kvb_last_done < self._kvb_aging_s
            cap, budget = step_limits(
                self.running,
                waiting,
                self._kvb_cap,
                self._kvb_budget,
                expecting=expecting,
                split_bursts=self._kvb_split_bursts,
            )
            self.scheduler_config.long_prefill_token_threshold = cap
            self.max_num_scheduled_tokens = budget
        self._kvb_passed = self._backfill() if self._kvb_backfill and self.waiting else set()
        if self._kvb_dynamic and self.waiting:
            self._kvb_passed |= colds_to_queue(self.running, self.waiting)
        if self._kvb_pause_colds and self.running:
            self._pause_colds()
        return super().schedule(*args, **kwargs)

    def _pause_colds(self) -> None:
        """Leave the running cold prefills that rank behind a resumed turn's prefill out of
        this step (:func:`colds_to_pause`), with vLLM's own per-request skip: ``schedule``
        advances ``current_step`` before it compares, so ``current_step + 2`` skips this step
        alone. They keep their blocks and their place; vLLM may still preempt them."""
        free = self.kv_cache_manager.block_pool.get_num_free_blocks()
        # vLLM's own admission bound (paused streaming sessions hold a slot too)
        room = len(self.running) + self.num_waiting_for_streaming_input < self.max_num_active_reqs
        waiting = (r for r in self.waiting if r.request_id not in self._kvb_passed)
        paused = colds_to_pause(
            self.running, waiting, lambda r: room and self._device_blocks_needed(r) <= free
        )
        for request in paused:
            request.next_decode_eligible_step = max(
                request.next_decode_eligible_step, self.current_step + 2
            )
        if paused:
            self.kvb_counters.paused_steps += 1

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self._kvb_last_done = time.monotonic()
        return super()._free_request(request, *args, **kwargs)

    def _handle_blocked_waiting_request(self, request: Any) -> bool:
        """vLLM asks this for each waiting request it looks at; ``False`` skips the request
        for this step (it keeps its place). Requests passed by :meth:`_backfill` are skipped."""
        if request.request_id in self._kvb_passed:
            return False
        return bool(super()._handle_blocked_waiting_request(request))

    def _backfill(self) -> set[str]:
        """Which waiting requests to pass this step (see :func:`requests_to_pass` and the
        module docstring, "Backfill")."""
        passed, late = requests_to_pass(
            self.waiting,
            self._assess,
            self.kv_cache_manager.block_pool.get_num_free_blocks(),
            time.time(),  # vLLM's arrival_time is wall-clock
            self._kvb_aging_s,
            BACKFILL_LOOKAHEAD,
            lambda request: MAX_LATE_PASSES - self._kvb_late_passes.get(request.request_id, 0),
        )
        if len(self._kvb_late_passes) > 4 * BACKFILL_LOOKAHEAD:  # forget requests gone by
            waiting = {request.request_id for request in self.waiting}
            self._kvb_late_passes = {
                rid: n for rid, n in self._kvb_late_passes.items() if rid in waiting
            }
        for rid in late:
            self._kvb_late_passes[rid] = self._kvb_late_passes.get(rid, 0) + 1
        if passed:
            self.kvb_counters.backfills += 1
            self.kvb_counters.passed_requests += len(passed)
            logger.debug(
                "kvbranch: backfill past %d waiting request(s), %d late", len(passed), len(late)
            )
        return passed

    def _assess(self, request: Any, admitted: list[Any]) -> tuple[int, bool]:
        """(free device blocks a waiting request takes for its prompt and first token, whether
        it shares at least half of its blocks): all of :func:`blocks_needed` but the prefix
        blocks running requests already hold (a fork's sibling branch, a shared system prompt)
        or that a request ``admitted`` ahead of it in this step will hold."""
        total = blocks_needed(request, self.block_size)
        manager = self.kv_cache_manager
        if not manager.enable_caching or request.num_computed_tokens:
            return total, False
        hit, _, _ = manager.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1
        )
        ahead = admitted if len(hit) == 1 else []  # one KV group only, as shared_blocks
        shared = max([shared_blocks(hit)] + [common_prefix_blocks(request, a) for a in ahead])
        return total - shared, 2 * shared >= total

    def _device_blocks_needed(self, request: Any) -> int:
        """Free device blocks a waiting request takes now (:meth:`_assess`, nothing admitted)."""
        return self._assess(request, [])[0]

    def _preempt_for_warmer(self) -> None:
        """Free device blocks for the best-ranked waiting request by preempting colder
        running prefills, worst first, while it would not fit (module docstring)."""
        head = self.waiting.peek_request()
        if head.status not in READY:  # waits for something else (a peer's blocks, a grammar)
            return
        pool = self.kv_cache_manager.block_pool
        timestamp = time.monotonic()
        # Re-counted after each preemption: blocks a victim shared with the head are free now.
        while pool.get_num_free_blocks() < self._device_blocks_needed(head):
            victim = preemption_victim(self.running, head)
            if victim is None or not self._request_blocks_can_be_freed(victim):
                return
            logger.debug(
                "kvbranch: preempting prefill %s (%d/%d computed) for warmer %s",
                victim.request_id,
                victim.num_computed_tokens,
                victim.num_prompt_tokens,
                head.request_id,
            )
            self.running.remove(victim)
            self._preempt_request(victim, timestamp)
            self.kvb_counters.preemptions += 1


def is_long(request: Any) -> bool:
    """A long (cold) prefill by the plugin's estimate, still to run."""
    return level_in(request.priority) >= LONG_LEVEL and (
        request.status != RequestStatus.RUNNING or is_prefilling(request)
    )


def is_short_prefill(request: Any) -> bool:
    """A resumed turn's prefill (not a long one by the plugin's estimate), still to run."""
    return is_prefilling(request) and not is_long(request)


def short_prefills(running: Iterable[Any], waiting: Iterable[Any]) -> int:
    """Resumed turns (short prefills) prefilling or ready to start."""
    return sum(1 for r in running if is_short_prefill(r)) + sum(
        1 for r in waiting if r.status in READY and not is_long(r)
    )


def step_limits(
    running: list[Any],
    waiting: list[Any],
    chunk: int,
    budget: int,
    *,
    expecting: bool = False,
    split_bursts: bool = False,
) -> tuple[int, int]:
    """(per-request prompt cap, step token budget) for this step (see the module docstring);
    ``expecting``: a turn finished lately, so a resumed turn may arrive during this step;
    ``split_bursts``: several resumed turns pending run in rank order in short steps."""
    if split_bursts and short_prefills(running, waiting) > 1:
        budget = chunk + len(running)  # a burst: in rank order, small turns still batch
    if cap_needed(running, waiting):
        return chunk, budget  # warmer work: every prefill capped, the warm one gets the rest
    # A long prefill waiting would start with the whole budget once admitted, and a resumed
    # turn arriving meanwhile would wait for that whole first chunk. A short prefill (resumed
    # turn) alone keeps vLLM's budget.
    long_pending = any(is_long(r) for r in running) or any(is_long(r) for r in waiting)
    if long_pending and (len(running) + len(waiting) > 1 or expecting):
        return 0, chunk + len(running)  # short steps, colds one after the other; decodes go on
    return 0, budget
