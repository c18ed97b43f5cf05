"""The GPU copy-timing script must keep working while no CUDA machine is at hand: its dry run
executes the same timing and link-limit code on CPU tensors through the real HostKVPool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_dry_run_reports_copies_against_the_link_limit() -> None:
    argv = ["--no-results", "--dry-run", "--quick", "--layers", "2", "--link-mib", "8"]
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "cuda_copy_check", *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    printed, records = out.stdout.split("\n[record] ", 1)  # its JSON, then the run's records
    report = json.loads(printed)
    assert "copy checks passed (of 10; 10 skipped) = 0 checks" in records
    assert report["device"].startswith("cpu")
    assert set(report["checks"].values()) == {"skipped (needs CUDA)"}
    assert report["link"]["h2d_GBps"] > 0 and report["link"]["d2h_GBps"] > 0
    rows = report["timings"]
    assert {(r["layout"], r["direction"]) for r in rows} == {
        (layout, d) for layout in ("blocks_first", "kv_first") for d in ("save", "load")
    }
    assert all(r["GBps"] > 0 and r["of_link"] > 0 for r in rows)
