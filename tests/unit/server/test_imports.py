"""No import cycles anywhere in ``server/`` (issue 15): every import counts — at module level,
inside functions, and under ``TYPE_CHECKING`` — so a cycle cannot hide behind a lazy import.

The graph is read from the source (``ast``), not by importing: the test needs no vLLM and
checks modules that only load inside the engine.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
PACKAGE = "server"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``server`` modules ``name`` imports (an imported name that is a submodule counts as
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
    pkg = tmp_path / PACKAGE
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


def test_the_graph_has_the_known_edges():
    graph = import_graph()
    assert "server.plugin.cluster_gate" in graph["server.plugin.guard"]
    assert "server.settings" in graph["server.cli"]


def test_layers_import_downwards_only():
    """The plugin reads the launcher's settings, not the launcher; the router builds its errors,
    tenants and stream rewrites without the plugin (or vLLM's engine); the cache-hint dialects
    both of them call import nothing of the server but themselves."""
    graph = import_graph()
    for name, imports in graph.items():
        if name.startswith("server.plugin"):
            assert "server.cli" not in imports, name
        if name.startswith("server.router"):
            assert not {m for m in imports if m.startswith("server.plugin")}, name
        if name.startswith("server.dialects"):  # pure: the router and the plugin share it
            assert all(m.startswith("server.dialects") for m in imports), name


def test_no_import_cycles_in_server():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
