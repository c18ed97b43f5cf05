"""The GPU copy-timing script must keep working while no CUDA machine is at hand: its dry run
executes the same timing and link-limit code on CPU tensors through the real HostKVPool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "benchmarks" / "cuda_copy_check.py"


def test_dry_run_reports_copies_against_the_link_limit() -> None:
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--quick", "--layers", "2", "--link-mib", "8"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    report = json.loads(out.stdout)
    assert report["device"].startswith("cpu")
    assert set(report["checks"].values()) == {"skipped (needs CUDA)"}
    assert report["link"]["h2d_GBps"] > 0 and report["link"]["d2h_GBps"] > 0
    rows = report["timings"]
    assert {(r["layout"], r["direction"]) for r in rows} == {
        (layout, d) for layout in ("blocks_first", "kv_first") for d in ("save", "load")
    }
    assert all(r["GBps"] > 0 and r["of_link"] > 0 for r in rows)
