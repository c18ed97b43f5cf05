"""A realistic agentic workload against OpenAI-compatible endpoints: plain vLLM vs kvbranch.

    .venv/bin/python -m benchmarks agent_workload --quick     # ~10 minutes on 2 cores
    .venv/bin/python -m benchmarks agent_workload             # full profile (memory pressure)
    .venv/bin/python -m benchmarks agent_workload --replay benchmarks/out/<run>-workload.json

S concurrent agent sessions run T turns each: a shared system prompt with tool schemas, a tool
observation of about U tokens appended per turn, G generated tokens per turn (greedy), a tool
pause drawn from [pause-min, pause-max] after each turn, and at turn F each session forks into
B alternatives that continue to turn T concurrently. The workload is generated from --seed and
written out (JSON) so that it can be replayed with --replay.

Each configuration gets a fresh server (started, measured and stopped by this script), one
after the other, with the same device KV budget:

* ``plain``    — vLLM with prefix caching (``python -m server --no-connector``);
* ``kvbranch`` — the kvbranch connector: host store, session pins (auto-pin), the fork route at
  the fork turn, and the prefetch route called right after each response, during the pause.
* ``kvbranch-to-device`` (opt-in) — the same, but every prefetch runs in the engine
  (``to_device``) even when the host store holds the branch: what prefetch did before it
  learned to cost no engine step.
* ``pd-kvbranch`` (opt-in: ``--configs plain,kvbranch,pd-kvbranch``) — the same through
  ``python -m server --disagg``: a prefill and a decode instance (one core each) behind the
  kvbranch router, which carries the decode instance's KV back to prefill on the next turn.
* ``<config>:<vLLM flags>`` — any of these with vLLM flags of its own, e.g.
  ``kvbranch:--max-num-batched-tokens=512`` (scheduling knobs, side by side with the defaults);
  flags before a ``--`` there are the launcher's: ``kvbranch:--no-agent-priority --``.
* ``pd`` (opt-in) — upstream P/D: ``--disagg --no-connector --no-bidirectional`` (NIXL, no
  pull, no host store). ``--configs pd,pd-kvbranch --pd-hold-ttl-s 120`` is the "holds under
  pressure" case of issue 13: ratios are against the first configuration named.

Per configuration: TTFT p50/p95 per turn index, job completion time per session, prompt tokens
by source (device cache / host store / recomputed, from the server's accounting), output
tokens per second, peak summed RSS of the server's process group; ratios against plain vLLM.
Raw data and the workload go to benchmarks/out/; a TTFT-vs-turn plot to
benchmarks/plots/agent_workload_<profile>.png (``_pd.png`` for runs of P/D configurations only); a
report is printed and its records written (benchmarks/README.md).

The workload and its runner are :mod:`benchmarks.agent_sessions` (pd_turns' agents workload
runs them too); the summary, plot and report are in :mod:`benchmarks.agent_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import agent_report, cli, common, reporting  # noqa: E402
from benchmarks.agent_report import plot, report, summarize  # noqa: E402
from benchmarks.agent_sessions import (  # noqa: E402
    WORKLOAD_KEYS,
    Runner,
    base_config,
    build_workload,
    split_config,
)
from benchmarks.records import Record  # noqa: E402
from benchmarks.step_profile import StepProfiler  # noqa: E402

NAME = "agent_workload"
DESCRIPTION = (
    "concurrent forking agent sessions with tool pauses under device-memory pressure, plain vLLM "
    "vs kvbranch (and P/D)"
)
CONFIG_NAMES = ("plain", "kvbranch", "kvbranch-to-device", "pd", "pd-kvbranch")
# fmt: off
PROFILES = {
    # ~10 minutes on 2 cores; contexts together ~2x the device KV budget.
    "quick": dict(sessions=2, turns=6, obs_tokens=100, gen_tokens=16, system_tokens=400,
                  tools=4, pause_min=1.0, pause_max=3.0, fork_turn=4, branches=2,
                  stagger_s=2.0, kv_cache_gib=0.1, host_store_gib=2.0, max_model_len=2048),
    # Memory pressure: 4 sessions x 2 alternatives of ~3k tokens each vs ~3.4k device tokens.
    "full": dict(sessions=4, turns=10, obs_tokens=200, gen_tokens=32, system_tokens=500,
                 tools=6, pause_min=2.0, pause_max=6.0, fork_turn=5, branches=2,
                 stagger_s=5.0, kv_cache_gib=0.15, host_store_gib=2.0, max_model_len=3328),
}
# fmt: on


async def run_config(
    name: str, kvbranch: bool, args: argparse.Namespace, workload: dict, log: reporting.Progress
) -> dict:
    base, flags = split_config(name)
    # Flags before a literal "--" are the launcher's (e.g. --agent-priority), after it vLLM's;
    # without one they are all vLLM's.
    ours, vllm_flags = (
        (flags[: flags.index("--")], flags[flags.index("--") + 1 :])
        if ("--" in flags)
        else ([], flags)
    )
    extra = (
        ["--disagg", "--pd-hold-ttl-s", str(args.pd_hold_ttl_s)] if base.startswith("pd") else []
    )
    if base == "pd":
        extra.append("--no-bidirectional")  # upstream P/D (server_args adds --no-connector)
    pd = bool(extra)
    extra += ours
    if vllm_flags:
        extra += ["--", *vllm_flags]
    profiler = StepProfiler(args.profile_dir / name, args.py_spy) if args.profile_dir else None
    server = common.start_server(
        name,
        common.server_args(
            kvbranch, args.kv_cache_gib, args.host_store_gib, args.max_model_len, extra
        ),
        reserved_cpus=args.reserved_cpus,
        env=profiler.env() if profiler else None,
    )
    binding = common.omp_binding(server) if not pd else "P/D: prefill on core 0, decode on core 1"
    try:
        with common.MemorySampler(common.server_pgids(server)) as mem:
            limits = httpx.Limits(max_connections=200, max_keepalive_connections=50)
            async with httpx.AsyncClient(limits=limits) as client:
                warm = await common.cold_prefill_ttft(client, server.url, random.Random(99), 64)
                log(
                    f"[{name}] warm-up request {warm.ttft_s:.2f}s; running "
                    f"{len(workload['sessions'])} sessions"
                )
                runner = Runner(name, kvbranch, server.url, workload, args.gen_tokens, client, log)
                if profiler:
                    assert server.proc is not None
                    profiler.start(server.proc.pid)
                jcts, wall = await runner.run()
                if profiler:
                    profiler.finish(server.url)
                stats = await common.get_stats(client, server.url)
            mem.sample()
    finally:
        server.stop()
        log(f"[{name}] server stopped")
    return {
        "name": name,
        "kvbranch": kvbranch,
        "records": runner.records,
        "jct": jcts,
        "wall_s": wall,
        "stats": stats,
        "prefetches": runner.prefetches,
        "forks": runner.forks,
        "errors": runner.errors,
        "peak_rss_bytes": mem.peak_bytes,
        "peak_rss_procs": mem.peak_procs,
        "mem_method": mem.method,
        "omp": binding,
    }


def plot_name(profile: str, configs: list[str]) -> str:
    """The plot's file: one per profile for single instances, another for runs that are all
    P/D, so that a P/D run never replaces the plain/kvbranch plot the results cite."""
    pd_only = all(base_config(c).startswith("pd") for c in configs)
    return f"agent_workload_{profile}{'_pd' if pd_only else ''}.png"


#: Workload options (``None`` defaults: the profile's value): flag, type, help.
WORKLOAD_OPTIONS = [
    ("--sessions", int, "S concurrent sessions"),
    ("--turns", int, "T turns per session"),
    ("--obs-tokens", int, "U tool-observation tokens per turn"),
    ("--gen-tokens", int, "G generated tokens per turn"),
    ("--system-tokens", int, "shared system prompt tokens"),
    ("--tools", int, "tool schemas in the system prompt"),
    ("--pause-min", float, "shortest tool pause (s)"),
    ("--pause-max", float, "longest tool pause (s)"),
    ("--fork-turn", int, "turn at which sessions fork (0: never)"),
    ("--branches", int, "B alternatives at the fork"),
    ("--stagger-s", float, "sessions start within this many seconds"),
    ("--kv-cache-gib", float, "device KV budget of every config"),
    ("--host-store-gib", float, "kvbranch host store size"),
    ("--max-model-len", int, "the servers' --max-model-len"),
]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="the quick profile (~10 min, 2 cores)")
    ap.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=None,
        help="parameter profile (default full; --quick = --profile quick)",
    )
    for flag, kind, text in WORKLOAD_OPTIONS:
        ap.add_argument(flag, type=kind, help=text)
    ap.add_argument(
        "--pd-hold-ttl-s",
        type=float,
        default=30.0,
        help="P/D configurations: how long D holds a turn's blocks",
    )
    ap.add_argument("--configs", default="plain,kvbranch", help="run in this order")
    ap.add_argument("--replay", type=Path, help="replay a workload JSON written by a run")
    ap.add_argument(
        "--profile-dir",
        type=Path,
        help="write a per-step profile of every configuration here (benchmarks/step_profile.py)",
    )
    ap.add_argument("--py-spy", help="with --profile-dir: sample the servers with this py-spy")
    common.add_run_args(ap)


def finish_args(args: argparse.Namespace) -> None:
    """The profile's defaults where an option was not given, and the configuration list."""
    args.profile = args.profile or ("quick" if args.quick else "full")
    for key, value in PROFILES[args.profile].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in args.configs:
        if base_config(c) not in CONFIG_NAMES:
            raise SystemExit(f"unknown config {c!r} (known: {', '.join(CONFIG_NAMES)})")


def run(args: argparse.Namespace) -> list[Record]:
    finish_args(args)
    log = reporting.Progress()
    if args.replay:
        workload = json.loads(args.replay.read_text())
        for k, v in workload["params"].items():
            setattr(args, k, v)
        log(f"replaying {args.replay}")
    else:
        workload = build_workload({k: getattr(args, k) for k in WORKLOAD_KEYS})
    raw = reporting.raw_path(f"agent_workload-{args.profile}")
    wl_path = raw.with_name(raw.stem + "-workload.json")
    reporting.write_json(wl_path, workload)
    log(f"workload written to {wl_path}")
    info_job = reporting.machine_info_async()
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    for name in args.configs:
        log(f"=== configuration {name} ===")
        results[name] = asyncio.run(
            run_config(name, base_config(name) not in ("plain", "pd"), args, workload, log)
        )
    elapsed = time.monotonic() - t0
    info = info_job.result()
    sums = {n: summarize(r) for n, r in results.items()}
    reporting.write_json(
        raw,
        {
            "args": {k: str(v) for k, v in vars(args).items()},
            "machine": info,
            "results": results,
            "summary": sums,
        },
    )
    png: Path | None = reporting.plot_path(plot_name(args.profile, args.configs), args.no_results)
    p = workload["params"]
    if not plot(
        results,
        sums,
        png,
        f"TTFT vs turn: {p['sessions']} sessions, "
        f"{args.kv_cache_gib} GiB device KV ({args.profile})",
    ):
        png = None
    section = report(args, workload, results, sums, info, elapsed, png, raw, wl_path)
    reporting.publish(section, args.no_results)
    return agent_report.records_of(args, workload, results, sums, png)


if __name__ == "__main__":
    raise SystemExit(cli.main([NAME, *sys.argv[1:]]))
