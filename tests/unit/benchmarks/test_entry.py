"""``python -m benchmarks`` lists every benchmark of the folder (found by itself, also one whose
imports are missing here or that re-exports the interface from a package), and a run through
it writes one file of stamped records (pure logic: the benchmarks under test are written into a
temporary folder; the real listing runs the real entry in a subprocess, no server)."""

from __future__ import annotations

import argparse
import ast
import importlib
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks import cli, records, registry, reporting

ROOT = Path(__file__).resolve().parents[3]
BENCH = ROOT / "benchmarks"


def _defines_interface(path: Path) -> bool:
    """What a reader sees: a module (or a package's __init__) with the two functions at its
    top level (``def run(`` / ``def add_arguments(`` at the start of a line)."""
    text = path.read_text()
    return "\ndef run(" in text and "\ndef add_arguments(" in text


def _benchmark_files() -> set[str]:
    names = {p.stem for p in BENCH.glob("*.py") if _defines_interface(p)}
    names |= {p.parent.name for p in BENCH.glob("*/__init__.py") if _defines_interface(p)}
    return names


def test_the_listing_names_every_module_that_defines_the_interface():
    found = registry.discover()
    modules = {entry.module_name.split(".")[-1] for entry in found.values()}
    assert _benchmark_files() <= modules
    # the benchmarks of issue 38 item 3 by name: none lost on the way
    assert {
        "agent_workload",
        "pd_turns",
        "turn1_ab",
        "turn_ttft",
    } <= set(found)
    assert all(entry.description and "\n" not in entry.description for entry in found.values())


def _studies() -> list[str]:
    return sorted(p.stem for p in (BENCH / "history").glob("*.py") if _defines_interface(p))


def test_history_studies_are_not_listed_but_each_runs_by_its_module():
    listed = {entry.module_name for entry in registry.discover().values()}
    assert _studies() and not any(".history." in name for name in listed)
    for name in _studies():
        module = importlib.import_module(f"benchmarks.history.{name}")
        assert registry.is_benchmark(module), name
        entry = registry.Entry(module.NAME, module.DESCRIPTION, module.__name__)
        assert module.NAME in cli.parser_for(entry, module).format_help()
    out = subprocess.run(
        [sys.executable, "-m", f"benchmarks.history.{_studies()[0]}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert f"python -m benchmarks.history.{_studies()[0]}" in out and "--no-results" in out


def _imported(path: Path) -> set[str]:
    """The ``benchmarks.<name>`` modules a file imports (first component under benchmarks)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] != "benchmarks":
                continue
            if len(parts) > 1:
                names.add(parts[1])
            else:
                names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "benchmarks" and len(parts) > 1:
                    names.add(parts[1])
    return names


def test_benchmarks_share_only_the_shared_modules():
    """No benchmark imports another benchmark's module or a study of history/, and no shared
    module imports a benchmark: what two of them share lives in a shared module."""
    found = {e.module_name.split(".")[1] for e in registry.discover().values()}
    live = [p for p in BENCH.rglob("*.py") if "history" not in p.relative_to(BENCH).parts]
    for path in live:
        own = path.relative_to(BENCH).parts[0].removesuffix(".py")
        others = _imported(path) - {own}
        assert "history" not in others, path
        assert not others & found, f"{path} imports {sorted(others & found)}"


def test_the_real_entry_lists_them_with_their_descriptions():
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for name, entry in registry.discover().items():
        assert f"  {name} " in out and entry.description in out


def _write(folder: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))


MODULE = '''
    """A fake benchmark."""
    import argparse
    import not_installed_anywhere  # listing must not import it

    NAME = "fake"
    DESCRIPTION = (
        "first line"
        " of the description"
    )


    def add_arguments(parser: argparse.ArgumentParser) -> None:
        pass


    def run(args):
        return []
'''
PACKAGE = """
    from .impl import NAME, DESCRIPTION, add_arguments, run
"""
PACKAGE_IMPL = """
    NAME = "pkg"
    DESCRIPTION = "a package that re-exports"


    def add_arguments(parser):
        pass


    def run(args):
        return []
"""


@pytest.fixture
def fakes(tmp_path, monkeypatch):
    pkg = tmp_path / "fakebench"
    _write(
        pkg,
        {
            "__init__.py": "",
            "plain_module.py": MODULE,
            "exported/__init__.py": PACKAGE,
            "exported/impl.py": PACKAGE_IMPL,
            "library.py": "NAME = 'not a benchmark'\n",
            "broken/__init__.py": "NAME = 'x'\nraise RuntimeError('cannot start')\n",
            "helpers.py": "def run(args):\n    return []\n",
        },
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    _forget()
    yield pkg
    _forget()


def _forget() -> None:
    """Each test's fakes are its own: no module of an earlier test's folder is reused."""
    for name in [n for n in sys.modules if n == "fakebench" or n.startswith("fakebench.")]:
        del sys.modules[name]


def test_discovery_finds_modules_and_packages_and_names_a_broken_one(fakes):
    found = registry.discover(fakes, "fakebench")
    assert set(found) == {"fake", "pkg", "broken"}
    assert found["fake"].description == "first line of the description"
    assert found["fake"].module_name == "fakebench.plain_module"
    assert found["pkg"].description == "a package that re-exports"
    assert "RuntimeError: cannot start" in found["broken"].error
    assert "not_installed_anywhere" not in sys.modules
    with pytest.raises(ModuleNotFoundError):
        found["fake"].load()  # its own import fails when it is run, not when listed


def test_a_name_taken_twice_is_refused(fakes):
    _write(fakes, {"again.py": MODULE.replace("import not_installed_anywhere", "")})
    with pytest.raises(ValueError, match="taken"):
        registry.discover(fakes, "fakebench")


RUNNABLE = """
    import argparse
    from benchmarks.records import result

    NAME = "runnable"
    DESCRIPTION = "returns two records"


    def add_arguments(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--ratio", type=float, default=3.5)


    def run(args):
        return [
            result(NAME, "kvbranch", "p50 TTFT", 1.25, "s"),
            result(NAME, "plain/kvbranch", "p50 TTFT", args.ratio, "x", ">= 3.3x", args.ratio > 3),
        ]
"""


def test_a_run_writes_one_file_of_stamped_records(fakes, tmp_path, monkeypatch):
    _write(fakes, {"runnable.py": RUNNABLE})
    monkeypatch.setattr(reporting, "git_rev", lambda: "abc1234")
    info = {
        "cpu": "Test CPU",
        "cores": "2",
        "ram": "1.0 GiB",
        "kernel": "6.0",
        "python": "3.11",
        "vllm": "0.32.0",
        "torch": "2",
        "transformers": "5",
    }

    class Done:
        def result(self):
            return info

    monkeypatch.setattr(reporting, "machine_info_async", lambda: Done())
    entry = registry.discover(fakes, "fakebench")["runnable"]
    out = tmp_path / "results"
    argv = ["--ratio", "2.0", "--results-dir", str(out)]
    assert cli.run_benchmark(entry, entry.load(), argv) == 0
    (path,) = out.glob("*.json")
    got = records.loads(path.read_text())
    assert [(r.config, r.value, r.met) for r in got] == [
        ("kvbranch", 1.25, None),
        ("plain/kvbranch", 2.0, False),
    ]
    for r in got:
        assert r.commit == "abc1234" and r.machine.startswith("Test CPU, 2 cores")
        assert r.command == f".venv/bin/python -m benchmarks runnable {' '.join(argv)}"
        assert r.date.endswith(" UTC") and len(r.date) == len("2026-12-05 02:00 UTC")
    assert path.name.endswith("-runnable-abc1234.json")
    assert cli.run_benchmark(entry, entry.load(), [*argv, "--no-results"]) == 0
    assert len(list(out.glob("*.json"))) == 1  # a trial writes nothing


def test_shared_options_come_before_the_benchmarks_own(fakes):
    _write(fakes, {"runnable.py": RUNNABLE})
    entry = registry.discover(fakes, "fakebench")["runnable"]
    args = cli.parser_for(entry, entry.load()).parse_args(["--no-results"])
    assert isinstance(args, argparse.Namespace) and args.no_results and args.ratio == 3.5


def test_unknown_benchmark_is_refused_with_the_listing(capsys):
    assert cli.main(["no_such_benchmark"]) == 2
    assert "turn_ttft" in capsys.readouterr().err
