"""``python -m benchmarks.history.plots`` on tiny recorded data: raw JSON in the shape turn_ttft.py,
agent_workload.py and pd_turns.py write it, and a RESULTS.md section; the three PNGs are
written, and the RESULTS.md tables are read as recorded (pure logic: no server)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from benchmarks.history import plots  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
PNGS = ("ttft_per_turn.png", "recomputed_tokens.png", "pd_comparison.png")
MACHINE = {"cpu": "Test CPU", "cores": "2"}


def _turn(turn: int, ttft: float, recomputed: int, **extra: object) -> dict:
    return {"turn": turn, "ttft_s": ttft, "recomputed_tokens": recomputed, **extra}


def _fixtures(folder: Path) -> list[Path]:
    turn_ttft = {
        "machine": MACHINE,
        "results": {
            name: {
                "turns": [
                    _turn(t, t * scale, t * rec, ref_ttft_s=0.5, new_tokens=160) for t in (1, 2, 3)
                ]
            }
            for name, scale, rec in (("plain", 2.0, 600), ("kvbranch", 0.5, 160))
        },
    }
    agent = {
        "args": {"kv_cache_gib": "0.1"},
        "machine": MACHINE,
        "results": {
            name: {
                "records": [
                    {**_turn(t, t * scale, 100 * t), "session": f"s{s}"}
                    for s in (0, 1)
                    for t in (1, 2)
                ]
            }
            for name, scale in (("plain", 3.0), ("kvbranch", 1.0))
        },
    }
    pd = {
        "args": {"interleave": True},
        "machine": MACHINE,
        "results": [
            {"name": name, "turns": [{**_turn(t, t * s, 200), "conversation": 0} for t in (1, 2)]}
            for name, s in (("pd", 2.0), ("pd-kvbranch", 1.0))
        ],
    }
    paths = []
    for name, data in (
        ("turn_ttft-20261201-120000.json", turn_ttft),
        ("agent_workload-quick-20261201-120000.json", agent),
        ("pd_turns-20261201-120000.json", pd),
    ):
        path = folder / name
        path.write_text(json.dumps(data))
        paths.append(path)
    return paths


def test_command_writes_the_pngs_from_json(tmp_path: Path) -> None:
    paths = _fixtures(tmp_path)
    out = tmp_path / "plots"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.history.plots", "--no-results", "--out-dir", str(out)]
        + ["--json", *map(str, paths)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    for name in PNGS:
        data = (out / name).read_bytes()
        assert data.startswith(b"\x89PNG") and len(data) > 5000, name
    for path in paths:
        assert path.name in proc.stdout  # every fixture made it into a figure


def test_runs_from_json(tmp_path: Path) -> None:
    ttft, agent, pd = (plots.run_from_json(p) for p in _fixtures(tmp_path))
    assert ttft and agent and pd
    assert ttft.kind == "turn_ttft" and ttft.ttft["kvbranch"] == {1: 0.5, 2: 1.0, 3: 1.5}
    assert ttft.refs["cold prefill of the new tokens only"] == {1: 0.5, 2: 0.5, 3: 0.5}
    assert agent.workload == "2 agents x 2 turns with a fork, 0.1 GiB device KV"
    assert agent.recomputed["plain"] == {1: 200, 2: 400}  # summed over the sessions
    assert pd.workload == "P/D, 1 conversations x 2 turns, interleaved"
    assert pd.recomputed_total == {"pd": 200, "pd-kvbranch": 200}  # turns >= 2


SECTION = """# results

## turn_ttft — 2026-12-01 14:31 UTC

- Machine: AMD EPYC, 2 cores, 23.5 GiB RAM, Linux 6
- Workload: 1 conversation, 2 turns, system prompt ~400 tokens

| turn | prompt tok | new tok (not seen before) | plain TTFT s | plain recomputed (cached) \
| kvb TTFT s | kvb device/host/recomputed | cold prefill of new tok s (median) |
|---|---|---|---|---|---|---|---|
| 1 | 605 | 605 | 3.442 | 605 (0) | 3.520 | 0/0/605 | 2.912 |
| 2 | 800 | 163 | 4.175 | 800 (0) | 1.517 | 0/636/164 | 0.820 |

## pd_turns — 2026-12-01 17:53 UTC

- 6 conversations x 2 turns, system prompt ~500 tokens; conversations one at a time

Median TTFT per turn (s):

| turn | pd | pd-kvbranch |
|---|---|---|
| 1 | 2.81 | 2.54 |
| 2 | 1.77 | 1.42 |

|  | pd | pd-kvbranch |
|---|---|---|
| mean TTFT turns >= 2 (s) | 1.78 | 1.47 |
| recomputed prompt tokens, turns >= 2 | 1625 | 1182 |
"""


def test_runs_from_results(tmp_path: Path) -> None:
    md = tmp_path / "RESULTS.md"
    md.write_text(SECTION)
    ttft, pd = plots.runs_from_results(md)
    assert ttft.source == "RESULTS.md § turn_ttft — 2026-12-01 14:31 UTC"
    assert ttft.machine == "AMD EPYC, 2 cores"
    assert ttft.ttft == {"plain": {1: 3.442, 2: 4.175}, "kvbranch": {1: 3.52, 2: 1.517}}
    assert ttft.recomputed == {"plain": {1: 605, 2: 800}, "kvbranch": {1: 605, 2: 164}}
    assert ttft.refs["cold prefill of the new tokens only"] == {1: 2.912, 2: 0.82}
    assert pd.workload == "P/D, 6 conversations x 2 turns, one at a time"
    assert pd.ttft["pd-kvbranch"] == {1: 2.54, 2: 1.42}
    assert pd.recomputed_total == {"pd": 1625, "pd-kvbranch": 1182}
    out = tmp_path / "plots"
    assert plots.main(["--json", "--results", str(md), "--out-dir", str(out)]) == 0
    assert all((out / name).stat().st_size > 5000 for name in PNGS)
