"""A cold prefill yields the step budget only to warmer work (``--cold-prefill-chunk`` with
``--agent-priority``; docs/scheduling.md).

vLLM's ``--long-prefill-token-threshold`` caps every request's prompt chunk per step whenever
more than one request is waiting or running. Measured here with two cold 2.5-4k-token prompts
arriving together (benchmarks/real_traces.py smoke run, ``--cold-prefill-chunk 256``): both
were capped, shared every step and finished together at 32-34 s, where first-come-first-served
finishes the first one in about half that — processor sharing, the worst order for cold turns.
The cap exists for the opposite case: a resumed agent turn (few new tokens, ranked ahead by
:mod:`server.plugin.priority`) that would otherwise wait behind a running cold prefill's
2048-token chunk.

So this scheduler applies the configured threshold only while some request that ranks ahead
(a lower ``priority``) of a running prefill is waiting or running; otherwise it lifts the cap
and cold prefills run one after the other, in priority order, as without it. A resumed turn
that arrives while a cold prefill computes still waits for the step in flight: measured on the
same traces (RESULTS.md, real_traces 02:00), the cap alone gave no gain for that reason, with
2048-token steps of about 5 s on one core. So while cold prefills run with nothing ahead of
them (and more than one request exists), the whole step budget is the chunk: steps stay short
(the next arrival waits at most one short step) and the colds still go one at a time (the
first in priority order takes the budget). ``running`` is kept in ``(priority, arrival)`` order
so that the budget goes to the higher-ranked requests first. Under vLLM's FCFS policy (all
priorities equal) it keeps vLLM's own rule. The launcher selects it with vLLM's own
``--scheduler-cls`` on CPU, where vLLM uses the synchronous scheduler; elsewhere vLLM's static
threshold applies.

Measured on the same traces with this scheduler (RESULTS.md, real_traces 02:09): no better,
because under KV pressure a resumed turn waits for device blocks that the running cold prefill
holds, which neither the order nor the step size frees (docs/scheduling.md); so it is used only
with the opt-in flags.

Pinned to vLLM 0.32's ``Scheduler`` (``running``, ``waiting``, ``scheduler_config``, a
request's ``priority``, ``num_computed_tokens`` and ``num_prompt_tokens``).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler

QUALNAME = "server.engine_chunk.WarmFirstScheduler"


def cap_needed(running: Iterable[Any], waiting: Iterable[Any]) -> bool:
    """Whether a running prefill has someone ahead of it in priority (waiting or running)."""
    running = list(running)
    prefilling = [r.priority for r in running if r.num_computed_tokens < r.num_prompt_tokens]
    if not prefilling:
        return False
    worst = max(prefilling)
    return any(r.priority < worst for r in running) or any(r.priority < worst for r in waiting)


class WarmFirstScheduler(Scheduler):
    """vLLM's scheduler with the long-prefill cap applied only for warmer work."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kvb_cap = self.scheduler_config.long_prefill_token_threshold
        self._kvb_budget = self.max_num_scheduled_tokens
        self._kvb_dynamic = self.policy == SchedulingPolicy.PRIORITY and self._kvb_cap > 0

    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        if self._kvb_dynamic:
            self.running.sort(key=lambda r: (r.priority, r.arrival_time))
            waiting = [*self.waiting, *getattr(self, "kv_holding_waiting", ())]
            cap, budget = step_limits(self.running, waiting, self._kvb_cap, self._kvb_budget)
            self.scheduler_config.long_prefill_token_threshold = cap
            self.max_num_scheduled_tokens = budget
        return super().schedule(*args, **kwargs)


def step_limits(running: list[Any], waiting: list[Any], chunk: int, budget: int) -> tuple[int, int]:
    """(per-request prompt cap, step token budget) for this step (see the module docstring)."""
    if cap_needed(running, waiting):
        return chunk, budget  # warmer work: every prefill capped, the warm one gets the rest
    prefilling = any(r.num_computed_tokens < r.num_prompt_tokens for r in running)
    if prefilling and len(running) + len(waiting) > 1:
        return 0, chunk + len(running)  # short steps, colds one after the other; decodes go on
    return 0, budget
