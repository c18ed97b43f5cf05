"""benchmarks/step_profile.py joins the scheduler's and the worker's step lines;
benchmarks/history/step_breakdown.py sums a profile folder."""

from __future__ import annotations

import json

from benchmarks.history.policy_ab import window_totals
from benchmarks.history.step_breakdown import markdown, step_breakdown
from benchmarks.pd_turns import turn_order
from benchmarks.step_profile import (
    metric_key,
    paired_steps,
    request_breakdown,
    request_table,
    sum_samples,
)


def write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_three_steps(tmp_path):
    steps = tmp_path / "steps"
    steps.mkdir()
    write(
        steps / "scheduler-1.jsonl",
        [
            {"t": 0.0, "build_s": 0.001, "prefill": 100, "decode": 1, "loads": 2, "saves": 1},
            {
                "t": 1.0,
                "build_s": 0.001,
                "prefill": 0,
                "decode": 2,
                "loads": 0,
                "saves": 0,
                "hook_s": {"match": 0.002},
            },
            {"t": 3.0, "build_s": 0.001, "prefill": 0, "decode": 1, "loads": 0, "saves": 0},
        ],
    )
    write(
        steps / "worker-2.jsonl",
        [  # sync load before the forward; loads after it; idle gap before the third step
            {"t": 0.01, "load0": 0.01, "load1": 0.05, "save0": 0.85, "save1": 0.9},
            {"t": 1.01, "load0": 1.2, "load1": 1.2, "save0": 1.2, "save1": 1.21},
            {"t": 3.01, "load0": 3.1, "load1": 3.1, "save0": 3.1, "save1": 3.1},
        ],
    )


def test_breakdown_splits_forward_copies_gaps_and_idle(tmp_path):
    write_three_steps(tmp_path)
    out = step_breakdown(tmp_path)
    assert out is not None
    assert out["steps"] == 3
    assert abs(out["prefill_step_forward_s"] - 0.8) < 1e-9
    assert abs(out["decode_only_forward_s"] - (0.19 + 0.09)) < 1e-9
    assert abs(out["load_s"] - 0.04) < 1e-9
    assert abs(out["save_s"] - (0.05 + 0.01)) < 1e-9
    assert out["prefill_tokens"] == 100 and out["decode_tokens"] == 4
    assert abs(out["idle_s"] - 1.8) < 1e-9  # 1.21 -> 3.01
    assert abs(out["between_steps_s"] - 0.11) < 1e-9  # 0.9 -> 1.01
    assert "forward, steps with prefill" in markdown("kvbranch", tmp_path)


def test_window_totals_count_only_the_steps_that_began_inside(tmp_path):
    write_three_steps(tmp_path)
    pairs = paired_steps(tmp_path)
    whole = window_totals(pairs, 0.0, 10.0)
    assert whole["steps"] == 3
    assert abs(whole["busy_s"] - (0.89 + 0.2 + 0.09)) < 1e-9  # forward and copies
    assert abs(whole["prefill_forward_s"] - 0.8) < 1e-9
    assert abs(whole["decode_forward_s"] - (0.19 + 0.09)) < 1e-9
    assert whole["prefill_tokens"] == 100 and whole["decode_tokens"] == 4
    assert abs(whole["idle_s"] - 1.8) < 1e-9
    first_two = window_totals(pairs, 0.0, 2.0)
    assert first_two["steps"] == 2 and first_two["idle_s"] == 0.0
    assert window_totals(pairs, 5.0, 6.0)["steps"] == 0


def test_no_trace_is_no_breakdown(tmp_path):
    assert step_breakdown(tmp_path) is None


def test_turn_order_interleaves_conversations():
    assert turn_order(2, 2, interleave=False) == [(0, 1), (0, 2), (1, 1), (1, 2)]
    assert turn_order(2, 2, interleave=True) == [(0, 1), (1, 1), (0, 2), (1, 2)]


def test_request_breakdown_splits_a_ttft_around_its_prefill_step(tmp_path):
    steps = tmp_path / "steps"
    steps.mkdir()
    write(
        steps / "scheduler-1.jsonl",
        [  # an earlier decode step, then the request's prefill (4 blocks loaded)
            {"t": 9.9, "build_s": 0.001, "prefill": 0, "decode": 1, "loads": 0, "saves": 0},
            {"t": 10.1, "build_s": 0.001, "prefill": 160, "decode": 0, "loads": 4, "saves": 2},
        ],
    )
    write(
        steps / "worker-2.jsonl",
        [
            {"t": 9.95, "load0": 9.95, "load1": 9.95, "save0": 10.0, "save1": 10.0},
            {"t": 10.12, "load0": 10.12, "load1": 10.14, "save0": 10.84, "save1": 10.85},
        ],
    )
    rows = request_breakdown(tmp_path, [("turn 2", 10.0, 0.9), ("lost", 20.0, 1.0)])
    assert len(rows) == 1  # no prefill step inside the second one's TTFT
    (row,) = rows
    assert row["label"] == "turn 2" and row["prefill_tokens"] == 160 and row["load_blocks"] == 4
    assert abs(row["before_s"] - 0.12) < 1e-9
    assert abs(row["load_s"] - 0.02) < 1e-9
    assert abs(row["forward_s"] - 0.70) < 1e-9
    assert abs(row["save_s"] - 0.01) < 1e-9
    assert abs(row["after_s"] - 0.05) < 1e-9
    assert "| turn 2 | 900 | 160 | 4 | 120 |" in request_table(rows)


def test_metrics_page_sums_histograms_and_counters_over_label_sets():
    page = (
        "# TYPE vllm:time_to_first_token_seconds histogram\n"
        'vllm:time_to_first_token_seconds_bucket{le="1.0",model_name="a"} 2.0\n'
        'vllm:time_to_first_token_seconds_count{model_name="a"} 2.0\n'
        'vllm:time_to_first_token_seconds_sum{model_name="a"} 1.5\n'
        'vllm:time_to_first_token_seconds_count{model_name="b"} 1.0\n'
        'vllm:time_to_first_token_seconds_sum{model_name="b"} 0.5\n'
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{engine="0"} 3.0\n'
        'vllm:num_preemptions_created{engine="0"} 1.7e9\n'
        "# TYPE other counter\n"
        "other_total 9.0\n"
    )
    got = sum_samples(page, metric_key)
    assert got == {
        ("vllm:time_to_first_token_seconds", "count"): 3.0,
        ("vllm:time_to_first_token_seconds", "sum"): 2.0,
        "vllm:num_preemptions_total": 3.0,
    }
