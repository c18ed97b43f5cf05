"""Which benchmarks exist: every module or package directly in ``benchmarks/`` that defines the
benchmark interface (benchmarks/README.md, "Writing a benchmark").

Why discovery and not a hand-kept list: benchmarks are added by different people at the same
time (a package such as ``benchmarks/capacity/`` appears by being written); a list to edit would
be one more thing to forget. A module that fails to import is still listed, with its error, so
a broken benchmark is seen instead of silently missing.

The interface (checked by :func:`is_benchmark`)::

    NAME: str                                   # the word after ``python -m benchmarks``
    DESCRIPTION: str                            # one line, for ``python -m benchmarks --help``
    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> list[benchmarks.records.Record]
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parent
#: Modules of this folder that are library code, never benchmarks: not imported while listing
#: (importing them is harmless, but skipping them keeps ``--help`` quick).
LIBRARY = frozenset(
    {
        "__main__",
        "cli",
        "agent_report",
        "bfcl_traces",
        "common",
        "records",
        "registry",
        "report",
        "reporting",
        "soak_abuse",
        "soak_report",
        "textgen",
    }
)
#: Names the dispatcher itself answers to; a benchmark cannot take them.
RESERVED = frozenset({"report", "list"})


@dataclass(frozen=True)
class Entry:
    """One benchmark found: its module, or why it could not be imported."""

    name: str
    description: str
    module: ModuleType | None
    error: str = ""


def is_benchmark(module: ModuleType) -> bool:
    return (
        isinstance(getattr(module, "NAME", None), str)
        and isinstance(getattr(module, "DESCRIPTION", None), str)
        and callable(getattr(module, "add_arguments", None))
        and callable(getattr(module, "run", None))
    )


def discover(directory: Path = BENCH_DIR, package: str = "benchmarks") -> dict[str, Entry]:
    """Every benchmark in ``directory`` by name, sorted by name."""
    found: dict[str, Entry] = {}
    for info in pkgutil.iter_modules([str(directory)]):
        if info.name in LIBRARY or info.name.startswith("_"):
            continue
        try:
            module = importlib.import_module(f"{package}.{info.name}")
        except Exception as exc:  # noqa: BLE001 - listed with its error, not hidden
            found[info.name] = Entry(info.name, "", None, f"{type(exc).__name__}: {exc}")
            continue
        if not is_benchmark(module):
            continue
        name = module.NAME
        if name in RESERVED or name in found:
            raise ValueError(f"benchmark name {name!r} ({info.name}) is reserved or taken twice")
        found[name] = Entry(name, module.DESCRIPTION.strip().splitlines()[0], module)
    return dict(sorted(found.items()))
