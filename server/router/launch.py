"""Starting the router, and ``--disagg``: a prefill instance, a decode instance and the router
on one machine (a demo and the tests' P/D cluster).

Stopping is bounded: on SIGTERM the router gives in-flight requests
``--shutdown-grace-s``, then cancels them (uvicorn alone would wait for a hanging stream
forever); ``--disagg`` then stops P and D, SIGKILLing what is left after vLLM's teardown
time (``server.launcher.process.TEARDOWN_S``). P and D stop on their own when the launcher dies
(:mod:`server.launcher.process`).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import socket
import sys
from typing import TYPE_CHECKING

from server.launcher.settings import LaunchError

if TYPE_CHECKING:
    from server.index import IndexStore
    from server.router.limits import HeaderDeadlineProtocol

#: Our flags that describe one instance and are not copied to the children of --disagg (nor,
#: with a few more, of --cluster: server.router.cluster).
_CLUSTER_FLAGS = {
    "--disagg": 0,
    "--cluster": 0,
    "--prefills": 1,
    "--decodes": 1,
    "--replicas": 1,
    "--routers": 1,
    "--port": 1,
    "--role": 1,
    "--cpu-cores": 1,
    "--nixl-port": 1,
    "--prefill": 1,
    "--decode": 1,
    "--replica": 1,
}


def router_ttl(args: argparse.Namespace) -> float:
    """How long the router offers D's holds: only while D surely still holds them."""
    from server.index.sessions import offered_hold_ttl_s

    return offered_hold_ttl_s(args.pd_hold_ttl_s)


def bind_listener(host: str, port: int) -> socket.socket:
    """The router's socket, listening before ``--disagg`` starts P and D.

    Their NIXL/UCX transports open listeners on ephemeral ports while they load, and one took
    the router's port in a benchmark run ("address already in use" two minutes after the port
    was chosen, once P and D were up). Listening first, the port stays ours (a socket that is
    only bound can still be shared through ``SO_REUSEADDR``); a client that connects early
    waits in the backlog until the router serves."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise LaunchError(f"--port {port}: cannot bind {host}:{port} ({exc.strerror})") from None
    return sock


def run_router(args: argparse.Namespace, sock: socket.socket | None = None) -> None:
    """Serve the router on ``sock`` (bound by :func:`bind_listener`) or on --host/--port."""
    import uvicorn

    from server.common.tenants import keys_of
    from server.router.app import Router, build_app
    from server.router.limits import TENANT_INFLIGHT

    index_url = getattr(args, "index", None) or "memory"
    shared = index_url != "memory"
    replicas = getattr(args, "replica", None) or []
    check_router_urls(args.prefill or [], args.decode or [], replicas, shared)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    store = open_index(index_url, router_ttl(args), getattr(args, "cluster_name", "default"))
    router = Router(
        args.prefill or [],
        args.decode or [],
        hold_ttl_s=router_ttl(args),
        api_key=args.api_key[0] if args.api_key else None,
        api_keys=keys_of(args),
        tenant_inflight=getattr(args, "router_tenant_inflight", None) or TENANT_INFLIGHT,
        index=store,
        policy=getattr(args, "router_policy", "cache-aware"),
        replica_urls=replicas,
    )
    instances = (
        f"replica={replicas}"
        if replicas
        else f"prefill={args.prefill or 'from the index'} decode={args.decode or 'from the index'}"
    )
    print(
        f"[kvbranch] router on http://{args.host}:{args.port} index={redact(index_url)} "
        f"{instances}",
        file=sys.stderr,
        flush=True,
    )
    config = uvicorn.Config(
        build_app(router),
        host=args.host,
        port=args.port,
        log_level="warning" if args.log_level == "info" else args.log_level,
        timeout_graceful_shutdown=args.shutdown_grace_s,
        # No limit_concurrency: uvicorn's counts idle connections too (2,100 idle sockets
        # made it refuse every real request); the edge bounds requests in flight instead,
        # and the protocol closes idle connections to make room (server.router.limits).
        http=router_protocol(args),
    )
    server = uvicorn.Server(config)
    server.run(sockets=[sock] if sock is not None else None)
    if not server.started:
        sys.exit(3)  # as uvicorn.run: the app did not start (e.g. the port is taken)


def check_router_urls(
    prefills: list[str], decodes: list[str], replicas: list[str], shared: bool
) -> None:
    """The router's seeds describe one topology: replicas (each serves a whole turn), or
    prefill and decode instances; without a shared index they are all it knows."""
    if replicas and (prefills or decodes):
        raise LaunchError(
            "--role router: give --replica URLs (aggregated replicas) or --prefill/--decode "
            "URLs (a P/D cluster), not both"
        )
    if not shared and not replicas and (not prefills or not decodes):
        raise LaunchError(
            "--role router needs at least one --prefill URL and one --decode URL, or "
            "--replica URLs (or --index redis://... to find its instances in the cluster index)"
        )


def router_protocol(args: argparse.Namespace) -> type[HeaderDeadlineProtocol]:
    """The router's client protocol with ``--header-timeout-s`` as its header deadline
    (:data:`server.router.limits.HEADER_TIMEOUT_S` when not given)."""
    from server.router.limits import HEADER_TIMEOUT_S, client_protocol

    given = getattr(args, "header_timeout_s", None)
    return client_protocol(HEADER_TIMEOUT_S if given is None else given)


def redact(url: str) -> str:
    """``url`` without a password (Redis URLs may carry one)."""
    if "@" not in url or "://" not in url:
        return url
    scheme, rest = url.split("://", 1)
    return f"{scheme}://***@{rest.rsplit('@', 1)[1]}"


def open_index(url: str, hold_ttl_s: float, cluster: str) -> IndexStore:
    """The index backend, checked before the router serves: one clear line when it cannot be
    reached or speaks another schema (a router that starts anyway would route on affinity
    alone, and nobody would know why pulls never happen)."""
    import asyncio

    from server.index import IndexUnavailable, open_store

    try:
        probe = open_store(url, hold_ttl_s=hold_ttl_s, cluster=cluster)
    except (ValueError, ImportError) as exc:
        raise LaunchError(f"--index: {exc}") from None

    async def check() -> None:  # its own client: connections belong to the loop that made them
        try:
            await probe.ping()
        finally:
            await probe.close()

    try:
        asyncio.run(check())
    except IndexUnavailable as exc:
        raise LaunchError(f"--index {redact(url)}: {exc}") from None
    return open_store(url, hold_ttl_s=hold_ttl_s, cluster=cluster)


def select_flags(argv: list[str], flags: dict[str, int], *, keep: bool) -> list[str]:
    """``argv`` split by ``flags`` (name → how many values follow it, none for ``--x=v``): only
    those flags with their values (``keep``), or everything else, in order."""
    out: list[str] = []
    values = 0  # values of the flag just seen still to come
    for arg in argv:
        if values:
            values -= 1
            matched = True
        else:
            name = arg.split("=", 1)[0]
            matched = name in flags
            if matched:
                values = flags[name] if "=" not in arg else 0
        if matched == keep:
            out.append(arg)
    return out


def strip_flags(argv: list[str], flags: dict[str, int]) -> list[str]:
    """``argv`` without ``flags`` and their values."""
    return select_flags(argv, flags, keep=False)


def instance_argv(ours: list[str]) -> list[str]:
    """The user's flags minus the cluster-level ones, for each child instance."""
    return strip_flags(ours, _CLUSTER_FLAGS)


def split_cores(n: int) -> tuple[str, str]:
    """P gets the first half of the cores, D the rest (one each on 2 cores)."""
    if n < 2:
        raise LaunchError("--disagg needs at least 2 CPU cores (one per instance)")
    half = n // 2
    p = "0" if half == 1 else f"0-{half - 1}"
    d = str(half) if n - half == 1 else f"{half}-{n - 1}"
    return p, d


def run_disagg(args: argparse.Namespace, ours: list[str], passthrough: list[str]) -> None:
    from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
    from server.launcher.process import TEARDOWN_S, ServerProcess, free_port

    base = instance_argv(ours)
    cores = None
    try:
        import torch

        cuda = torch.cuda.is_available()
    except Exception:  # noqa: BLE001
        cuda = False
    if not cuda:
        cores = split_cores(len(os.sched_getaffinity(0)))
    # P and D trust only transfer handles sealed with this secret
    # (server.connector.pd.transfer_auth).
    secret = os.environ.get(ENV_CLUSTER_SECRET) or secrets.token_hex(32)
    listener = bind_listener(args.host, args.port)
    children = []
    for role, core in (
        ("prefill", cores[0] if cores else None),
        ("decode", cores[1] if cores else None),
    ):
        argv = [*base, "--role", role, "--nixl-port", str(free_port())]
        if core is not None:
            argv += ["--cpu-cores", core]
        if passthrough:
            argv += ["--", *passthrough]
        children.append(
            ServerProcess(argv, name=role, ready_timeout=900, env={ENV_CLUSTER_SECRET: secret})
        )
    # uvicorn re-raises SIGTERM/SIGINT after its graceful shutdown; with the default action the
    # process would die before the ``finally`` below stops the instances it started.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        for child in children:
            child.launch()
            print(
                f"[kvbranch] {child.name} instance starting on {child.url} (log: {child.log_path})",
                file=sys.stderr,
                flush=True,
            )
        for child in children:
            child.wait_ready()
        args.prefill = [children[0].url]
        args.decode = [children[1].url]
        os.environ[ENV_CLUSTER_SECRET] = secret  # the router signs its legs with it
        run_router(args, listener)
    except RuntimeError as exc:
        raise LaunchError(str(exc).splitlines()[0]) from None
    finally:
        for child in children:  # both at once: the caller may not wait long for us
            child.terminate()
        # The router has given in-flight requests their grace; vLLM aborts what is left at
        # once, but its HTTP server was seen waiting on after that (the log's last line "shutting
        # down FastAPI HTTP server"): SIGKILL whatever is left of each process group.
        for child in children:
            child.stop(timeout=TEARDOWN_S)
        listener.close()
