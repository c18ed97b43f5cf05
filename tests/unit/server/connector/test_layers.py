"""The connector's layers, checked on the sources (``ast``: every import statement, also inside
functions and ``if TYPE_CHECKING:`` blocks, relative ones resolved).

* ``server/connector/core/`` is pure: no vLLM, and nothing from the other connector layers
  (engine adapters, control socket, P/D) — it imports the standard library, the SDK's
  contract and itself.
* the shims at the old module paths re-export only.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[4]
CONNECTOR = ROOT / "server" / "connector"


def module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> set[str]:
    package = module_of(path).rsplit(".", 1)[0] if path.name != "__init__.py" else module_of(path)
    return imports_in(path.read_text(), package)


def imports_in(source: str, package: str) -> set[str]:
    """Every module an import statement in ``source`` names (``from a import b``: ``a`` and
    ``a.b``, since ``b`` may be a submodule); relative ones resolved against ``package``."""
    tree = ast.parse(source)
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def test_imports_in_sees_function_level_type_checking_and_relative():
    found = imports_in(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from vllm.config import VllmConfig\n"
        "def f():\n    import vllm.v1.request\n"
        "from .tails import identity_of\n",
        "server.connector.core",
    )
    assert {"vllm.config", "vllm.v1.request", "server.connector.core.tails"} <= found


CORE_FILES = sorted((CONNECTOR / "core").glob("*.py"))


def test_core_layer_exists():
    names = {p.stem for p in CORE_FILES}
    assert {"planner", "block_index", "leases", "sessions", "branches", "tails"} <= names


@pytest.mark.parametrize("path", CORE_FILES, ids=lambda p: p.name)
def test_core_is_pure(path):
    allowed_roots = {"__future__", "sdk"}
    bad = []
    for module in sorted(imports_of(path)):
        root = module.split(".")[0]
        if module.startswith("server.connector.core") or root in allowed_roots:
            continue
        if root == "server" or root in {"vllm", "torch", "pydantic", "fastapi"}:
            bad.append(module)
        elif root not in __import__("sys").stdlib_module_names:
            bad.append(module)
    assert not bad, f"{path.relative_to(ROOT)} imports outside the pure layer: {bad}"


@pytest.mark.parametrize(
    ("shim", "name", "target"),
    [
        ("server.connector.connector", "KVBranchConnector", "server.connector.engine.connector"),
        ("server.connector.pd", "KVBranchPDConnector", "server.connector.pd.connector"),
        ("server.connector.pd", "VerifiedNixlConnector", "server.connector.pd.verified_nixl"),
        ("server.connector.transfer_auth", "seal", "server.connector.pd.transfer_auth"),
        (
            "server.connector.transfer_auth",
            "ENV_CLUSTER_SECRET",
            "server.connector.pd.transfer_auth",
        ),
    ],
)
def test_old_module_paths_still_resolve(shim, name, target):
    """Users' vLLM configs name ``server.connector.connector`` and ``server.connector.pd``
    (``kv_connector_module_path``); scripts import ``server.connector.transfer_auth``."""
    assert getattr(importlib.import_module(shim), name) is getattr(
        importlib.import_module(target), name
    )


def test_launcher_module_paths_resolve():
    from server.launcher import settings

    assert hasattr(importlib.import_module(settings.CONNECTOR_MODULE), "KVBranchConnector")
    assert hasattr(importlib.import_module(settings.PD_CONNECTOR_MODULE), "KVBranchPDConnector")


def test_connectors_registered_by_name():
    """MultiConnector rebuilds its children by registered name in the API server."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    import server.connector.pd.connector  # noqa: F401 - registers on import

    for name in ("KVBranchConnector", "VerifiedNixlConnector", "KVBranchPDConnector"):
        assert KVConnectorFactory.get_connector_class_by_name(name).__name__ == name


# --- vLLM is touched in one module ---------------------------------------------------------
COMPAT = CONNECTOR / "vllm_compat.py"
#: Modules that still import vLLM themselves, each with its reason. Empty: keep it so.
VLLM_ALLOWED: dict[str, str] = {}


@pytest.mark.parametrize(
    "path", sorted(p for p in CONNECTOR.rglob("*.py") if p != COMPAT), ids=lambda p: str(p)
)
def test_only_the_compat_module_imports_vllm(path):
    rel = str(path.relative_to(CONNECTOR))
    found = sorted(m for m in imports_of(path) if m.split(".")[0] == "vllm")
    if rel in VLLM_ALLOWED:
        return
    assert not found, (
        f"server/connector/{rel} imports {found}: import them from "
        "server.connector.vllm_compat (add them there), or list the module in VLLM_ALLOWED "
        "with a reason"
    )


def test_the_pin_is_pyprojects():
    import re

    from server.connector.vllm_compat import PINNED_VLLM

    pins = set(re.findall(r'"vllm(?:-cpu)?==([^"]+)"', (ROOT / "pyproject.toml").read_text()))
    assert pins == {PINNED_VLLM}


def test_another_vllm_is_refused_by_name():
    from server.connector.vllm_compat import PINNED_VLLM, VllmVersionError, check_version

    check_version(PINNED_VLLM)
    check_version(PINNED_VLLM + "+cpu")  # the CPU wheel's local label
    with pytest.raises(VllmVersionError) as e:
        check_version("0.33.1")
    assert f"vllm=={PINNED_VLLM}" in str(e.value) and "0.33.1" in str(e.value)


def test_nixl_progress_thread_off_restores():
    from server.connector import vllm_compat

    module = vllm_compat.nixl_base_worker
    original = module.nixl_agent_config
    with vllm_compat.nixl_progress_thread(None):
        if original is not None:
            assert module.nixl_agent_config is not original
    assert module.nixl_agent_config is original


def test_every_compat_name_resolves():
    """A vLLM upgrade that moved one of these fails here, not in an engine process."""
    from server.connector import vllm_compat

    for name in vllm_compat.__all__:
        assert getattr(vllm_compat, name) is not None, name
