"""Agent-aware scheduling on and off, in interleaved passes of the real agent traces: does the
policy cost throughput?

    .venv/bin/python -m benchmarks.history.policy_ab  # 6 passes each, ~12 min on 2 cores
    .venv/bin/python -m benchmarks.history.policy_ab --passes 2 --conversations 4 --no-results

Why: benchmarks/history/real_traces.py runs each configuration once, one after the other; its
throughput ratio (policy on / off) moved 0.89-0.95x between runs while the walls of the same
configuration moved by 15%, so "throughput not lower" (issue 24) was neither shown nor refuted.
Here both kvbranch servers are up at once with their engines on the same core
(``--cpu-cores``) and run the same concurrent pass of the BFCL conversations
(:mod:`benchmarks.history.real_traces`) in turn — A then B, then B then A — each pass under a fresh
``cache_salt`` (nothing of an earlier pass is reused; only one server works at a time). Per
pass: wall, output tokens/s, p50 TTFT of the steps after each conversation's first, p95 of the
first steps. The report gives the median of the per-pass ratios (on / off) with a 95% bootstrap
interval.

* ``off`` — kvbranch with vLLM's own scheduling (``common.SCHEDULER_OFF_FLAGS``);
* ``on``  — kvbranch with the launcher's defaults (the policy on, docs/scheduling.md).

``--off-env K=V`` / ``--off-flags '...'`` make ``off`` the defaults with one part of the policy
changed instead (``KVBRANCH_BACKFILL=0``; ``--cold-prefill-chunk 512``).

``--step-trace DIR`` also records both engines' steps (the connector's step trace,
:mod:`benchmarks.step_profile`) and reports what each pass cost the engine — busy seconds,
forward of prefill and of decode-only steps, steps, idle — side by side: whether a difference
in wall is more work or the same work ordered with more waiting. Every run also reads each
server's ``/metrics`` before and after each pass (preemptions, prompt tokens by source).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bfcl_traces, cli, common, reporting  # noqa: E402
from benchmarks.history import real_traces  # noqa: E402
from benchmarks.history.step_breakdown import step_costs  # noqa: E402
from benchmarks.records import Record, result  # noqa: E402
from benchmarks.reporting import median, percentile  # noqa: E402
from benchmarks.step_profile import paired_steps, sum_samples  # noqa: E402
from server.connector.engine.step_trace import ENV_STEP_TRACE  # noqa: E402

#: name -> launcher flags, both with the connector.
NAME = "policy_ab"
DESCRIPTION = (
    "agent-aware scheduling on and off in interleaved passes of the real agent traces: does "
    "the policy cost throughput?"
)
CONFIGS = {"off": common.SCHEDULER_OFF_FLAGS, "on": []}
#: ``--off-env K=V``: "off" is the defaults with this environment instead (a part of the policy
#: switched off by its variable, e.g. ``KVBRANCH_ASYNC_SAVE=0``).


def off_label(args) -> str:
    """What the "off" configuration is, for the report."""
    changes = [args.off_env] if args.off_env else []
    if args.off_flags:
        changes.append(f"`{args.off_flags}`")
    return f"the defaults with {' '.join(changes)}" if changes else "vLLM scheduling"


def pass_summary(records: list[dict], wall_s: float) -> dict[str, float]:
    first = [r["ttft_s"] for r in records if r["step"] == 0]
    later = [r["ttft_s"] for r in records if r["step"] > 0]
    return {
        "wall_s": wall_s,
        "out_tps": sum(r["completion_tokens"] for r in records) / wall_s,
        "later_p50": median(later),
        "first_p95": percentile(first, 95),
    }


#: Server counters read from ``/metrics`` before and after each pass: (sample name, label
#: ``source`` or None) -> key in a pass's ``counters``.
SERVER_COUNTERS = {
    ("vllm:num_preemptions_total", None): "preemptions (vLLM, all)",
    ("kvbranch_scheduler_preemptions_total", None): "preemptions for warmer work",
    ("kvbranch_prompt_tokens_total", "device"): "prompt tokens from device cache",
    ("kvbranch_prompt_tokens_total", "host"): "prompt tokens from host store",
    ("kvbranch_prompt_tokens_total", "recomputed"): "prompt tokens recomputed",
}


def read_counters(metrics_text: str) -> dict[str, float]:
    """:data:`SERVER_COUNTERS` out of a ``/metrics`` page (summed over other labels)."""

    def key_of(sample: Any) -> str | None:
        return SERVER_COUNTERS.get((sample.name, sample.labels.get("source")))

    found = sum_samples(metrics_text, key_of)
    return {key: found.get(key, 0.0) for key in SERVER_COUNTERS.values()}


async def counters_of(http, url: str) -> dict[str, float]:
    return read_counters((await http.get(f"{url}/metrics", timeout=30)).text)


async def run_passes(args, convs, servers: dict[str, common.ServerProcess], log) -> list[dict]:
    from openai import AsyncOpenAI

    clients = {
        n: AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
        for n, s in servers.items()
    }
    models = {n: (await c.models.list()).data[0].id for n, c in clients.items()}
    warm = {"id": "warm", "tools": [], "steps": [[{"role": "user", "content": "Hi"}]]}
    for n, c in clients.items():
        await real_traces.run_step(c, models[n], warm, 0, "warmup", 2)
    passes: list[dict] = []
    async with httpx.AsyncClient() as http:  # /metrics before and after each pass
        for i in range(args.passes):
            order = list(servers) if i % 2 == 0 else list(reversed(servers))
            row: dict = {"pass": i, "order": order}
            for name in order:
                before = await counters_of(http, servers[name].url)
                started = time.monotonic()  # the step trace's clock
                records, wall = await real_traces.run_pass(
                    clients[name], models[name], convs, args.concurrency, f"pass{i}-{name}", args
                )
                row[name] = {"records": records, **pass_summary(records, wall)}
                row[name]["window"] = (started, time.monotonic())
                after = await counters_of(http, servers[name].url)
                row[name]["counters"] = {k: after[k] - before[k] for k in after}
                log(
                    f"pass {i} [{name}]: wall {wall:.1f}s, {row[name]['out_tps']:.2f} tok/s, "
                    f"later p50 {row[name]['later_p50']:.2f}s"
                )
            passes.append(row)
    return passes


METRICS = {
    "out_tps": ("output tokens/s", "higher is better; target: not lower (>= 0.97)"),
    "wall_s": ("wall of the pass", "lower is better"),
    "later_p50": ("p50 TTFT of steps after each conversation's first", "lower is better"),
    "first_p95": ("p95 TTFT of first steps", "target: <= 1.5"),
}


#: Engine totals per pass (``--step-trace``), as (label, key).
ENGINE_METRICS = (
    ("engine busy s (forward and copies)", "busy_s"),
    ("forward of steps with prefill, s", "prefill_forward_s"),
    ("forward of decode-only steps, s", "decode_forward_s"),
    ("engine steps", "steps"),
    ("prefill tokens computed", "prefill_tokens"),
    ("engine idle s (gaps > 0.25 s)", "idle_s"),
)


def window_totals(pairs: list[tuple[dict, dict | None]], t0: float, t1: float) -> dict[str, float]:
    """The engine's work in the steps that began in ``[t0, t1)`` (monotonic seconds): busy
    seconds (forward and copies), forward of steps with prefill and of decode-only steps, steps,
    prefill and decode tokens, and idle seconds (gaps over ``step_breakdown.IDLE_GAP_S`` between
    them).
    What one pass of a workload cost the engine, comparable between two servers that ran the
    same pass (``--step-trace``)."""
    tot = dict.fromkeys(
        ("busy_s", "prefill_forward_s", "decode_forward_s", "steps", "prefill_tokens",
         "decode_tokens", "idle_s"),
        0.0,
    )  # fmt: skip
    for step in step_costs([(w, s) for w, s in pairs if t0 <= w["t"] < t1]):
        s = step.sched
        tot["busy_s"] += step.load + step.forward + step.save
        tot["steps"] += 1
        if s is not None and s["prefill"]:
            tot["prefill_forward_s"] += step.forward
        elif s is not None and s["decode"]:
            tot["decode_forward_s"] += step.forward
        if s is not None:
            tot["prefill_tokens"] += s["prefill"]
            tot["decode_tokens"] += s["decode"]
        if step.idle:
            tot["idle_s"] += step.gap or 0.0
    return tot


def add_engine_totals(passes: list[dict], trace_dir: Path) -> None:
    """Each pass's engine totals (``engine``), from the step trace of its server."""
    for name in CONFIGS:
        pairs = paired_steps(trace_dir / name)
        for p in passes:
            p[name]["engine"] = window_totals(pairs, *p[name]["window"])


def engine_table(passes: list[dict], rng: random.Random) -> list[str]:
    rows = []
    for label, key in ENGINE_METRICS:
        off = [p["off"]["engine"][key] for p in passes]
        on = [p["on"]["engine"][key] for p in passes]
        ratios = [b / a for a, b in zip(off, on, strict=True) if a > 0]
        lo, hi = reporting.bootstrap_median(ratios, rng) if ratios else (float("nan"),) * 2
        ratio = f"{median(ratios):.3f}" if ratios else "-"
        rows.append([label, median(off), median(on), ratio, f"{lo:.3f}-{hi:.3f}"])
    header = ["engine, per pass (step trace)", "off p50", "on p50", "on/off (median)", "95% CI"]
    return ["What each pass cost the engine:\n", reporting.md_table(header, rows)]


def counters_table(passes: list[dict]) -> list[str]:
    rows = [
        [key, median([p["off"]["counters"][key] for p in passes]),
         median([p["on"]["counters"][key] for p in passes])]
        for key in SERVER_COUNTERS.values()
    ]  # fmt: skip
    header = ["server counters, per pass (/metrics)", "off p50", "on p50"]
    return [reporting.md_table(header, rows)]


#: The two targets of issue 24 this benchmark decides, in the report's words.
TARGET_TEXT = {
    "out_tps": "throughput not lower (on/off >= 0.97)",
    "first_p95": "cold first step p95 <= 1.5x without the policy",
}


@dataclass(frozen=True)
class MetricRatio:
    """One metric of the passes: off's and on's medians, on/off per pass (median and 95%
    interval), and the verdict where the metric has a target."""

    key: str
    off: float
    on: float
    med: float
    lo: float
    hi: float

    @property
    def target(self) -> str:
        return {"out_tps": ">= 0.97 (whole interval)", "first_p95": "<= 1.5 (whole interval)"}.get(
            self.key, ""
        )

    @property
    def met(self) -> bool | None:
        """real_traces' verdict is on a single ratio; here it must hold for the whole interval
        (None: the interval straddles the line, not shown either way)."""
        if self.key == "out_tps":
            return True if self.lo >= 0.97 else False if self.hi < 0.97 else None
        if self.key == "first_p95":
            return True if self.hi <= 1.5 else False if self.lo > 1.5 else None
        return None

    @property
    def said(self) -> str:
        return {True: "met", False: "not met", None: "not shown either way"}[self.met]


def metric_ratios(passes: list[dict], rng: random.Random) -> list[MetricRatio]:
    out = []
    for key in METRICS:
        ratios = [p["on"][key] / p["off"][key] for p in passes]
        lo, hi = reporting.bootstrap_median(ratios, rng)
        off = median([p["off"][key] for p in passes])
        on = median([p["on"][key] for p in passes])
        out.append(MetricRatio(key, off, on, median(ratios), lo, hi))
    return out


def records_of(passes: list[dict]) -> list[Record]:
    """on/off per metric (the same seeded intervals as the report's table)."""
    return [
        result(
            NAME,
            "on/off",
            f"{METRICS[m.key][0]} (median of passes)",
            m.med,
            "x",
            target=m.target,
            met=m.met,
            note=f"95% CI {m.lo:.3f}-{m.hi:.3f}",
        )
        for m in metric_ratios(passes, random.Random(1))
    ]


def report(args, convs, passes, info, elapsed, bindings, raw) -> str:
    rng = random.Random(1)
    lines = reporting.run_header(
        "policy_ab (agent-aware scheduling on/off, interleaved)", info, elapsed
    )
    loads = [r["load1"] for p in passes for n in CONFIGS for r in p[n]["records"]]
    lines += reporting.conditions_md(loads, args.reserved_cpus, bindings)
    lines.append(
        f"- {args.passes} passes each in alternating order, both servers up, one working at a "
        f"time: {len(convs)} conversations of `{bfcl_traces.SUBSET}`, first {args.max_turns} "
        f"user turns, {args.concurrency} at a time, {args.pause_s} s between steps, max_tokens "
        f"{args.max_tokens}, a fresh cache_salt per pass; device KV {args.kv_cache_gib} GiB; "
        f"engines on core(s) {args.cpu_cores}; "
        f"off = {off_label(args)}; "
        f"raw: `{raw.relative_to(reporting.ROOT)}`\n"
    )
    rows, verdicts = [], []
    for m in metric_ratios(passes, rng):
        label, note = METRICS[m.key]
        rows.append([label, m.off, m.on, f"{m.med:.3f}", f"{m.lo:.3f}-{m.hi:.3f}", note])
        if m.target:
            verdicts.append(
                f"- {TARGET_TEXT[m.key]}: **{m.said}** — median {m.med:.3f} "
                f"(95% CI {m.lo:.3f}-{m.hi:.3f})"
            )
    header = ["metric", "off p50 of passes", "on p50 of passes", "on/off (median)", "95% CI", ""]
    lines.append(reporting.md_table(header, rows))
    if all("engine" in p["on"] for p in passes):
        lines += engine_table(passes, rng)
    if all("counters" in p["on"] for p in passes):
        lines += counters_table(passes)
    same = sum(
        ra["answer"] == rb["answer"]
        for p in passes
        for ra, rb in zip(
            sorted(p["off"]["records"], key=lambda r: (r["conv"], r["step"])),
            sorted(p["on"]["records"], key=lambda r: (r["conv"], r["step"])),
            strict=True,
        )
    )
    total = sum(len(p["on"]["records"]) for p in passes)
    lines.append(f"Answers identical on and off: {same}/{total}.\n")
    return "\n".join(lines + ["Targets (issue 24):\n", *verdicts])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    reporting.add_int_args(
        ap,
        {
            "--passes": 6,
            "--conversations": 12,
            "--concurrency": 4,
            "--max-turns": 2,
            "--max-tokens": 8,
            "--skip": 0,
            "--max-chars": 14000,
        },
    )
    ap.add_argument("--pause-s", type=float, default=0.5, help="tool time between steps")
    ap.add_argument("--cpu-cores", default="0", help="the engines' core(s), the same for both")
    ap.add_argument(
        "--off-flags",
        default="",
        help="launcher flags: 'off' runs the launcher's defaults with these instead of vLLM's "
        "own scheduling (e.g. '--cold-prefill-chunk 512': a setting of the policy A/B'd)",
    )
    ap.add_argument(
        "--off-env",
        default="",
        help="K=V: 'off' runs the launcher's defaults with this variable set instead of "
        "vLLM's own scheduling (one part of the policy off)",
    )
    ap.add_argument(
        "--step-trace",
        type=Path,
        help="record both engines' steps here and report each pass's engine work",
    )
    common.add_server_args(ap, kv_cache_gib=0.2, max_model_len=4096)
    common.add_run_args(ap)


def run(args: argparse.Namespace) -> list[Record]:
    log = reporting.Progress()
    convs = bfcl_traces.load(args.conversations, args.max_turns, args.skip, args.max_chars)
    info_job = reporting.machine_info_async()
    t0 = time.monotonic()
    specs: dict[str, common.ServerSpec] = {}
    for name, flags in CONFIGS.items():
        env = {}
        if name == "off" and (args.off_env or args.off_flags):
            flags = args.off_flags.split()
            if args.off_env:
                key, _, value = args.off_env.partition("=")
                env = {key: value}
        if args.step_trace:
            env[ENV_STEP_TRACE] = str(args.step_trace / name / "steps")
        server_args = common.server_args(
            True,
            args.kv_cache_gib,
            args.host_store_gib,
            args.max_model_len,
            [*flags, "--cpu-cores", args.cpu_cores],
        )
        specs[name] = common.ServerSpec(server_args, env, args.reserved_cpus)
    with common.servers_up(specs) as servers:
        bindings = {n: common.omp_binding(s) for n, s in servers.items()}
        passes = asyncio.run(run_passes(args, convs, servers, log))
    if args.step_trace:  # the servers flushed their traces when they stopped
        add_engine_totals(passes, args.step_trace)
    elapsed = time.monotonic() - t0
    raw = reporting.raw_path("policy_ab")
    info = info_job.result()
    reporting.write_json(raw, {"args": vars(args), "machine": info, "passes": passes})
    reporting.publish(report(args, convs, passes, info, elapsed, bindings, raw), args.no_results)
    return records_of(passes)


if __name__ == "__main__":
    raise SystemExit(cli.run_study(sys.modules[__name__], sys.argv[1:]))
