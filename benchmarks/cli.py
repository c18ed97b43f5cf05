"""``python -m benchmarks``: one entry for every benchmark, and ``report``.

Why one entry: each benchmark script used to parse its own options, find its own machine details
and write its own Markdown; here the dispatcher does the shared part once — the listing, the
options every run has (``--no-results``, ``--results-dir``), the machine, commit, date and
command stamped on every record, and the record file of the run — and a benchmark only adds its
options and measures (:mod:`benchmarks.registry` says what a benchmark module defines).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from benchmarks import records, registry, reporting

PROG = "python -m benchmarks"


def usage(entries: dict[str, registry.Entry]) -> str:
    """The listing of ``python -m benchmarks --help``: every benchmark, one line each."""
    width = max([len(n) for n in entries] + [len("report")])
    lines = [
        f"usage: {PROG} <benchmark> [options]   ({PROG} <benchmark> --help: its options)",
        f"       {PROG} report [--check]        (RESULTS.md and the README's figures)",
        "",
        "benchmarks:",
    ]
    for name, entry in entries.items():
        text = entry.description if not entry.error else f"(cannot import: {entry.error})"
        lines.append(f"  {name:<{width}}  {text}")
    lines += [
        "",
        "Every run writes one JSON record per result to benchmarks/results/ (--no-results: not)",
        "and prints its full report; benchmarks/README.md says how to read and add them.",
    ]
    return "\n".join(lines)


def add_shared_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every benchmark has, whatever it measures."""
    parser.add_argument(
        "--no-results",
        action="store_true",
        help="a trial: write no record file (plots and raw data go under benchmarks/out/)",
    )
    parser.add_argument(
        "--results-dir",
        type=Path,
        default=records.RESULTS_DIR,
        help="where the run's record file goes (default: benchmarks/results/)",
    )


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def command_of(argv: Sequence[str], entry_point: str = "benchmarks") -> str:
    """The command as typed (:func:`benchmarks.reporting.command_line`: the server switches of
    the environment in front, no secret), spelled through ``entry_point``."""
    env = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k in reporting.REPORTED_ENV]
    return " ".join([*env, f".venv/bin/python -m {entry_point}", *argv])


def parser_for(
    entry: registry.Entry, module: ModuleType, prog: str = ""
) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog or f"{PROG} {entry.name}",
        description=module.__doc__ or entry.description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_shared_arguments(parser)
    module.add_arguments(parser)
    return parser


def run_benchmark(
    entry: registry.Entry, module: ModuleType, argv: Sequence[str], entry_point: str = ""
) -> int:
    """Parse the benchmark's options, run it, stamp and write its records. ``entry_point``: the
    module the run was started by where it is not ``python -m benchmarks <name>``."""
    parser = parser_for(entry, module, f"python -m {entry_point}" if entry_point else "")
    args = parser.parse_args(list(argv))
    if getattr(args, "reserved_cpus", None) is not None and args.reserved_cpus < 0:
        args.reserved_cpus = None  # -1: vLLM's own reservation (benchmarks.common)
    machine = reporting.machine_info_async()
    found = list(module.run(args))
    ctx = records.RunContext(
        machine=reporting.machine_line(machine.result()),
        commit=reporting.git_rev(),
        date=utc_now(),
        command=command_of(argv, entry_point) if entry_point else command_of([entry.name, *argv]),
    )
    stamped = records.stamp(found, ctx)
    for r in stamped:
        verdict = "" if r.met is None else (" MET" if r.met else " NOT MET")
        print(f"[record] {r.config} {r.metric} = {r.value:g} {r.unit}{verdict}", flush=True)
    if args.no_results or not stamped:
        print(f"{len(stamped)} records, not written (--no-results or none)", flush=True)
        return 0
    path = records.write_run(stamped, args.results_dir)
    print(f"{len(stamped)} records written to {path}; `{PROG} report` rebuilds RESULTS.md")
    return 0


def run_study(module: ModuleType, argv: Sequence[str]) -> int:
    """A study kept in ``benchmarks/history/`` (not listed: it ran for one question), run by its
    own module, ``python -m benchmarks.history.<name>``, through the same options and records."""
    spelled = module.__spec__.name if module.__spec__ is not None else module.__name__
    entry = registry.Entry(module.NAME, module.DESCRIPTION, spelled)
    return run_benchmark(entry, module, argv, entry_point=spelled)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(usage(registry.discover()))
        return 0
    if argv[0] == "report":
        from benchmarks import report

        return report.main(argv[1:])
    entries = registry.discover()
    entry = entries.get(argv[0])
    if entry is None:
        print(f"unknown benchmark {argv[0]!r}\n\n{usage(entries)}", file=sys.stderr)
        return 2
    try:
        module = entry.load()
    except Exception as exc:  # noqa: BLE001 - say why, as the listing does
        print(f"benchmark {entry.name} cannot be imported: {exc!r}", file=sys.stderr)
        return 1
    return run_benchmark(entry, module, argv[1:])
