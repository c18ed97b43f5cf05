"""turn1_ab's report: ratios against the first configuration (plain vLLM, or upstream P/D with
--pd), the warm-request metrics with --warm, and a verdict per configuration and metric (pure
logic on made-up rounds)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import turn1_ab

INFO = dict.fromkeys(
    ["cpu", "cores", "ram", "kernel", "python", "vllm", "torch", "transformers"], "x"
)


def _rounds(names: list[str], factor: float, n: int = 20) -> list[dict]:
    rows = []
    for i in range(n):
        row: dict = {"round": i, "load1": 1.0}
        for k, name in enumerate(names):
            scale = factor if k else 1.0
            base = 1.0 + 0.001 * i
            row[name] = {
                "ttft_s": base * scale,
                "total_s": 2 * base * scale,
                "warm_ttft_s": 0.1 * base,
                "warm_total_s": 0.2 * base,
            }
        rows.append(row)
    return rows


def _args(**kw) -> argparse.Namespace:
    base = dict(
        rounds=20, tokens=800, max_tokens=4, cpu_cores="1", warm=False, pd=False, reserved_cpus=1
    )
    return argparse.Namespace(**{**base, **kw})


def _sums(names: list[str]) -> dict:
    return {n: dict.fromkeys(turn1_ab.SCRAPED, 0.0) for n in names}


def _report(args: argparse.Namespace, names: list[str], rounds: list[dict]) -> str:
    out = turn1_ab.reporting.ROOT / "benchmarks/out/x.json"
    return turn1_ab.report(args, rounds, _sums(names), INFO, 60.0, {}, out)


def _pd_rounds(names: list[str]) -> list[dict]:
    """Three rounds of P/D TTFTs, each with the router's phases (route, prefill, decode)."""
    rounds = _rounds(names, 1.5, n=3)
    for row in rounds:
        for name in names:
            row[name].update(route_ms=10.0, prefill_ms=600.0, decode_ms=40.0)
    return rounds


def test_ratios_are_against_the_first_configuration_with_warm_metrics():
    names = ["pd", "pd-kvbranch"]
    text = _report(_args(warm=True, pd=True), names, _rounds(names, 1.10))
    assert "| pd-kvbranch | ttft_s | 1.0" in text and "| 1.100 |" in text
    assert "**not met** — pd-kvbranch ttft_s: /pd median 1.100" in text
    assert "**met** — pd-kvbranch warm_ttft_s: /pd median 1.000" in text
    verdict = {line.split(":")[0]: line for line in text.splitlines() if "target <=" in line}
    assert verdict["- **met** — pd-kvbranch warm_ttft_s"].endswith("interval is at or under 1.03")
    assert verdict["- **not met** — pd-kvbranch ttft_s"].endswith("is not at or under 1.03")
    assert "P/D clusters, P on core 0 and D on core 1" in text


def test_without_warm_only_the_cold_request_is_judged():
    names = ["plain", "kvbranch"]
    text = _report(_args(), names, _rounds(names, 1.0))
    assert "warm_" not in text
    assert "**met** — kvbranch total_s: /plain median 1.000" in text
    assert "all engines on core(s) 1" in text


def test_pd_rounds_are_split_by_the_routers_phases():
    names = ["pd", "pd-kvbranch"]
    text = _report(_args(pd=True, session=True, crowd=1800), names, _pd_rounds(names))
    assert "each on a new session, each followed 0.15 s later by an unmeasured 1800-token" in text
    # the medians of each phase, and the rest of the TTFT after D's headers
    assert "| pd | 10.0 | 600.0 | 40.0 | 351.0 | 1001.0 |" in text
    assert "| pd-kvbranch | 10.0 | 600.0 | 40.0 | 851.5 | 1501.5 |" in text


def test_pd_records_carry_each_clusters_ttft_and_its_phases():
    names = ["pd", "pd-kvbranch"]
    records = turn1_ab.records_of(_args(pd=True), _pd_rounds(names), _sums(names))
    by = {(r.config, r.metric): r for r in records}
    kvb = by[("pd-kvbranch", "p50 TTFT")]
    assert kvb.value == pytest.approx(1.5015) and kvb.unit == "s"
    assert kvb.note == (
        "medians: route 10 ms, prefill 600 ms, decode 40 ms, D's headers to 1st token 851 ms"
    )
    assert ("pd-kvbranch/pd", "median ratio ttft_s") in by
