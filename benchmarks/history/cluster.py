"""The cluster the cluster studies start (:mod:`benchmarks.history.cluster_agents`,
:mod:`benchmarks.history.soak`): P and D instances (or aggregated replicas) on one index and
routers, with their own cluster secret."""

from __future__ import annotations

import argparse

from server.launcher.process import ServerProcess, free_port

#: The cluster secret of a study's own cluster (routers sign with it, instances check it).
SECRET = "cluster-bench-" + "0" * 50


def instance(role: str, core: str, index: str, args: argparse.Namespace) -> ServerProcess:
    """A P or D instance of a study's cluster on ``index`` (``--kv-cache-gib``,
    ``--host-store-gib``, ``--max-model-len`` from ``args``), built the way every P/D fixture of
    the tests builds one (:func:`tests.integration.helpers.pd_instance`)."""
    from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
    from tests.integration.helpers import pd_instance

    sizes = ["--kv-cache-gib", str(args.kv_cache_gib), "--host-store-gib", str(args.host_store_gib)]
    argv = [*sizes, "--max-model-len", str(args.max_model_len), "--index", index]
    env = {ENV_CLUSTER_SECRET: SECRET, "PYTHONHASHSEED": "0"}
    inst = pd_instance(argv, role, core, name=f"cb-{role}", env=env)
    inst.ready_timeout = 1200  # shared machines: see common.start_server
    return inst


def replica(core: str, index: str, args: argparse.Namespace) -> ServerProcess:
    """An aggregated replica of a study's cluster on ``index`` (``--role single``, sized from
    ``args`` as :func:`instance` sizes P and D), on ``core`` and a NIXL port of its own: what
    ``python -m server --cluster --replicas N`` starts for each replica."""
    from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET

    sizes = ["--kv-cache-gib", str(args.kv_cache_gib), "--host-store-gib", str(args.host_store_gib)]
    argv = [*sizes, "--max-model-len", str(args.max_model_len), "--index", index]
    argv += ["--role", "single", "--cpu-cores", core, "--nixl-port", str(free_port())]
    env = {ENV_CLUSTER_SECRET: SECRET, "PYTHONHASHSEED": "0"}
    return ServerProcess(argv, name="cb-replica", ready_timeout=1200, env=env)


def router(argv: list[str]) -> ServerProcess:
    """A router of a study's cluster (its index and flags in ``argv``)."""
    from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET

    env = {ENV_CLUSTER_SECRET: SECRET}
    return ServerProcess(["--role", "router", *argv], name="cb-router", ready_timeout=120, env=env)
