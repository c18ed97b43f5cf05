"""HostKVPool's CUDA copy path: paged device KV <-> pinned host blocks, and the save fence
(the checks of :mod:`tests.gpu.cuda_copy_check`, which also runs them as one script on a GPU
machine). Marked ``gpu`` and skipped without CUDA, but for the dry run, which executes the same
timing and link-limit code on CPU tensors through the real HostKVPool everywhere.

Against the code before the fix, ``save_fence`` fails (the next step's write on the compute
stream lands in the host copy: nothing ordered it after the save) and ``load_after_zeroing``
fails (the load's stream did not wait for the step's block zeroing)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.gpu import cuda_copy_check as checks

ROOT = Path(__file__).resolve().parents[2]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("layout", checks.LAYOUTS)
@pytest.mark.parametrize("name", sorted(checks.CHECKS))
def test_cuda_copy_path(name: str, layout: str) -> None:
    checks.CHECKS[name](layout)


@pytest.mark.gpu
@needs_cuda
def test_timing_rows_are_sane() -> None:
    rows = checks.time_copies(
        "kv_first", layers=2, block_size=16, heads=2, head_dim=64, sizes=[1, 4], repeats=1
    )
    assert {(r["direction"], r["blocks"]) for r in rows} == {
        ("save", 1),
        ("load", 1),
        ("save", 4),
        ("load", 4),
    }
    assert all(r["total_ms"] > 0 and r["bytes"] > 0 for r in rows)


def test_dry_run_reports_copies_against_the_link_limit() -> None:
    """The script as a GPU machine runs it, here on CPU tensors: it must keep working while no
    CUDA machine is at hand."""
    argv = ["--dry-run", "--quick", "--layers", "2", "--link-mib", "8"]
    out = subprocess.run(
        [sys.executable, "-m", "tests.gpu.cuda_copy_check", *argv],
        cwd=ROOT,
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
