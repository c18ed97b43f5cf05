"""The probes of the Kubernetes manifests (deploy/kubernetes/) answer without an API key on real
servers that have keys: a probe sends none, so a probe route behind the key would make every
pod of a keyed deployment unready (and, as liveness, restart it forever).

Instances: every instance probe path of every rendered overlay, on the package's keyed single
server (no engine start of its own); the kvbranch health route, which the probes avoid, is 401
there without a key. Routers: a real router started from the production overlay's rendered
args (API keys on; its index a real Redis; no instance behind it): its readiness route answers
503 (nothing to route to: not ready) and its liveness route 200, neither 401.
"""

from __future__ import annotations

import time

import httpx
import pytest

from sdk.contract import API_PREFIX
from server.launcher.cli import split_passthrough
from tests.kube_manifests import Obj, component, expand, ours, probe_paths, render
from tests.redis_server import RedisServer
from tests.server_process import ServerProcess

ROUTER_KEY = "kube-probe-router-key"
KVBRANCH_HEALTH = API_PREFIX + "/health"
#: A hang guard for the router's start (it imports no engine), not a timing check.
ROUTER_START_GUARD_S = 120.0


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    return render(tmp_path_factory.mktemp("kube"))


def test_instance_probes_answer_without_a_key(keyed_server, rendered) -> None:
    paths = {
        (kind, path)
        for objs in rendered.values()
        for dep, c in ours(objs)
        if component(dep) != "router"
        for kind, path in probe_paths(c).items()
    }
    assert paths, "no instance probe rendered"
    with httpx.Client(base_url=keyed_server.url, timeout=60) as client:
        for kind, path in sorted(paths):
            r = client.get(path)
            assert r.status_code == 200, f"{kind} {path}: {r.status_code} {r.text[:200]}"
        assert client.get(KVBRANCH_HEALTH).status_code == 401
        assert client.get(KVBRANCH_HEALTH, headers=keyed_server.headers()).status_code == 200


def _serving(router: ServerProcess) -> bool:
    assert router.proc is not None and router.proc.poll() is None, router.log_tail()
    try:
        httpx.get(router.url + "/metrics", timeout=5)
    except httpx.HTTPError:
        return False
    return True


def test_router_probes_answer_without_a_key(rendered) -> None:
    dep, c = next((d, c) for d, c in ours(rendered["production"]) if component(d) == "router")
    flags, passthrough = split_passthrough(expand(c, {"KVBRANCH_API_KEY": ROUTER_KEY}))
    assert f"--api-key={ROUTER_KEY}" in flags and not passthrough
    paths = probe_paths(c)
    with RedisServer() as redis:
        local = [a for a in flags if not a.startswith(("--host=", "--port=", "--index="))]
        router = ServerProcess(
            [*local, "--host=127.0.0.1", f"--index={redis.url}"],
            name="kube-router",
            env={"KVBRANCH_CLUSTER_SECRET": "kube-probe-secret"},
        )
        router.launch()
        try:
            deadline = time.monotonic() + ROUTER_START_GUARD_S
            while not _serving(router):
                assert time.monotonic() < deadline, f"router never served: {router.log_tail()}"
                time.sleep(0.2)
            with httpx.Client(base_url=router.url, timeout=60) as client:
                ready = client.get(paths["readinessProbe"])
                assert ready.status_code == 503, ready.text  # no instance: not ready, not 401
                assert client.get(paths["livenessProbe"]).status_code == 200
                assert client.get(KVBRANCH_HEALTH).status_code == 401
        finally:
            router.stop()
