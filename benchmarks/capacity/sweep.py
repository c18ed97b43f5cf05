"""The capacity sweep's pure parts: who replays what, the SLO, one agent count's summary, the
stop rule, the capacity it finds, the token-identity check and the records it reports.

Kept apart from the servers and the clock (:mod:`benchmarks.capacity.replay`) so that every rule
that decides the headline number is unit-tested on its own (tests/unit/benchmarks/
test_capacity.py), not only by a sweep that takes an hour on a quiet machine.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.records import Record, result
from benchmarks.reporting import median, percentile
from benchmarks.traces import Conversation

BENCHMARK = "capacity"
#: The percentile of resumed turns' TTFT the SLO bounds.
SLO_PERCENTILE = 90.0
#: The issue's target: kvbranch carries this many times as many agents as plain vLLM.
TARGET_RATIO = {"bfcl": 10.0, "mooncake": 3.0}


@dataclass(frozen=True)
class Turn:
    """One request an agent sent: which conversation (``copy``: how many times the pool of
    conversations had been used before it, a fresh cache salt each time) and step, and what
    it measured."""

    agent: int
    conv: str
    copy: int
    step: int
    ttft_s: float
    total_s: float
    prompt_tokens: int
    completion_tokens: int
    recomputed_tokens: int
    answer: str

    @property
    def resumed(self) -> bool:
        return self.step > 0

    @property
    def key(self) -> tuple[str, int, int]:
        """The turn's inputs: the same key, the same request body in every configuration."""
        return (self.conv, self.copy, self.step)


@dataclass(frozen=True)
class StepSummary:
    """One agent count of one configuration."""

    agents: int
    resumed_n: int
    cold_n: int
    resumed_p50: float
    resumed_p90: float
    resumed_p99: float
    cold_p50: float
    cold_p90: float
    cold_p99: float
    wall_s: float
    output_tps: float
    requests_per_s: float
    recomputed_tokens: int
    prompt_tokens: int
    meets_slo: bool


def assign(
    convs: Sequence[Conversation], agents: int, per_agent: int
) -> list[list[tuple[int, int]]]:
    """Each agent's conversations as ``(index into convs, copy)``: agent ``a`` takes items
    ``a, a + agents, a + 2 * agents, ...`` of the pool repeated, so no two agents share a
    conversation at one count, and a conversation used again is a new copy (its own salt)."""
    if agents < 1 or per_agent < 1 or not convs:
        raise ValueError("need at least one agent, one conversation each, and a trace")
    out: list[list[tuple[int, int]]] = []
    for a in range(agents):
        items = [a + k * agents for k in range(per_agent)]
        out.append([(i % len(convs), i // len(convs)) for i in items])
    return out


def slo_from_alone(alone_resumed_ttft: Sequence[float], multiple: float) -> tuple[float, float]:
    """``(reference, slo)``: the median TTFT of resumed turns run alone, and ``multiple`` times
    it — stated per machine, so the same command means the same on a faster one."""
    if multiple <= 0:
        raise ValueError("the SLO multiple must be positive")
    if not alone_resumed_ttft:
        raise ValueError("no resumed turn was measured alone: the SLO has no reference")
    ref = median(list(alone_resumed_ttft))
    return ref, ref * multiple


def meets(p90: float, slo_s: float) -> bool:
    """A count meets the SLO when its resumed p90 is measured (no resumed turn: not shown to
    meet it) and at most the SLO."""
    return not math.isnan(p90) and p90 <= slo_s


def summarize(agents: int, turns: Sequence[Turn], wall_s: float, slo_s: float) -> StepSummary:
    resumed = [t.ttft_s for t in turns if t.resumed]
    cold = [t.ttft_s for t in turns if not t.resumed]
    p90 = percentile(resumed, SLO_PERCENTILE)
    wall = max(wall_s, 1e-9)
    return StepSummary(
        agents=agents,
        resumed_n=len(resumed),
        cold_n=len(cold),
        resumed_p50=percentile(resumed, 50),
        resumed_p90=p90,
        resumed_p99=percentile(resumed, 99),
        cold_p50=percentile(cold, 50),
        cold_p90=percentile(cold, 90),
        cold_p99=percentile(cold, 99),
        wall_s=wall_s,
        output_tps=sum(t.completion_tokens for t in turns) / wall,
        requests_per_s=len(turns) / wall,
        recomputed_tokens=sum(t.recomputed_tokens for t in turns),
        prompt_tokens=sum(t.prompt_tokens for t in turns),
        meets_slo=meets(p90, slo_s),
    )


def should_stop(done: Sequence[StepSummary]) -> bool:
    """Stop raising the count once one count has failed the SLO (it is the first past the
    capacity; a higher count only queues more)."""
    return any(not s.meets_slo for s in done)


def capacity(done: Sequence[StepSummary]) -> int:
    """The largest count that meets the SLO with every smaller count measured meeting it too
    (0: even the smallest failed)."""
    best = 0
    for s in sorted(done, key=lambda s: s.agents):
        if not s.meets_slo:
            break
        best = s.agents
    return best


def lower_bound(done: Sequence[StepSummary]) -> bool:
    """Whether the capacity is only a lower bound: no count measured failed the SLO (the
    sweep ran out of counts before the curve crossed it; raise ``--agents``)."""
    return not should_stop(done)


def compare_answers(turns: Sequence[Turn], reference: Sequence[Turn]) -> tuple[int, int]:
    """``(identical, compared)``: turns whose answer equals the reference configuration's for
    the same inputs (only keys both ran are compared)."""
    ref = {t.key: t.answer for t in reference}
    both = [t for t in turns if t.key in ref]
    return sum(t.answer == ref[t.key] for t in both), len(both)


def ratio_target(trace: str) -> float:
    return TARGET_RATIO.get(trace, 10.0)


def ratio_verdict(
    cap: int, cap_is_bound: bool, base: int, base_is_bound: bool, want: float
) -> bool | None:
    """Whether ``cap`` is at least ``want`` times ``base``, where a capacity flagged as a lower
    bound may be higher: met only if it holds for the bounds as measured with kvbranch's count
    the bound, not met only if it fails with the baseline's count the bound; None otherwise
    (or when the baseline met the SLO nowhere: no ratio)."""
    if base <= 0:
        return None
    ok = cap >= want * base
    if ok and base_is_bound:
        return None  # the baseline may carry more
    if not ok and cap_is_bound:
        return None  # kvbranch may carry more
    return ok


def build_records(
    trace: str,
    summaries: dict[str, list[StepSummary]],
    slo_s: float,
    reference_s: float,
    multiple: float,
    identical: dict[str, dict[int, tuple[int, int]]],
    baseline: str = "plain",
    plots: tuple[str, ...] = (),
) -> list[Record]:
    """The run's records: the SLO; per configuration and count every percentile, throughput,
    recomputed tokens and answers identical to ``baseline``; per configuration its capacity,
    with the issue's ratio target where the baseline ran."""
    out = [
        result(
            BENCHMARK,
            "all",
            f"{trace} SLO: resumed p90 TTFT",
            slo_s,
            "s",
            note=f"{multiple:g}x the median resumed turn alone ({reference_s:.3f} s)",
            plots=plots,
        )
    ]
    for name, steps in summaries.items():
        for s in steps:
            out += count_records(trace, name, s, slo_s, identical, baseline)
        out.append(capacity_record(trace, name, summaries, baseline))
    return out


def count_records(
    trace: str,
    name: str,
    s: StepSummary,
    slo_s: float,
    identical: dict[str, dict[int, tuple[int, int]]],
    baseline: str,
) -> list[Record]:
    """One configuration at one count: its percentiles, throughput, recomputed tokens (the
    resumed p90 against the SLO), and its answers against ``baseline``'s."""
    at = f"{trace} agents={s.agents}"
    out = []
    for metric, value, unit in (
        ("resumed TTFT p50", s.resumed_p50, "s"),
        ("resumed TTFT p90", s.resumed_p90, "s"),
        ("resumed TTFT p99", s.resumed_p99, "s"),
        ("cold TTFT p50", s.cold_p50, "s"),
        ("cold TTFT p90", s.cold_p90, "s"),
        ("cold TTFT p99", s.cold_p99, "s"),
        ("output throughput", s.output_tps, "tok/s"),
        ("recomputed prompt tokens", s.recomputed_tokens, "tokens"),
    ):
        target, met = "", None
        if metric == "resumed TTFT p90":
            target, met = f"<= {slo_s:.3f} s (the SLO)", s.meets_slo
        out.append(result(BENCHMARK, name, f"{at} {metric}", value, unit, target, met))
    same, compared = identical.get(name, {}).get(s.agents, (0, 0))
    if name != baseline and compared:
        out.append(
            result(
                BENCHMARK,
                name,
                f"{at} answers identical to {baseline}",
                same / compared,
                "fraction",
                "1.0 (token-identical)",
                same == compared,
                note=f"{same}/{compared} turns",
            )
        )
    return out


def capacity_record(
    trace: str, name: str, summaries: dict[str, list[StepSummary]], baseline: str
) -> Record:
    """A configuration's capacity, with the ratio target against ``baseline``'s where it ran."""
    steps = summaries[name]
    caps = {n: capacity(st) for n, st in summaries.items()}
    target, met, note = "", None, ""
    if name != baseline and baseline in caps:
        want = ratio_target(trace)
        base = caps[baseline]
        target = f">= {want:g}x {baseline}'s ({want * base:g} agents)"
        met = ratio_verdict(
            caps[name], lower_bound(steps), base, lower_bound(summaries[baseline]), want
        )
        note = f"{baseline} carries {base}" + (
            "" if base > 0 else ": no ratio; start the sweep at fewer agents"
        )
    if lower_bound(steps):
        note = "; ".join(x for x in (note, "no count failed: a lower bound") if x)
    return result(
        BENCHMARK,
        name,
        f"{trace} capacity at the SLO",
        caps[name],
        "agents",
        target,
        met,
        note=note,
    )
