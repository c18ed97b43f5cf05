"""``python -m benchmarks``: see :mod:`benchmarks.cli` (kept apart so that tests and the
benchmark modules' own ``__main__`` blocks can import the dispatcher)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
