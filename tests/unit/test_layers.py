"""Each top-level folder is one layer, and the arrows point one way (issue 25): the client owns
the wire contract; the server implements it and never imports the clients; the integrations
build on the sdk alone. An agent app that installs the client gets no ``server`` package.

Read from the source (``ast``), so every import counts — module level, inside functions and
under ``TYPE_CHECKING`` alike — and no engine has to be importable.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
OURS = ("sdk", "server", "integrations", "benchmarks", "examples", "tests")

#: What each layer may import of ours (a package, or a module and what is inside it).
ALLOWED = {
    "sdk": ("sdk",),
    "integrations": ("sdk", "integrations"),
    "server": ("server", "sdk.contract"),
}


def _is_module(root: Path, name: str) -> bool:
    base = root.joinpath(*name.split("."))
    return base.with_suffix(".py").exists() or (base / "__init__.py").exists()


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Absolute module names ``path`` imports (relative imports stay within its own layer).
    ``from a import b`` counts as ``a.b`` when that is a module, else as ``a`` itself."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if _is_module(root, sub) else node.module)
    return found


def violations(layer: str, root: Path = ROOT) -> list[str]:
    out = []
    for path in sorted((root / layer).rglob("*.py")):
        for name in sorted(imports_of(path, root)):
            if name.split(".")[0] not in OURS:
                continue  # third-party
            if not any(name == a or name.startswith(a + ".") for a in ALLOWED[layer]):
                out.append(f"{path.relative_to(root)} imports {name}")
    return out


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_what_it_may(layer):
    assert violations(layer) == []


def test_the_contract_imports_nothing_of_ours_but_itself():
    """Dependency-light: the server imports the contract, not the client around it."""
    for path in sorted((ROOT / "sdk" / "contract").rglob("*.py")):
        ours = {n for n in imports_of(path) if n.split(".")[0] in OURS}
        assert all(n.startswith("sdk.contract") for n in ours), (path, ours)


def test_the_check_sees_a_server_import_in_the_sdk(tmp_path):
    (tmp_path / "sdk").mkdir()
    (tmp_path / "sdk" / "bad.py").write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from server.sse import DATA\n"
        "def f():\n    import server.contract\n"
    )
    assert violations("sdk", tmp_path) == [
        "sdk/bad.py imports server.contract",
        "sdk/bad.py imports server.sse",
    ]


def test_on_the_tree_before_the_move_the_sdk_imported_the_server(tmp_path):
    """What this test caught (commit 4b99d27's layout, reduced to two files)."""
    (tmp_path / "server" / "contract").mkdir(parents=True)
    (tmp_path / "server" / "__init__.py").write_text("")
    (tmp_path / "server" / "contract" / "__init__.py").write_text("")
    (tmp_path / "sdk").mkdir()
    (tmp_path / "sdk" / "_core.py").write_text("from server import contract\n")
    assert violations("sdk", tmp_path) == ["sdk/_core.py imports server.contract"]
