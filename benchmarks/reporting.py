"""How a benchmark run is written down: the machine and software it ran on, how busy the shared
machine was, the command, numbers in markdown tables, raw data as JSON and a section appended
to ``benchmarks/out/`` (the records of a run: :mod:`benchmarks.records`).

Kept apart from :mod:`benchmarks.common` (servers and requests) so that a benchmark's report
code reads only this module, and every benchmark writes its header the same way.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BENCH_DIR = ROOT / "benchmarks"
OUT_DIR = BENCH_DIR / "out"
PLOTS_DIR = BENCH_DIR / "plots"


# --- machine -------------------------------------------------------------------------------------
def _proc_value(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine_info() -> dict[str, str]:
    cpu = _proc_value("/proc/cpuinfo", "model name") or platform.processor() or "unknown"
    mem = _proc_value("/proc/meminfo", "MemTotal")
    ram = f"{int(mem.split()[0]) / (1 << 20):.1f} GiB" if mem else "unknown"
    probe = (
        "import json, vllm, torch, transformers; print(json.dumps({'vllm': vllm.__version__,"
        " 'torch': torch.__version__, 'transformers': transformers.__version__}))"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        versions = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001 - best effort
        versions = {}
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "ram": ram,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "vllm": versions.get("vllm", "?"),
        "torch": versions.get("torch", "?"),
        "transformers": versions.get("transformers", "?"),
    }


def machine_info_async() -> Future[dict[str, str]]:
    """:func:`machine_info` in a background thread (it imports vLLM in a subprocess: overlap it
    with the runs); call ``.result()`` on the returned future."""
    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(machine_info)
    pool.shutdown(wait=False)
    return future


def machine_md(info: dict[str, str]) -> str:
    return (
        f"- Machine: {info['cpu']}, {info['cores']} cores, {info['ram']} RAM, "
        f"Linux {info['kernel']}\n"
        f"- Software: Python {info['python']}, vLLM {info['vllm']}, torch {info['torch']}, "
        f"transformers {info['transformers']}\n"
    )


def machine_line(info: dict[str, str]) -> str:
    """The machine and software in one line, as every record carries it."""
    return (
        f"{info['cpu']}, {info['cores']} cores, {info['ram']} RAM, Linux {info['kernel']}; "
        f"Python {info['python']}, vLLM {info['vllm']}, torch {info['torch']}, "
        f"transformers {info['transformers']}"
    )


def load_md(loads: list[float]) -> str:
    """One line on how busy the (shared) machine was while measuring."""
    if not loads:
        return ""
    return (
        f"- Machine load (1-min load average at request starts, {os.cpu_count()} cores): "
        f"min {min(loads):.1f}, median {statistics.median(loads):.1f}, max {max(loads):.1f}"
        " — other developers' servers and tests share these cores, so absolute times are "
        "noisy; compare the configurations side by side"
    )


def conditions_md(
    loads: list[float], reserved_cpus: int | None, bindings: dict[str, str]
) -> list[str]:
    """How busy the machine was, and the core binding each configuration's engine got."""
    return [
        load_md(loads),
        f"- Engine CPU binding (VLLM_CPU_NUM_OF_RESERVED_CPU={reserved_cpus}): "
        + "; ".join(f"{name}: {omp}" for name, omp in bindings.items()),
    ]


def add_int_args(ap: argparse.ArgumentParser, defaults: dict[str, int]) -> None:
    """Plain integer options (``{"--layers": 28}`` adds ``--layers N``, default 28), in order."""
    for flag, default in defaults.items():
        ap.add_argument(flag, type=int, default=default)


def now_str() -> str:
    return _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def git_rev() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


#: Server switches a run's environment may carry, shown with its command (an allowlist: the
#: environment also holds secrets such as KVBRANCH_CLUSTER_SECRET).
REPORTED_ENV = ("KVBRANCH_ASYNC_SAVE", "KVBRANCH_BACKFILL", "KVBRANCH_PREFAULT")


def command_line() -> str:
    """The command as typed, with the ``KVBRANCH_*`` variables of its environment in front
    (they switch parts of the server off for A/B runs, docs/configuration.md)."""
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k in REPORTED_ENV]
    run = ["-m", "benchmarks"] if script.name == "__main__.py" else [str(script)]  # the entry
    return " ".join([*env, ".venv/bin/python", *run, *sys.argv[1:]])


def run_header(title: str, info: dict[str, str], elapsed_s: float) -> list[str]:
    """The first lines of every section: title and date, command, commit, machine."""
    return [
        f"## {title} — {now_str()}\n",
        f"- Command: `{command_line()}` (git {git_rev()}, {elapsed_s / 60:.1f} min)",
        machine_md(info).rstrip(),
    ]


# --- numbers -------------------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    vals = sorted(values)
    if len(vals) == 1:
        return vals[0]
    pos = (len(vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def bootstrap_median(values: list[float], rng: random.Random, n: int = 2000) -> tuple[float, float]:
    """A 95% bootstrap interval of the median of ``values``."""
    meds = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(n))
    return meds[int(0.025 * n)], meds[int(0.975 * n) - 1]


def ratio(a: float, b: float) -> str:
    if not b or a != a or b != b:
        return "n/a"
    return f"{a / b:.2f}x"


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# --- output --------------------------------------------------------------------------------------
def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend, or None (the plot is then skipped)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot (.venv/bin/pip install matplotlib)", flush=True)
        return None
    return plt


def save_plot(
    fig: Any, ax: Any, path: Path, xlabel: str, ylabel: str, title: str, dpi: int = 110
) -> None:
    """Label, grid, legend and write a one-axes figure, then free it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _jsonable(value: Any) -> Any:
    dump = getattr(value, "model_dump", None)  # pydantic models (the contract's)
    return dump() if callable(dump) else str(value)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=_jsonable))


def plot_path(name: str, no_results: bool) -> Path:
    """Where a run's plot goes: in ``benchmarks/plots/`` (committed, linked from the records:
    every plot in one folder), or under ``out/`` for a run that is not recorded
    (``--no-results``), so that a trial never replaces a recorded plot."""
    return (OUT_DIR if no_results else PLOTS_DIR) / name


def plot_ref(png: Path | None) -> tuple[str, ...]:
    """A record's ``plots`` entry for this plot: its path relative to ``benchmarks/`` when it is
    a recorded plot (under ``plots/``), nothing for a trial's plot or a plot not drawn."""
    if png is None or png.parent != PLOTS_DIR:
        return ()
    return (str(png.relative_to(BENCH_DIR)),)


def raw_path(name: str) -> Path:
    """``benchmarks/out/<name>-<time>.json`` (not committed)."""
    return OUT_DIR / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"


def publish(section: str, no_results: bool) -> Path:
    """Print a run's full Markdown report and keep it under ``out/`` (not committed): the
    numbers that count go into the run's records (:mod:`benchmarks.records`), and RESULTS.md
    is generated from those (``python -m benchmarks report``), never appended to."""
    print("\n" + section, flush=True)
    path = OUT_DIR / f"report-{time.strftime('%Y%m%d-%H%M%S')}{'-trial' if no_results else ''}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(section.rstrip() + "\n")
    print(f"full report kept in {path}", flush=True)
    return path


class Progress:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def __call__(self, msg: str) -> None:
        print(f"[{self.elapsed():7.1f}s] {msg}", flush=True)
