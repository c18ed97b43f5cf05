"""Capacity at an SLO: how many concurrent agents one instance carries before their resumed
turns get slow, kvbranch against plain vLLM, on a real trace set (issue 39 items 1-2).

    with_server_slot .venv/bin/python -m benchmarks capacity --trace bfcl      # the real sweep
    with_server_slot .venv/bin/python -m benchmarks capacity --quick --no-results  # a smoke

Why this number: on a saturated server a ratio of TTFTs is only the ratio of the work each
server does; the question a user asks is the one serving systems answer with goodput — how many
agents fit before their turns exceed a latency objective. That number grows with everything
kvbranch saves, saturated or not.

How, per configuration (one server at a time: one instance, the same core reservation and
device KV budget, ``common.start_server``; ``plain`` is vLLM with its prefix cache, ``kvbranch``
the connector with vLLM's own scheduling, ``kvbranch-sched`` with ``--sched-flags`` or
``kvbranch-sched:<its own flags>``: :func:`config_flags`):

1. **The SLO.** One agent replays ``--alone`` conversations one at a time; the median TTFT of
   their resumed turns is the reference, and the SLO is ``--slo-multiple`` times the first
   configuration's reference (bounding the p90 of resumed turns). Stated per machine, so the same
   command means the same on a GPU; printed with the result, with every configuration's own
   reference beside it.
2. **The sweep.** For each count of ``--agents`` in order, that many agents run at once
   (:mod:`benchmarks.capacity.replay`: closed loops, each through ``--per-agent`` conversations
   of its own, waiting each step's tool time), under a fresh ``cache_salt``; the count's p50 /
   p90 / p99 TTFT of resumed and cold turns, throughput and recomputed tokens are recorded. The
   sweep of a configuration stops after the first count whose p90 passes the SLO
   (:func:`benchmarks.capacity.sweep.should_stop`); its capacity is the largest count before it.
3. **Token identity.** The replay sends the trace's history, never the model's answers, so the
   same turn has the same inputs in every configuration; greedy answers are compared with
   plain vLLM's at every count both ran.

Trace sets (:mod:`benchmarks.traces`, licences in ``benchmarks/traces.md``): ``bfcl`` (BFCL v4
multi-turn agent traces, tool times from ``--tool-s`` / ``--tool-dist``, sessions through
``prompt_cache_key``), ``mooncake`` (Mooncake's production conversation trace: real think times
scaled by ``--time-scale``, no sessions — only the host tier can help).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import time
from typing import Any

from benchmarks import common, reporting
from benchmarks.capacity import sweep
from benchmarks.capacity.configs import config_env, config_flags, config_spec
from benchmarks.records import Record

NAME = "capacity"
DESCRIPTION = (
    "concurrent agents one instance carries at a p90 TTFT SLO, kvbranch vs plain vLLM, on real "
    "traces (BFCL, Mooncake)"
)
#: --quick: a smoke of the whole path in a few minutes, no number to quote.
QUICK = {"agents": "1,2", "per_agent": 1, "alone": 1, "max_turns": 2, "tool_s": 0.5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", choices=("bfcl", "mooncake"), default="bfcl")
    parser.add_argument(
        "--configs",
        default="kvbranch,plain",
        help="in this order; config+KEY=VALUE runs one with that environment variable",
    )
    parser.add_argument("--agents", default="1,2,4,6,8,10,12,16", help="counts, ascending")
    parser.add_argument("--per-agent", type=int, default=2, help="conversations per agent")
    parser.add_argument("--alone", type=int, default=3, help="conversations run alone (SLO)")
    parser.add_argument("--slo-multiple", type=float, default=4.0)
    parser.add_argument("--max-turns", type=int, default=3, help="turns kept per conversation")
    parser.add_argument("--max-tokens", type=int, default=8, help="output tokens per step (cap)")
    parser.add_argument("--skip", type=int, default=0, help="conversations of the set skipped")
    parser.add_argument("--max-chars", type=int, default=14000, help="bfcl: longest last step")
    parser.add_argument("--tool-s", type=float, default=2.0, help="bfcl: mean tool time (s)")
    parser.add_argument("--tool-dist", choices=("fixed", "exp"), default="fixed")
    parser.add_argument("--time-scale", type=float, default=0.02, help="mooncake: think times")
    parser.add_argument("--stagger-s", type=float, default=0.0, help="agent k starts k x this (s)")
    parser.add_argument("--block-tokens", type=int, default=32, help="mooncake: per 512 tokens")
    parser.add_argument("--sched-flags", default="--agent-priority --cold-prefill-chunk 256")
    parser.add_argument("--quick", action="store_true", help="a smoke: " + str(QUICK))
    parser.add_argument(
        "--interleave",
        type=int,
        default=0,
        metavar="PASSES",
        help="an A/B instead of a sweep: every --configs server up at once, PASSES interleaved "
        "passes at the first --agents count, each against the first (benchmarks.capacity."
        "interleave)",
    )
    common.add_server_args(parser, kv_cache_gib=0.4, max_model_len=4096)
    common.add_run_args(parser)


def agent_counts(text: str) -> list[int]:
    """``--agents``: ascending positive counts."""
    counts = [int(x) for x in text.split(",") if x.strip()]
    if not counts or counts != sorted(set(counts)) or counts[0] < 1:
        raise SystemExit(f"--agents: ascending positive counts, got {text!r}")
    return counts


def load_traces(args: argparse.Namespace, n: int) -> tuple[list[Any], str]:
    """The conversations and a one-line description of the workload with every scale."""
    from benchmarks import traces

    #: what every trace set's loader takes
    shared = {
        "max_turns": args.max_turns,
        "skip": args.skip,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
    }
    if args.trace == "bfcl":
        convs = traces.load(
            "bfcl",
            n,
            max_chars=args.max_chars,
            tool_s=args.tool_s,
            tool_dist=args.tool_dist,
            **shared,
        )
        scale = f"tool time {args.tool_dist} {args.tool_s:g} s (BFCL records none)"
    else:
        convs = traces.load(
            "mooncake",
            n,
            tokens_per_block=args.block_tokens,
            time_scale=args.time_scale,
            max_prompt_tokens=args.max_model_len - args.max_tokens,
            **shared,
        )
        scale = (
            f"the trace's think times x {args.time_scale:g}, {args.block_tokens} tokens per "
            f"512-token trace block, no sessions"
        )
    return convs, (
        f"{len(convs)} conversations of `{args.trace}`, up to {args.max_turns} turns, "
        f"{args.per_agent} per agent (reused with a fresh salt past the pool), {scale}; "
        f"max_tokens {args.max_tokens}, greedy; device KV {args.kv_cache_gib} GiB, host store "
        f"{args.host_store_gib} GiB; counts {args.agents}; "
        + (
            f"agent k starts k x {args.stagger_s:g} s in"
            if args.stagger_s
            else "agents start at once"
        )
    )


async def _config(name: str, args, convs, counts, slo: list[float], log) -> dict[str, Any]:
    """One configuration: its server, its alone reference (the SLO from the first), its
    sweep. ``slo`` is shared across configurations: empty until the first sets it."""
    from openai import AsyncOpenAI

    from benchmarks.capacity import replay

    spec = config_spec(name, args)
    server = common.start_server(name, spec.args, reserved_cpus=spec.reserved_cpus, env=spec.env)
    flags = config_flags(config_env(name)[0], args)[1]
    sessions = args.trace == "bfcl"
    out: dict[str, Any] = {"flags": flags, "binding": common.omp_binding(server), "steps": []}
    try:
        oai = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
        model = (await oai.models.list()).data[0].id
        alone, _ = await replay.run_agents(
            oai, model, convs[: args.alone], 1, args.alone, "alone", sessions
        )
        resumed = [t.ttft_s for t in alone if t.resumed]
        out["alone"], own_slo = sweep.slo_from_alone(resumed, args.slo_multiple)
        if not slo:
            slo.append(own_slo)
        log(f"[{name}] resumed turn alone {out['alone']:.3f} s; SLO {slo[0]:.3f} s")
        done: list[sweep.StepSummary] = []
        for n in counts:
            turns, wall = await replay.run_agents(
                oai, model, convs, n, args.per_agent, f"a{n}", sessions, args.stagger_s
            )
            s = sweep.summarize(n, turns, wall, slo[0])
            done.append(s)
            out["steps"].append({"summary": s, "turns": turns})
            log(
                f"[{name}] {n} agents: resumed p50/p90/p99 {s.resumed_p50:.2f}/"
                f"{s.resumed_p90:.2f}/{s.resumed_p99:.2f} s, cold p50 {s.cold_p50:.2f} s, "
                f"{s.output_tps:.1f} tok/s, recomputed {s.recomputed_tokens}"
                f"{'' if s.meets_slo else ' — past the SLO'}"
            )
            if sweep.should_stop(done):
                break
    finally:
        server.stop()
    return out


def _plain(value: Any) -> Any:
    """Dataclasses (summaries, turns) as dicts, for the raw JSON."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def run(args: argparse.Namespace) -> list[Record]:
    """Every configuration's alone reference and sweep, the report, the plot, the records."""
    from benchmarks.capacity import plot, report

    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    counts = agent_counts(args.agents)
    if args.slo_multiple <= 0 or args.per_agent < 1 or args.alone < 1:
        raise SystemExit("--slo-multiple must be positive, --per-agent and --alone at least 1")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    log = reporting.Progress()
    convs, workload = load_traces(args, max(counts) * args.per_agent)
    if len(convs) < args.alone:
        raise SystemExit(f"the trace gave {len(convs)} conversations, --alone needs {args.alone}")
    log(f"{workload}")
    if args.interleave:
        from benchmarks.capacity import interleave

        return interleave.run(args, convs, configs, workload, log)
    info_job = reporting.machine_info_async()
    t0 = time.monotonic()
    slo: list[float] = []
    results = {name: asyncio.run(_config(name, args, convs, counts, slo, log)) for name in configs}
    summaries = {n: [s["summary"] for s in r["steps"]] for n, r in results.items()}
    identical: dict[str, dict[int, tuple[int, int]]] = {}
    base = results.get("plain")
    for name, res in results.items():
        if base is None or name == "plain":
            continue
        ref = {s["summary"].agents: s["turns"] for s in base["steps"]}
        identical[name] = {
            s["summary"].agents: sweep.compare_answers(s["turns"], ref[s["summary"].agents])
            for s in res["steps"]
            if s["summary"].agents in ref
        }
    png = reporting.plot_path(f"capacity_{args.trace}.png", args.no_results)
    drawn = plot.plot(summaries, slo[0], png, f"capacity on {args.trace}: p90 of resumed turns")
    shown = str(drawn.relative_to(reporting.BENCH_DIR)) if drawn else ""
    alone = {n: r["alone"] for n, r in results.items()}
    raw = reporting.raw_path(f"capacity-{args.trace}")
    reporting.write_json(raw, {"args": vars(args), "slo_s": slo[0], "results": _plain(results)})
    section = report.markdown(
        args,
        workload,
        summaries,
        alone,
        slo[0],
        identical,
        info_job.result(),
        time.monotonic() - t0,
        shown,
    )
    reporting.publish(section + f"\nRaw: `{raw}`\n", args.no_results)
    first = next(iter(alone))
    return sweep.build_records(
        args.trace,
        summaries,
        slo[0],
        alone[first],
        args.slo_multiple,
        identical,
        plots=(shown,) if shown and not args.no_results else (),
    )
