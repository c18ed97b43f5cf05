"""A clean virtual environment with one extra of this project installed, as a user's ``pip
install "<clone>[extra]"`` does: what the install checks (client-only, server) run in."""

from __future__ import annotations

import shutil
import subprocess
import venv
from pathlib import Path

from server.launcher.process import ROOT


def install(where: Path, extra: str, *, timeout_s: float) -> Path:
    """A virtual environment in ``where/venv`` with ``.[extra]`` installed from a copy of the
    sources in ``where/src`` (a clone's own .venv or build folders must not leak in); its
    interpreter."""
    venv.create(where / "venv", with_pip=True)
    python = where / "venv" / "bin" / "python"
    source = where / "src" / "kvbranch"
    shutil.copytree(
        ROOT,
        source,
        ignore=shutil.ignore_patterns(
            ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", "benchmarks"
        ),
    )
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", f"{source}[{extra}]"],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return python
