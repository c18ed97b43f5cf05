"""The report and records of :mod:`benchmarks.pd_turns`: per budget, the median TTFT of every
turn per configuration, the late turns, tokens pulled from D, and the ratios against upstream
P/D (vLLM's own bidirectional P/D) and against P/D without the pull; greedy answers compared
across every run, turn by turn (keyed by conversation, branch and turn: the concurrent
workloads finish turns in any order).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path
from typing import Any

from benchmarks import reporting
from benchmarks.records import Record, result

NAME = "pd_turns"
#: P/D without the pull against kvbranch P/D: p50 TTFT at turns >= 3 this much lower, and
#: turn 1 (nothing to reuse) within 3% of it.
PD_TARGET = 1.6
TURN1_TARGET = 1.03
#: Against upstream P/D: turn 1 within 1.1x at every budget, and the late turns
#: 1.5x faster where memory is ample (:data:`AMPLE_GIB` and more).
TURN1_UPSTREAM_TARGET = 1.1
#: ... and never above 1.2x at p95 (nearest rank: with 4 agents, the slowest first turn).
TURN1_P95_UPSTREAM_TARGET = 1.2
LATE_UPSTREAM_TARGET = 1.5
AMPLE_GIB = 1.0

UPSTREAM = "pd-upstream"
LABELS = {
    UPSTREAM: "upstream P/D (vLLM's NixlConnector, bidirectional, our proxy)",
    "pd-kvbranch": "kvbranch P/D",
    "pd": "P/D without the pull (kvbranch's guard and checked NIXL, no D->P pull)",
}


# --- numbers -------------------------------------------------------------------------------------
def ttfts(res: dict[str, Any], first: int, last: int | None = None) -> list[float]:
    return [
        t["ttft_s"]
        for t in res["turns"]
        if t["turn"] >= first and (last is None or t["turn"] <= last)
    ]


def mean_ttft(res: dict[str, Any], first_turn: int) -> float:
    values = ttfts(res, first_turn)
    return statistics.fmean(values) if values else float("nan")


def p50_ttft(res: dict[str, Any], first: int, last: int | None = None) -> float:
    values = ttfts(res, first, last)
    return statistics.median(values) if values else float("nan")


def per_turn_median(res: dict[str, Any], turn: int) -> float:
    return p50_ttft(res, turn, turn)


def per_turn_p95(res: dict[str, Any], turn: int) -> float:
    """Nearest-rank p95 of the turn's TTFTs (the slowest of fewer than 20)."""
    values = sorted(ttfts(res, turn, turn))
    return values[math.ceil(0.95 * len(values)) - 1] if values else float("nan")


def last_turn(results: list[dict[str, Any]]) -> int:
    """The last turn any run reached (BFCL traces count steps: up to two per user turn)."""
    return max((t["turn"] for r in results for t in r["turns"]), default=1)


def late_turn(results: list[dict[str, Any]]) -> int:
    """The first of the last two turns (5 of 6): where a long history is resumed."""
    return max(2, last_turn(results) - 1)


def answers(results: list[dict[str, Any]]) -> tuple[int, int, dict[str, int]]:
    """(turns whose answer is the same in every run, turns, per run: turns that differ from the
    first run's answer), turns keyed by (conversation, branch, turn)."""
    by: dict[tuple[str, str, int], dict[str, str]] = {}
    for res in results:
        for t in res["turns"]:
            by.setdefault((t["conversation"], t["branch"], t["turn"]), {})[res["name"]] = t[
                "content"
            ]
    ref = results[0]["name"]
    differ = {
        r["name"]: sum(1 for a in by.values() if r["name"] in a and a[r["name"]] != a.get(ref))
        for r in results
    }
    same = sum(1 for a in by.values() if len(set(a.values())) == 1)
    return same, len(by), differ


def shape(args: argparse.Namespace) -> str:
    """The workload in a record's metric: ``interleaved 4x6``, ``agents 4x6``, ``bfcl 4x3``,
    ``one at a time 1x6, P's cache reset``."""
    size = f"{args.conversations}x{args.turns}"
    if args.workload == "conversations":
        reset = ", P's cache reset" if getattr(args, "reset_p_cache", False) else ""
        return f"{'interleaved' if args.interleave else 'one at a time'} {size}{reset}"
    return f"{args.workload} {size}"


# --- report --------------------------------------------------------------------------------------
def plot(results: list[dict[str, Any]], path: Path) -> None:
    plt = reporting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(1, last_turn(results) + 1))
    for res in results:
        ax.plot(xs, [per_turn_median(res, t) for t in xs], marker="o", label=res["name"])
    ax.set_yscale("log")
    reporting.save_plot(
        fig, ax, path, "turn", "median TTFT (s)", "P/D: upstream, kvbranch, without the pull"
    )


def budget_lines(results: list[dict[str, Any]], args: argparse.Namespace) -> list[str]:
    by = {r["config"]: r for r in results}
    names = [r["config"] for r in results]
    turns = range(1, last_turn(results) + 1)
    rows = [[t, *[f"{per_turn_median(r, t):.2f}" for r in results]] for t in turns]
    late = late_turn(results)
    summary = [
        ["mean TTFT turns >= 2 (s)", *[f"{mean_ttft(r, 2):.2f}" for r in results]],
        [f"p50 TTFT turns >= {late} (s)", *[f"{p50_ttft(r, late):.2f}" for r in results]],
        [
            "recomputed prompt tokens, turns >= 2",
            *[
                str(sum(t["recomputed_tokens"] for t in r["turns"] if t["turn"] >= 2))
                for r in results
            ],
        ],
        ["tokens pulled from D", *[f"{r['pulled_tokens']:.0f}" for r in results]],
        [
            "median 1-min load average at requests (2 cores = 2.0)",
            *[f"{statistics.median([t['load1'] or 0 for t in r['turns']]):.1f}" for r in results],
        ],
    ]
    gib = results[0]["budget_gib"]
    lines = [
        f"### {gib:g} GiB device KV per instance (max model length {results[0]['max_model_len']})",
        "",
        reporting.md_table(["turn (median TTFT, s)", *names], rows),
        "",
        reporting.md_table(["", *names], summary),
        "",
    ]
    for name in names:
        if by[name].get("proxy"):
            lines.append(f"- {name} proxy: {by[name]['proxy']}.")
    if UPSTREAM in by and "pd-kvbranch" in by:
        up, kvb = by[UPSTREAM], by["pd-kvbranch"]
        t1 = per_turn_median(kvb, 1) / per_turn_median(up, 1)
        t1_p95 = per_turn_p95(kvb, 1) / per_turn_p95(up, 1)
        lines.append(
            f"- kvbranch P/D vs upstream P/D: turn 1 p50 {t1:.2f}x upstream's (target <= "
            f"{TURN1_UPSTREAM_TARGET}), p95 {t1_p95:.2f}x (target <= "
            f"{TURN1_P95_UPSTREAM_TARGET}); turns >= {late} p50 upstream "
            f"{p50_ttft(up, late):.2f} s / kvbranch {p50_ttft(kvb, late):.2f} s = "
            f"{p50_ttft(up, late) / p50_ttft(kvb, late):.2f}x (target >= {LATE_UPSTREAM_TARGET} "
            f"at >= {AMPLE_GIB:g} GiB)."
        )
    if "pd" in by and "pd-kvbranch" in by and last_turn(results) >= 3:
        ratio = p50_ttft(by["pd"], 3) / p50_ttft(by["pd-kvbranch"], 3)
        lines.append(
            f"- P/D without the pull vs kvbranch P/D, p50 TTFT turns >= 3: {ratio:.2f}x "
            f"(target >= {PD_TARGET}x)."
        )
    for n in names:
        legs = [
            (t["prefill_leg_s"], t["ttft_s"])
            for t in by[n]["turns"]
            if t["turn"] == 1 and t.get("prefill_leg_s") is not None
        ]
        if legs:
            p = statistics.fmean(x for x, _ in legs)
            rest = statistics.fmean(y - x for x, y in legs)
            lines.append(
                f"- {n}, turn 1 split by Server-Timing: P's leg {p:.2f} s, then D's read and "
                f"first token {rest:.2f} s (means)."
            )
    return lines + [""]


def report(
    results: list[dict[str, Any]], args: argparse.Namespace, info: dict[str, str], elapsed: float
) -> str:
    workload = {
        "conversations": f"{args.conversations} conversations x {args.turns} turns, "
        + ("interleaved turn by turn" if args.interleave else "one at a time")
        + (
            ", P's device prefix cache emptied before every turn after the first"
            if getattr(args, "reset_p_cache", False)
            else ""
        ),
        "agents": f"{args.conversations} forking agents x {args.turns} turns, fork at turn "
        f"{args.fork_turn} into 2 branches, tool pauses around {args.pause_s:g} s",
        "bfcl": f"{args.conversations} BFCL multi-turn traces, up to {args.turns} user turns "
        "(a turn here is a step: after a user turn, after its tool outputs), concurrently, "
        "answers not fed back",
    }[args.workload]
    lines = [
        *reporting.run_header("pd_turns", info, elapsed),
        f"- {workload}; "
        + (
            f"system prompt ~{args.system_tokens} tokens, ~{args.new_tokens} new tokens per turn; "
            if args.workload != "bfcl"
            else ""
        )
        + f"{args.gen_tokens} generated tokens per turn; D's hold {args.pd_hold_ttl_s:g} s; P on "
        "core 0, D on core 1, single instances on core 0.",
        "- Configurations: "
        + "; ".join(f"`{c}` {LABELS[c]}" for c in args.configs if c in LABELS)
        + ".",
        "",
    ]
    for gib in args.kv_cache_gib:
        lines += budget_lines([r for r in results if r["budget_gib"] == gib], args)
    same, total, differ = answers(results)
    lines.append(
        f"- Greedy answers identical across {len(results)} runs: {same}/{total} turns; turns "
        f"that differ from {results[0]['name']}'s: {differ}."
    )
    lines.append("- Plot: `benchmarks/plots/pd_turns.png`.")
    return "\n".join(lines)


def records_of(
    results: list[dict[str, Any]], args: argparse.Namespace, plots: tuple[str, ...]
) -> list[Record]:
    """Per run: mean TTFT at turns >= 2, p50 at turn 1 and at the late turns, tokens pulled;
    per budget the ratios against upstream P/D and against P/D without the pull."""
    out: list[Record] = []
    late = late_turn(results)
    for gib in args.kv_cache_gib:
        at = f"{shape(args)}, {gib:g} GiB: "
        by = {r["config"]: r for r in results if r["budget_gib"] == gib}
        for name, res in by.items():
            out += [
                result(
                    NAME, name, at + "mean TTFT turns >= 2", mean_ttft(res, 2), "s", plots=plots
                ),
                result(NAME, name, at + "p50 TTFT turn 1", per_turn_median(res, 1), "s"),
                result(NAME, name, at + f"p50 TTFT turns >= {late}", p50_ttft(res, late), "s"),
                result(NAME, name, at + "tokens pulled from D", res["pulled_tokens"], "tokens"),
            ]
        if UPSTREAM in by and "pd-kvbranch" in by:
            up, kvb = by[UPSTREAM], by["pd-kvbranch"]
            t1 = per_turn_median(kvb, 1) / per_turn_median(up, 1)
            out.append(
                result(
                    NAME,
                    f"pd-kvbranch/{UPSTREAM}",
                    at + "p50 TTFT turn 1",
                    t1,
                    "x",
                    target=f"<= {TURN1_UPSTREAM_TARGET}x",
                    met=t1 <= TURN1_UPSTREAM_TARGET,
                )
            )
            t1_p95 = per_turn_p95(kvb, 1) / per_turn_p95(up, 1)
            out.append(
                result(
                    NAME,
                    f"pd-kvbranch/{UPSTREAM}",
                    at + "p95 TTFT turn 1",
                    t1_p95,
                    "x",
                    target=f"<= {TURN1_P95_UPSTREAM_TARGET}x",
                    met=t1_p95 <= TURN1_P95_UPSTREAM_TARGET,
                )
            )
            late_ratio = p50_ttft(up, late) / p50_ttft(kvb, late)
            ample = gib >= AMPLE_GIB
            out.append(
                result(
                    NAME,
                    f"{UPSTREAM}/pd-kvbranch",
                    at + f"p50 TTFT turns >= {late}",
                    late_ratio,
                    "x",
                    target=f">= {LATE_UPSTREAM_TARGET}x" if ample else "",
                    met=late_ratio >= LATE_UPSTREAM_TARGET if ample else None,
                )
            )
        if "pd" in by and "pd-kvbranch" in by and last_turn(results) >= 3:
            ratio = p50_ttft(by["pd"], 3) / p50_ttft(by["pd-kvbranch"], 3)
            out.append(
                result(
                    NAME,
                    "pd/pd-kvbranch",
                    at + "p50 TTFT turns >= 3",
                    ratio,
                    "x",
                    target=f">= {PD_TARGET}x",
                    met=ratio >= PD_TARGET,
                )
            )
            first = {n: ttfts(by[n], 1, 1) for n in ("pd", "pd-kvbranch")}
            turn1 = statistics.fmean(first["pd-kvbranch"]) / statistics.fmean(first["pd"])
            out.append(
                result(
                    NAME,
                    "pd-kvbranch/pd",
                    at + f"mean TTFT at turn 1 (n = {len(first['pd'])})",
                    turn1,
                    "x",
                    target=f"within 3% (<= {TURN1_TARGET})",
                    met=turn1 <= TURN1_TARGET,
                )
            )
    same, total, _ = answers(results)
    out.append(
        result(NAME, "all", shape(args) + f": answers identical (of {total} turns)", same, "turns")
    )
    return out
