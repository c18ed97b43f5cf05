"""``python -m benchmarks.capacity``: the same as ``python -m benchmarks capacity``."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main(["capacity", *sys.argv[1:]]))
