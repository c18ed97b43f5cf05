"""policy_ab's report: per-pass ratios on/off with an interval, and the throughput verdict in
three outcomes — met, not met, or not shown either way (pure logic on made-up passes)."""

from __future__ import annotations

import argparse

from benchmarks import policy_ab, reporting

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
