"""The sweep's Markdown report: the SLO and how it was set, one table row per configuration and
agent count, each configuration's capacity, and where answers differed from plain vLLM."""

from __future__ import annotations

import argparse

from benchmarks import reporting
from benchmarks.capacity.sweep import (
    StepSummary,
    capacity,
    lower_bound,
    ratio_target,
    ratio_verdict,
)


def _p(a: float, b: float, c: float) -> str:
    return f"{a:.2f} / {b:.2f} / {c:.2f}"


def markdown(
    args: argparse.Namespace,
    workload: str,
    summaries: dict[str, list[StepSummary]],
    alone: dict[str, float],
    slo_s: float,
    identical: dict[str, dict[int, tuple[int, int]]],
    info: dict[str, str],
    elapsed_s: float,
    plot: str,
) -> str:
    lines = reporting.run_header(f"capacity ({args.trace})", info, elapsed_s)
    first = next(iter(alone))
    lines.append(
        f"- SLO: p90 TTFT of resumed turns <= **{slo_s:.3f} s** = {args.slo_multiple:g}x the "
        f"median resumed turn alone on {first} ({alone[first]:.3f} s; alone on each "
        f"configuration: {', '.join(f'{k} {v:.3f} s' for k, v in alone.items())})"
    )
    lines.append(f"- Workload: {workload}")
    if plot:
        lines.append(f"- Plot: `{plot}`")
    lines.append("")
    lines.append(count_table(summaries, identical))
    lines += capacity_lines(args.trace, summaries)
    return "\n".join(lines)


def count_table(
    summaries: dict[str, list[StepSummary]], identical: dict[str, dict[int, tuple[int, int]]]
) -> str:
    """One row per configuration and agent count."""
    header = [
        "configuration",
        "agents",
        "resumed p50 / p90 / p99 (s)",
        "cold p50 / p90 / p99 (s)",
        "turns resumed / cold",
        "output tok/s",
        "requests/s",
        "recomputed / prompt tokens",
        "meets SLO",
        "answers = plain",
    ]
    rows = []
    for name, steps in summaries.items():
        for s in steps:
            same, compared = identical.get(name, {}).get(s.agents, (0, 0))
            rows.append(
                [
                    name,
                    s.agents,
                    _p(s.resumed_p50, s.resumed_p90, s.resumed_p99),
                    _p(s.cold_p50, s.cold_p90, s.cold_p99),
                    f"{s.resumed_n} / {s.cold_n}",
                    s.output_tps,
                    s.requests_per_s,
                    f"{s.recomputed_tokens} / {s.prompt_tokens}",
                    "yes" if s.meets_slo else "**no**",
                    f"{same}/{compared}" if compared else "–",
                ]
            )
    return reporting.md_table(header, rows)


def capacity_lines(trace: str, summaries: dict[str, list[StepSummary]]) -> list[str]:
    """Each configuration's capacity, and each one's ratio to plain's against the target."""
    caps = {name: capacity(steps) for name, steps in summaries.items()}
    lines = [
        "Capacity (largest count meeting the SLO, every smaller count meeting it too): "
        + ", ".join(
            f"{k} **{'>= ' if lower_bound(summaries[k]) else ''}{v}**" for k, v in caps.items()
        )
        + " (>=: no count failed, raise --agents)"
    ]
    if "plain" not in caps:
        return lines
    want = ratio_target(trace)
    for name, cap in caps.items():
        if name == "plain":
            continue
        if caps["plain"] == 0:
            lines.append(f"- {name}: plain vLLM met the SLO at no count measured (no ratio)")
            continue
        got = cap / caps["plain"]
        met = ratio_verdict(
            cap, lower_bound(summaries[name]), caps["plain"], lower_bound(summaries["plain"]), want
        )
        verdict = {
            True: "**met**",
            False: f"**not met** (short by {want / max(got, 1e-9):.2f}x)",
            None: "**not decided** (a count that never failed: raise --agents)",
        }[met]
        lines.append(
            f"- {verdict} — {name} carries {got:.2f}x plain's agents (target >= {want:g}x)"
        )
    return lines
