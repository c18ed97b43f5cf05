"""No import cycles anywhere in the tree (issues 15 and 25): one graph over every top-level
folder that holds Python (``sdk``, ``integrations``, ``server``, ``benchmarks``, ``examples``,
``tests``), so a cycle is caught within a layer and across layers alike. Every import counts —
at module level, inside functions, and under ``TYPE_CHECKING`` — so a cycle cannot hide behind
a lazy or a type-only import: two modules that need each other's types share a smaller module
below both instead (``sdk._driver``: what a session needs of its client).

The graph is read from the source (``ast``), not by importing: the test needs no vLLM and
checks modules that only load inside the engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def folders(root: Path) -> list[str]:
    """The top-level folders that hold Python (hidden ones, e.g. a venv, excluded)."""
    return sorted(
        p.name
        for p in root.iterdir()
        if p.is_dir() and not p.name.startswith((".", "_")) and any(p.rglob("*.py"))
    )


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for folder in folders(root):
        for path in sorted((root / folder).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ours ``name`` imports (an imported name that is a submodule counts as
    that submodule; anything else as the module it comes from)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".")
                anchor = anchor[: len(anchor) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    modules = _modules(root)
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a path ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_the_walker_sees_lazy_relative_and_type_only_imports(tmp_path):
    pkg = tmp_path / "server"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from server.sub import b\n"
    )
    (pkg / "sub" / "b.py").write_text("def f():\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("def g():\n    import server.a\n")
    graph = import_graph(tmp_path)
    assert graph["server.a"] == {"server.sub.b"}
    assert graph["server.sub.b"] == {"server.sub.c"}
    assert find_cycle(graph) == ["server.a", "server.sub.b", "server.sub.c", "server.a"]
    (pkg / "sub" / "c.py").write_text("")
    assert find_cycle(import_graph(tmp_path)) is None


def test_every_folder_with_python_is_in_the_graph():
    assert {"benchmarks", "examples", "integrations", "sdk", "server", "tests"} <= set(
        folders(ROOT)
    )
    graph = import_graph()
    assert "benchmarks.common" in graph["benchmarks.agent_workload"]  # a folder without __init__
    assert "sdk.contract" in graph["server.router.app"]  # across folders


def test_a_cycle_across_folders_is_found(tmp_path):
    for folder in ("lower", "upper"):
        (tmp_path / folder).mkdir()
    (tmp_path / "lower" / "a.py").write_text("def f():\n    from upper import b\n")
    (tmp_path / "upper" / "b.py").write_text("from lower.a import f\n")
    assert find_cycle(import_graph(tmp_path)) == ["lower.a", "upper.b", "lower.a"]


def test_on_the_tree_before_the_sdk_had_cycles(tmp_path):
    """What this test caught in ``sdk/`` (the layout before ``sdk._driver``, reduced): the
    session module imported both clients for its generic bases, the clients imported it lazily
    to open a session, and the two cores imported each other for their types."""
    sdk = tmp_path / "sdk"
    sdk.mkdir()
    (sdk / "__init__.py").write_text("")
    (sdk / "client.py").write_text("def session():\n    from sdk.session import Session\n")
    (sdk / "session.py").write_text("from sdk.client import KVBranchClient\n")
    (sdk / "_branch_core.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from sdk._session_core import SessionCore\n"
    )
    (sdk / "_session_core.py").write_text("from sdk._branch_core import BranchCore\n")
    graph = import_graph(tmp_path)
    assert find_cycle(graph) == ["sdk._branch_core", "sdk._session_core", "sdk._branch_core"]
    (sdk / "_branch_core.py").write_text("")
    assert find_cycle(import_graph(tmp_path)) == ["sdk.client", "sdk.session", "sdk.client"]


def test_no_import_cycles_anywhere():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
