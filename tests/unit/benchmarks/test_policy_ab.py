"""policy_ab's report: per-pass ratios on/off with an interval, and the throughput verdict in
three outcomes — met, not met, or not shown either way (pure logic on made-up passes)."""

from __future__ import annotations

import argparse

from benchmarks import reporting
from benchmarks.history import policy_ab

INFO = dict.fromkeys(
    ["cpu", "cores", "ram", "kernel", "python", "vllm", "torch", "transformers"], "x"
)
RAW = reporting.ROOT / "benchmarks/out/x.json"


def _records(scale: float) -> list[dict]:
    recs = []
    for conv in range(3):
        for step in range(3):
            recs.append(
                {
                    "conv": conv,
                    "step": step,
                    "ttft_s": scale * (2.0 if step == 0 else 0.5),
                    "completion_tokens": 8,
                    "answer": f"a{conv}{step}",
                    "load1": 1.0,
                }
            )
    return recs


def _passes(on_wall: list[float]) -> list[dict]:
    out = []
    for i, wall in enumerate(on_wall):
        row: dict = {"pass": i}
        for name, w in (("off", 10.0), ("on", wall)):
            recs = _records(w / 10.0)
            row[name] = {"records": recs, **policy_ab.pass_summary(recs, w)}
        out.append(row)
    return out


def _args() -> argparse.Namespace:
    return argparse.Namespace(
        passes=4,
        max_turns=2,
        concurrency=4,
        pause_s=0.5,
        max_tokens=8,
        kv_cache_gib=0.2,
        cpu_cores="0",
        reserved_cpus=1,
        off_env="",
        off_flags="",
    )


def _verdict(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("- throughput"))


def test_throughput_verdict_has_three_outcomes():
    convs = [{}] * 3
    same = policy_ab.report(_args(), convs, _passes([10.0] * 4), INFO, 1.0, {}, RAW)
    assert "**met**" in _verdict(same) and "median 1.000" in _verdict(same)
    slower = policy_ab.report(_args(), convs, _passes([11.0, 11.5, 11.2, 11.8]), INFO, 1.0, {}, RAW)
    assert "**not met**" in _verdict(slower)
    mixed = policy_ab.report(_args(), convs, _passes([9.0, 11.5, 9.5, 11.0]), INFO, 1.0, {}, RAW)
    assert "**not shown either way**" in _verdict(mixed)
    assert "Answers identical on and off: 36/36." in same


def test_the_report_says_what_off_is():
    args = _args()
    assert policy_ab.off_label(args) == "vLLM scheduling"
    args.off_flags = "--cold-prefill-chunk 512"
    assert policy_ab.off_label(args) == "the defaults with `--cold-prefill-chunk 512`"
    args.off_env = "KVBRANCH_BACKFILL=0"
    assert "KVBRANCH_BACKFILL=0" in policy_ab.off_label(args)


def test_engine_work_per_pass_from_the_step_trace(tmp_path):
    """--step-trace: each pass's engine totals come from the steps that began inside its
    window, and the report puts them side by side."""
    import json

    passes = _passes([10.0, 10.0])
    for p in passes:
        p["off"]["window"] = (100.0 * p["pass"], 100.0 * p["pass"] + 10)
        p["on"]["window"] = (100.0 * p["pass"] + 50, 100.0 * p["pass"] + 60)
    for name, start, forward in (("off", 0.0, 0.5), ("on", 50.0, 0.6)):
        steps = tmp_path / name / "steps"
        steps.mkdir(parents=True)
        times = [start + 1.0, start + 2.0, start + 101.0]  # two steps in pass 0, one in pass 1
        sched = [
            {"t": t - 0.01, "prefill": 256, "decode": 0, "loads": 0, "saves": 0} for t in times
        ]
        worker = [
            {"t": t, "load0": t, "load1": t, "save0": t + forward, "save1": t + forward}
            for t in times
        ]
        (steps / "scheduler-1.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sched))
        (steps / "worker-2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in worker))
    policy_ab.add_engine_totals(passes, tmp_path)
    assert passes[0]["on"]["engine"]["steps"] == 2 and passes[1]["on"]["engine"]["steps"] == 1
    assert abs(passes[0]["off"]["engine"]["busy_s"] - 1.0) < 1e-9
    assert abs(passes[0]["off"]["engine"]["idle_s"] - 0.5) < 1e-9  # 1.5 -> 2.0
    text = policy_ab.report(_args(), [{}] * 3, passes, INFO, 1.0, {}, RAW)
    busy = next(line for line in text.splitlines() if line.startswith("| engine busy"))
    assert "| 1.200 |" in busy  # on/off: 0.6 s against 0.5 s of forward per step


def test_server_counters_are_read_by_name_and_source():
    page = (
        "# TYPE vllm:num_preemptions counter\n"
        'vllm:num_preemptions_total{engine="0",model_name="m"} 3.0\n'
        "# TYPE kvbranch_prompt_tokens counter\n"
        'kvbranch_prompt_tokens_total{source="device"} 100.0\n'
        'kvbranch_prompt_tokens_total{source="recomputed"} 42.0\n'
    )
    got = policy_ab.read_counters(page)
    assert got["preemptions (vLLM, all)"] == 3.0
    assert got["prompt tokens from device cache"] == 100.0
    assert got["prompt tokens recomputed"] == 42.0
    assert got["preemptions for warmer work"] == 0.0
