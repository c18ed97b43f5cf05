"""Real agent traces through the unmodified ``openai`` client: plain vLLM vs kvbranch, with and
without agent-aware scheduling (docs/scheduling.md).

    .venv/bin/python -m benchmarks.history.real_traces  # ~6 min on 2 cores (quiet)
    .venv/bin/python -m benchmarks.history.real_traces --conversations 2 --no-results  # a smoke

The conversations are the Berkeley Function Calling Leaderboard's multi-turn set
(:mod:`benchmarks.bfcl_traces` says why that one and how it is replayed): each has a 3-5k-token
tools prompt, user turns, the ground-truth tool calls and the real outputs of those calls on
the conversation's backends. ``--concurrency`` conversations run at a time; each sends one
request per *step* (after a user turn, after that turn's tool outputs) with
``prompt_cache_key`` = the conversation's id (the OpenAI cache hint kvbranch turns into a
session), greedy, ``--max-tokens`` output tokens, ``--pause-s`` between steps (the tool).

Configurations, one server at a time, same sizes and core binding (``common.start_server``):

* ``plain`` — vLLM with prefix caching (``--no-connector``);
* ``kvbranch`` — the connector, scheduling flags off (``--no-agent-priority
  --cold-prefill-chunk 0``);
* ``kvbranch-sched`` — the connector with ``--sched-flags`` (default ``--agent-priority
  --cold-prefill-chunk 256``).

After the concurrent pass of the first kvbranch configuration, ``--alone`` conversations run
again one at a time under a fresh ``cache_salt`` (nothing of the first pass matches): every
resumed step is then a turn "run alone", the reference of the resumed-turn target.

Per step: TTFT (to the first content or tool-call chunk), recomputed tokens (kvbranch's
``kvbranch`` split; plain: prompt - cached), the answer. Per configuration: wall, output
tokens/s, peak summed RSS (``common.MemorySampler``), and vLLM's own per-request queue and
prefill times (its ``/metrics`` histograms, summed over the pass: vLLM exposes no per-request
split, so the queue/compute split is per configuration). Raw data go to benchmarks/out/, a
report, and records in benchmarks/results/ (unless ``--no-results``) with every target, met or not.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import bfcl_traces, cli, common, reporting  # noqa: E402
from benchmarks.capacity.configs import config_flags  # noqa: E402
from benchmarks.openai_stream import read_stream  # noqa: E402
from benchmarks.records import Record, result  # noqa: E402
from benchmarks.reporting import median, percentile  # noqa: E402

NAME = "real_traces"
DESCRIPTION = (
    "real agent traces (BFCL multi-turn) through the openai client: plain vLLM vs kvbranch, "
    "with and without agent-aware scheduling"
)
DEFAULT_SCHED_FLAGS = "--agent-priority --cold-prefill-chunk 256"
#: vLLM's per-request histograms (seconds): their _sum and _count before and after a pass.
METRICS = ("request_queue_time_seconds", "request_prefill_time_seconds", "time_to_first_token")


async def vllm_metrics(client: httpx.AsyncClient, url: str) -> dict[str, float]:
    text = (await client.get(f"{url}/metrics", timeout=30)).text
    out: dict[str, float] = {}
    for name in METRICS:
        for part in ("sum", "count"):
            pat = rf"^vllm:{name}(?:_seconds)?_{part}\{{[^}}]*\}} ([0-9.e+-]+)$"
            out[f"{name}_{part}"] = sum(float(v) for v in re.findall(pat, text, re.M))
    pat = r"^vllm:num_preemptions_total\{[^}]*\} ([0-9.e+-]+)$"
    out["preemptions"] = sum(float(v) for v in re.findall(pat, text, re.M))
    return out


async def run_step(oai, model: str, conv: dict, step: int, salt: str | None, max_tokens: int):
    extra = {"cache_salt": salt} if salt else {}
    t0 = time.perf_counter()
    load1 = os.getloadavg()[0]
    if conv["tools"]:
        extra_kw = {"tools": conv["tools"]}
    else:
        extra_kw = {}
    stream = await oai.chat.completions.create(
        **extra_kw,
        model=model,
        messages=conv["steps"][step],
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        prompt_cache_key=f"{salt or 'run'}-{conv['id']}",
        extra_body=extra,
    )
    return {
        "conv": conv["id"],
        "step": step,
        **await read_stream(stream, t0),
        "load1": load1,
        "sent_s": t0,
    }


async def run_pass(oai, model, convs, concurrency, salt, args) -> tuple[list[dict], float]:
    gate = asyncio.Semaphore(concurrency)
    records: list[dict] = []

    async def one(conv: dict) -> None:
        async with gate:
            for step in range(len(conv["steps"])):
                records.append(await run_step(oai, model, conv, step, salt, args.max_tokens))
                await asyncio.sleep(args.pause_s)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(c) for c in convs))
    return records, time.perf_counter() - t0


async def run_config(name: str, args, convs: list[dict], log, alone: bool) -> dict:
    from openai import AsyncOpenAI

    connector, flags = config_flags(name, args)
    server = common.start_server(
        name,
        common.server_args(
            connector, args.kv_cache_gib, args.host_store_gib, args.max_model_len, flags
        ),
        reserved_cpus=args.reserved_cpus,
    )
    out: dict = {"flags": flags, "binding": common.omp_binding(server)}
    try:
        with common.MemorySampler(common.server_pgids(server)) as mem:
            oai = AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
            async with httpx.AsyncClient() as client:
                model = (await oai.models.list()).data[0].id
                await run_step(
                    oai,
                    model,
                    {"id": "warm", "tools": [], "steps": [[{"role": "user", "content": "Hi"}]]},
                    0,
                    "warmup",
                    2,
                )
                before = await vllm_metrics(client, server.url)
                log(f"[{name}] {len(convs)} conversations, {args.concurrency} at a time")
                out["records"], out["wall_s"] = await run_pass(
                    oai, model, convs, args.concurrency, None, args
                )
                after = await vllm_metrics(client, server.url)
                out["metrics"] = {k: after[k] - before.get(k, 0.0) for k in after}
                if alone:
                    log(f"[{name}] reference: {args.alone} conversations one at a time")
                    out["alone"], _ = await run_pass(
                        oai, model, convs[: args.alone], 1, "alone", args
                    )
            mem.sample()
            out["peak_rss_bytes"] = mem.peak_bytes
    finally:
        server.stop()
        log(f"[{name}] server stopped")
    return out


# --- report --------------------------------------------------------------------------------------
def summarize(res: dict) -> dict:
    recs = res["records"]
    first = [r["ttft_s"] for r in recs if r["step"] == 0]
    later = [r["ttft_s"] for r in recs if r["step"] > 0]
    m = res["metrics"]
    n = max(m.get("request_queue_time_seconds_count", 0.0), 1.0)
    out_tokens = sum(r["completion_tokens"] for r in recs)
    return {
        "first_p50": median(first),
        "first_p95": percentile(first, 95),
        "later_p50": median(later),
        "later_p95": percentile(later, 95),
        "wall_s": res["wall_s"],
        "out_tps": out_tokens / res["wall_s"],
        "recomputed": sum(r["recomputed_tokens"] for r in recs),
        "prompt": sum(r["prompt_tokens"] for r in recs),
        "queue_mean_s": m.get("request_queue_time_seconds_sum", 0.0) / n,
        "prefill_mean_s": m.get("request_prefill_time_seconds_sum", 0.0) / n,
        "peak_gib": res["peak_rss_bytes"] / (1 << 30),
        "requests": len(recs),
        "preemptions": int(m.get("preemptions", 0.0)),
    }


def verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def report(args, convs, results, sums, info, elapsed, raw) -> str:
    tokens = [c["prompt_tokens"] for c in results[next(iter(results))]["records"]]
    lines = reporting.run_header("real_traces (BFCL multi-turn)", info, elapsed)
    loads = [r["load1"] for res in results.values() for r in res["records"]]
    bindings = {name: res["binding"] for name, res in results.items()}
    lines += reporting.conditions_md(loads, args.reserved_cpus, bindings)
    lines.append(
        f"- Workload: {len(convs)} conversations of `{bfcl_traces.SUBSET}` ({bfcl_traces.PACKAGE} "
        f"{bfcl_traces.VERSION}), first {args.max_turns} user turns each, "
        f"{sum(len(c['steps']) for c in convs)} steps, prompts {min(tokens)}-{max(tokens)} "
        f"tokens; {args.concurrency} conversations at a time, {args.pause_s} s between steps, "
        f"max_tokens {args.max_tokens}, greedy; device KV {args.kv_cache_gib} GiB, host store "
        f"{args.host_store_gib} GiB; `openai` client with `prompt_cache_key`; "
        f"kvbranch-sched: `{args.sched_flags}`. Raw: `{raw.relative_to(reporting.ROOT)}`\n"
    )
    header = [
        "configuration",
        "requests",
        "first step p50 / p95 (s)",
        "later steps p50 / p95 (s)",
        "wall (s)",
        "output tok/s",
        "recomputed / prompt tokens",
        "vLLM queue / prefill mean (s)",
        "preemptions",
        "peak RSS (GiB)",
        "answers = plain",
    ]
    base = results.get("plain")
    rows = []
    for name, s in sums.items():
        same = "–"
        if base is not None:
            ref = {(r["conv"], r["step"]): r["answer"] for r in base["records"]}
            recs = results[name]["records"]
            same = (
                f"{sum(ref.get((r['conv'], r['step'])) == r['answer'] for r in recs)}/{len(recs)}"
            )
        rows.append(
            [
                name,
                s["requests"],
                f"{s['first_p50']:.2f} / {s['first_p95']:.2f}",
                f"{s['later_p50']:.2f} / {s['later_p95']:.2f}",
                s["wall_s"],
                s["out_tps"],
                f"{s['recomputed']} / {s['prompt']}",
                f"{s['queue_mean_s']:.2f} / {s['prefill_mean_s']:.2f}",
                s["preemptions"],
                s["peak_gib"],
                same,
            ]
        )
    lines.append(reporting.md_table(header, rows))
    lines += targets(results, sums)
    return "\n".join(lines)


def target_records(results: dict, sums: dict) -> list[Record]:
    """Issue 24's targets: resumed steps within 2x of the same steps alone, later steps 15x
    faster than plain vLLM at no lower throughput, and the policy's throughput and cold-step
    cost against kvbranch without it."""
    out: list[Record] = []
    alone = next((res["alone"] for res in results.values() if res.get("alone")), None)
    scheds = [n for n in sums if n.startswith("kvbranch-sched")]
    off = "kvbranch" if "kvbranch" in sums else None
    named = [off, *scheds] if off else scheds
    if alone and scheds:
        keys = {(r["conv"], r["step"]) for r in alone if r["step"] > 0}
        ref = median([r["ttft_s"] for r in alone if r["step"] > 0])
        for name in named:
            same = [r["ttft_s"] for r in results[name]["records"] if (r["conv"], r["step"]) in keys]
            got = median(same) / ref
            metric = "resumed-step p50 / the same steps alone"
            note = f"alone p50 {ref:.2f} s, n = {len(same)}"
            out.append(
                result(NAME, name, metric, got, "x", note=note)
                if name == off  # the reference: the target is the policy's
                else result(NAME, name, metric, got, "x", "<= 2x", got <= 2, note=note)
            )
    if "plain" in sums:
        for name in named:
            r = sums["plain"]["later_p50"] / sums[name]["later_p50"]
            later = "p50 TTFT of steps after each conversation's first"
            out.append(result(NAME, f"plain/{name}", later, r, "x", target=">= 15x", met=r >= 15))
            t = sums[name]["out_tps"] / sums["plain"]["out_tps"]
            out.append(result(NAME, f"{name}/plain", "output tokens/s", t, "x", ">= 1", t >= 1))
    for sched in scheds if off else []:
        t = sums[sched]["out_tps"] / sums[off]["out_tps"]
        out.append(result(NAME, f"{sched}/{off}", "output tokens/s", t, "x", ">= 0.97", t >= 0.97))
        r = sums[sched]["first_p95"] / sums[off]["first_p95"]
        first = "p95 TTFT of first steps (cold)"
        out.append(result(NAME, f"{sched}/{off}", first, r, "x", "<= 1.5x", r <= 1.5))
    return out


def targets(results: dict, sums: dict) -> list[str]:
    out = ["Targets (issue 24):\n"]
    for r in target_records(results, sums):
        head = verdict(r.met) if r.met is not None else "(reference)"
        goal = f" (target {r.target})" if r.target else ""
        out.append(f"- {head} — {r.config}: {r.metric} {r.value:.2f}{r.unit}{goal}")
    return out


def records_of(results: dict, sums: dict) -> list[Record]:
    later = "p50 TTFT of steps after each conversation's first"
    per_config = [result(NAME, n, later, s["later_p50"], "s") for n, s in sums.items()]
    return per_config + target_records(results, sums)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    reporting.add_int_args(
        ap,
        {
            "--conversations": 6,
            "--concurrency": 3,
            "--max-turns": 2,
            "--max-tokens": 8,
            "--alone": 2,
            "--skip": 0,
            "--max-chars": 14000,
        },
    )
    ap.add_argument("--pause-s", type=float, default=0.5, help="tool time between steps")
    ap.add_argument(
        "--configs",
        default="kvbranch,kvbranch-sched,plain",
        help="in this order (plain last: it recomputes most, and --budget-s may skip it)",
    )
    ap.add_argument(
        "--budget-s",
        type=float,
        default=0.0,
        help="start no further configuration after this many seconds (0: no limit)",
    )
    ap.add_argument("--sched-flags", default=DEFAULT_SCHED_FLAGS, help="kvbranch-sched's flags")
    common.add_server_args(ap, kv_cache_gib=0.2, max_model_len=4096)
    common.add_run_args(ap)


def run(args: argparse.Namespace) -> list[Record]:
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    log = reporting.Progress()
    convs = bfcl_traces.load(args.conversations, args.max_turns, args.skip, args.max_chars)
    log(f"{len(convs)} conversations, {sum(len(c['steps']) for c in convs)} steps")
    info_job = reporting.machine_info_async()
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    first_kvb = next((c for c in args.configs if c != "plain"), None)
    for name in args.configs:
        if args.budget_s and time.monotonic() - t0 > args.budget_s:
            log(f"=== configuration {name} skipped: past --budget-s {args.budget_s:.0f} ===")
            continue
        log(f"=== configuration {name} ===")
        alone = name == first_kvb and args.alone > 0
        results[name] = asyncio.run(run_config(name, args, convs, log, alone))
    elapsed = time.monotonic() - t0
    sums = {n: summarize(r) for n, r in results.items()}
    raw = reporting.raw_path("real_traces")
    info = info_job.result()
    reporting.write_json(
        raw, {"args": vars(args), "machine": info, "results": results, "summary": sums}
    )
    reporting.publish(report(args, convs, results, sums, info, elapsed, raw), args.no_results)
    return records_of(results, sums)


if __name__ == "__main__":
    raise SystemExit(cli.run_study(sys.modules[__name__], sys.argv[1:]))
