"""HostKVPool's CUDA copy path (issue 13 item 3): paged device KV <-> pinned host blocks, and the
save fence. Skipped without CUDA; the checks live in ``benchmarks/cuda_copy_check.py`` (torch
only, also runnable by hand on a CUDA machine) so both run exactly the same code.

Against the code before the fix, ``save_fence`` fails (the next step's write on the compute
stream lands in the host copy: nothing ordered it after the save) and ``load_after_zeroing``
fails (the load's stream did not wait for the step's block zeroing)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

_SCRIPT = Path(__file__).resolve().parents[4] / "benchmarks" / "cuda_copy_check.py"
_spec = importlib.util.spec_from_file_location("cuda_copy_check", _SCRIPT)
assert _spec is not None and _spec.loader is not None
checks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(checks)


@pytest.mark.parametrize("layout", checks.LAYOUTS)
@pytest.mark.parametrize("name", sorted(checks.CHECKS))
def test_cuda_copy_path(name: str, layout: str) -> None:
    checks.CHECKS[name](layout)


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
