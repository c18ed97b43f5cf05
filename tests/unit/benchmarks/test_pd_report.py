"""benchmarks/pd_report: answers compared by (conversation, branch, turn) whatever order the
concurrent workloads finished in, and the ratios against upstream P/D with their targets
(turn 1 within 1.1x at every budget, the late turns 1.5x faster only where memory is ample)."""

from __future__ import annotations

import argparse

from benchmarks.pd_report import UPSTREAM, answers, records_of


def run(config: str, gib: float, ttfts: dict[int, float], contents: dict[int, str]) -> dict:
    turns = [
        {"conversation": "c0", "branch": "main", "turn": t, "ttft_s": s, "content": contents[t]}
        for t, s in ttfts.items()
    ]
    return {
        "name": f"{config}@{gib:g}GiB",
        "config": config,
        "budget_gib": gib,
        "turns": turns,
        "pulled_tokens": 0,
    }


def args(gibs: list[float]) -> argparse.Namespace:
    return argparse.Namespace(
        kv_cache_gib=gibs, workload="conversations", interleave=False, conversations=1, turns=6
    )


SAME = {t: f"answer {t}" for t in range(1, 7)}


def test_answers_are_matched_by_turn_not_by_position():
    a = run(UPSTREAM, 1.5, {t: 1.0 for t in range(1, 7)}, SAME)
    b = run("pd-kvbranch", 1.5, {t: 1.0 for t in range(1, 7)}, SAME)
    b["turns"].reverse()  # a concurrent workload finishes turns in any order
    assert answers([a, b]) == (6, 6, {a["name"]: 0, b["name"]: 0})
    c = run("pd", 1.5, {t: 1.0 for t in range(1, 7)}, {**SAME, 4: "other"})
    assert answers([a, b, c])[0] == 5 and answers([a, b, c])[2][c["name"]] == 1


def test_the_late_turn_target_applies_only_where_memory_is_ample():
    up = {t: 3.0 for t in range(1, 7)}
    kvb = {1: 3.0, 2: 2.0, 3: 2.0, 4: 2.0, 5: 1.0, 6: 1.0}
    results = [run(UPSTREAM, gib, up, SAME) for gib in (0.15, 1.5)] + [
        run("pd-kvbranch", gib, kvb, SAME) for gib in (0.15, 1.5)
    ]
    recs = {(r.config, r.metric): r for r in records_of(results, args([0.15, 1.5]), ())}
    late_small = recs[
        (f"{UPSTREAM}/pd-kvbranch", "one at a time 1x6, 0.15 GiB: p50 TTFT turns >= 5")
    ]
    late_ample = recs[
        (f"{UPSTREAM}/pd-kvbranch", "one at a time 1x6, 1.5 GiB: p50 TTFT turns >= 5")
    ]
    assert late_small.value == 3.0 and late_small.met is None and not late_small.target
    assert late_ample.value == 3.0 and late_ample.met is True
    turn1 = recs[(f"pd-kvbranch/{UPSTREAM}", "one at a time 1x6, 0.15 GiB: p50 TTFT turn 1")]
    assert turn1.value == 1.0 and turn1.met is True
    assert recs[("all", "one at a time 1x6: answers identical (of 6 turns)")].value == 6


def test_turn_1_is_held_to_its_p95_too():
    """Four agents' first turns: kvbranch's median beats upstream's while its slowest one is
    1.67x upstream's slowest, so the p50 target is met and the p95 one (the slowest of four,
    nearest rank) is not."""

    def first_turns(config: str, seconds: list[float]) -> dict:
        res = run(config, 1.5, {1: 0.0}, SAME)
        res["turns"] = [
            {"conversation": f"c{i}", "branch": "main", "turn": 1, "ttft_s": s, "content": "a"}
            for i, s in enumerate(seconds)
        ]
        return res

    results = [
        first_turns(UPSTREAM, [2.0, 2.0, 2.0, 3.0]),
        first_turns("pd-kvbranch", [1, 1, 1, 5]),
    ]
    recs = {(r.config, r.metric): r for r in records_of(results, args([1.5]), ())}
    at = f"pd-kvbranch/{UPSTREAM}", "one at a time 1x6, 1.5 GiB: "
    p50, p95 = recs[(at[0], at[1] + "p50 TTFT turn 1")], recs[(at[0], at[1] + "p95 TTFT turn 1")]
    assert p50.value == 0.5 and p50.met is True
    assert abs(p95.value - 5 / 3) < 1e-9 and p95.met is False and p95.target == "<= 1.2x"
