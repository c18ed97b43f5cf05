"""Which benchmarks exist: every module or package directly in ``benchmarks/`` that defines the
benchmark interface (benchmarks/README.md, "Writing a benchmark").

Why discovery and not a hand-kept list: benchmarks are added by different people at the same
time (a package such as ``benchmarks/capacity/`` appears by being written); a list to edit would
be one more thing to forget.

Why read the source first: listing imports nothing when a module spells its ``NAME`` and
``DESCRIPTION`` as literals beside ``def add_arguments`` and ``def run`` (the usual case), so
``--help`` stays quick and a benchmark whose imports are missing on this machine (torch with
CUDA, httpx-sse) is still listed. A module or package that defines them some other way (a
re-export) is imported to check; if that import fails it is listed with its error, not hidden.

The interface::

    NAME: str                                   # the word after ``python -m benchmarks``
    DESCRIPTION: str                            # one line, for ``python -m benchmarks --help``
    def add_arguments(parser: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> list[benchmarks.records.Record]
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

BENCH_DIR = Path(__file__).resolve().parent
#: Modules of this folder that are library code, never benchmarks (never read while listing);
#: ``history``: studies that ran once, kept with the records they wrote (history/README.md).
LIBRARY = frozenset(
    {
        "__main__",
        "history",
        "agent_report",
        "bfcl_traces",
        "cli",
        "common",
        "records",
        "registry",
        "report",
        "reporting",
        "textgen",
    }
)
#: Names the dispatcher itself answers to; a benchmark cannot take them.
RESERVED = frozenset({"report", "list"})
FUNCTIONS = ("add_arguments", "run")


@dataclass(frozen=True)
class Entry:
    """One benchmark found: its name and description, the module to import to run it, or why
    it could not be imported."""

    name: str
    description: str
    module_name: str
    error: str = ""

    def load(self) -> ModuleType:
        """The benchmark's module (imported now); ImportError and the like propagate."""
        module = importlib.import_module(self.module_name)
        if not is_benchmark(module):
            raise ImportError(f"{self.module_name} does not define {', '.join(FUNCTIONS)}")
        return module


def is_benchmark(module: ModuleType) -> bool:
    return (
        isinstance(getattr(module, "NAME", None), str)
        and isinstance(getattr(module, "DESCRIPTION", None), str)
        and all(callable(getattr(module, f, None)) for f in FUNCTIONS)
    )


def read_interface(source: str) -> tuple[str, str] | None:
    """``(NAME, DESCRIPTION)`` where the source defines both as literals and both functions at
    its top level, else None."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    values: dict[str, object] = {}
    functions: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name) and target.id in ("NAME", "DESCRIPTION"):
                try:
                    values[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    continue
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            functions.add(node.name)
    name, description = values.get("NAME"), values.get("DESCRIPTION")
    if isinstance(name, str) and isinstance(description, str) and set(FUNCTIONS) <= functions:
        return name, description
    return None


def _source(directory: Path, name: str, ispkg: bool) -> str:
    path = directory / name / "__init__.py" if ispkg else directory / f"{name}.py"
    try:
        return path.read_text()
    except OSError:
        return ""


def discover(directory: Path = BENCH_DIR, package: str = "benchmarks") -> dict[str, Entry]:
    """Every benchmark in ``directory`` by name, sorted by name."""
    found: dict[str, Entry] = {}
    for info in pkgutil.iter_modules([str(directory)]):
        if info.name in LIBRARY or info.name.startswith("_"):
            continue
        module_name = f"{package}.{info.name}"
        source = _source(directory, info.name, info.ispkg)
        static = read_interface(source)
        if static is not None:
            entry = Entry(static[0], static[1], module_name)
        elif info.ispkg or "NAME" in source:  # defined some other way: import to check
            try:
                module = importlib.import_module(module_name)
            except Exception as exc:  # noqa: BLE001 - listed with its error, not hidden
                entry = Entry(info.name, "", module_name, f"{type(exc).__name__}: {exc}")
            else:
                if not is_benchmark(module):
                    continue
                entry = Entry(module.NAME, module.DESCRIPTION, module_name)
        else:
            continue
        if entry.name in RESERVED or entry.name in found:
            raise ValueError(f"benchmark name {entry.name!r} ({module_name}) reserved or taken")
        found[entry.name] = _one_line(entry)
    return dict(sorted(found.items()))


def _one_line(entry: Entry) -> Entry:
    """The description's first line only (the listing is one line per benchmark)."""
    lines = entry.description.strip().splitlines()
    return Entry(entry.name, lines[0] if lines else "", entry.module_name, entry.error)
