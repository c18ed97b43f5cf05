"""An agent workload over a kvbranch cluster, side by side in one run (issue 23, item 7):

* ``cluster``      — 2 routers over one Redis index (``--index unix://…``), turns alternating
                     between the routers: any router serves any turn, holds and block entries
                     live in the index;
* ``single-router``— one router with the embedded index and the same instances as seeds
                     (today's P/D affinity: the one router knows every hold);
* ``round-robin``  — one router, no index at all (``--router-policy round-robin``): P and D in
                     turn, nothing pulled, each P's prefix cache only by luck.

    .venv/bin/python -m benchmarks.history.cluster_agents  # ~20 minutes on 2 cores
    .venv/bin/python -m benchmarks.history.cluster_agents --sessions 4 --turns 4  # quicker

Every configuration gets fresh instances: 2 prefill (core 0) and 2 decode (core 1), the same
sizes, the same conversations (greedy; answers are compared across configurations), and the
same failure: once half of the turns are done, one prefill instance is SIGKILLed and stays down
for the rest of the run. Per configuration: hit rate (the share of each resumed turn's prompt
that was not recomputed: device, host store or pulled from D), recomputed tokens, p50/p95 TTFT of
resumed turns (before and after the kill), routes taken, failed requests.

Raw data: benchmarks/out/cluster_agents-<time>.json; the report is printed and the
records written to benchmarks/results/ (unless --no-results).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import cli, common, reporting  # noqa: E402
from benchmarks.history import cluster  # noqa: E402
from benchmarks.pd_turns import conversation_turns  # noqa: E402
from benchmarks.records import Record, result  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

NAME = "cluster_agents"
DESCRIPTION = (
    "agents over a kvbranch cluster: 2 routers + Redis vs one router vs round robin, one P "
    "SIGKILLed mid-run"
)
CONFIGS = ("cluster", "single-router", "round-robin")
#: The target: the cluster's hit rate at least this share of one router's.
HIT_RATE_TARGET = 0.9


def redis_info(server: RedisServer) -> dict[str, str]:
    """``INFO`` of the configuration's Redis, as ``redis-cli`` prints it."""
    out = subprocess.run(
        ["redis-cli", "-s", str(server.socket), "info"], capture_output=True, text=True, check=False
    ).stdout
    return dict(
        line.split(":", 1) for line in out.splitlines() if ":" in line and not line.startswith("#")
    )


async def wait_members(client: httpx.AsyncClient, url: str, n: int, timeout: float = 60) -> None:
    """Until the router's health lists ``n`` instances alive."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            r = await client.get(url + "/v1/kvbranch/health", timeout=5)
            alive = [i for i in r.json().get("instances", []) if i.get("alive")]
            if len(alive) >= n:
                return
        except (httpx.HTTPError, ValueError):
            pass
        await asyncio.sleep(0.5)
    raise RuntimeError(f"router {url} never saw {n} live instances")


async def run_config(name: str, args: argparse.Namespace, log: reporting.Progress) -> dict:
    redis = RedisServer().start() if name == "cluster" else None
    index = redis.url if redis is not None else "memory"
    prefills = [cluster.instance("prefill", "0", index, args) for _ in range(2)]
    decodes = [cluster.instance("decode", "1", index, args) for _ in range(2)]
    routers: list[common.ServerProcess] = []
    turns: list[dict] = []
    failures: list[str] = []
    t_start = time.monotonic()
    try:
        for inst in prefills + decodes:
            inst.launch()
        for inst in prefills + decodes:
            inst.wait_ready()
        log(f"[{name}] 4 instances ready after {time.monotonic() - t_start:.0f}s")
        seeds = [a for p in prefills for a in ("--prefill", p.url)]
        seeds += [a for d in decodes for a in ("--decode", d.url)]
        if name == "cluster":
            routers = [cluster.router(["--index", index]) for _ in range(2)]
        elif name == "single-router":
            routers = [cluster.router(seeds)]
        else:
            routers = [cluster.router([*seeds, "--router-policy", "round-robin"])]
        for r in routers:
            r.start()
        convs = {
            s: conversation_turns(args.seed + s, args.turns, args.system_tokens, args.new_tokens)
            for s in range(args.sessions)
        }
        history = {s: [{"role": "system", "content": convs[s][0]}] for s in convs}
        total = args.sessions * args.turns
        done = 0
        killed_at: float | None = None
        lock = asyncio.Lock()
        async with httpx.AsyncClient(timeout=1800) as client:
            for r in routers:
                await wait_members(client, r.url, 4)

            async def agent(s: int) -> None:
                nonlocal done, killed_at
                for turn in range(1, args.turns + 1):
                    messages = history[s]
                    messages.append({"role": "user", "content": convs[s][1][turn - 1]})
                    body = common.greedy_turn(messages, args.gen_tokens, f"cb-{name}-{s}")
                    via = routers[(s + turn) % len(routers)]
                    try:
                        res = await common.stream_chat(client, via.url, body)
                    except (RuntimeError, httpx.HTTPError) as exc:
                        failures.append(f"session {s} turn {turn}: {exc}"[:300])
                        messages.append({"role": "assistant", "content": ""})
                        continue
                    turns.append(
                        common.turn_row(res, session=s, turn=turn, after_kill=killed_at is not None)
                    )
                    log(
                        f"[{name}] s{s} t{turn} via {via.port}: {res.extra.get('route')} TTFT "
                        f"{res.ttft_s:.2f}s prompt {res.prompt_tokens} recomputed "
                        f"{res.recomputed_tokens}"
                    )
                    messages.append({"role": "assistant", "content": res.content})
                    async with lock:
                        done += 1
                        if killed_at is None and done >= total // 2:
                            victim = prefills[0]
                            assert victim.proc is not None
                            os.killpg(os.getpgid(victim.proc.pid), signal.SIGKILL)
                            killed_at = time.monotonic()
                            log(f"[{name}] killed prefill {victim.url} after {done} turns")

            sem = asyncio.Semaphore(args.concurrency)

            async def bounded(s: int) -> None:
                async with sem:
                    await agent(s)

            wall0 = time.monotonic()
            await asyncio.gather(*(bounded(s) for s in convs))
            wall = time.monotonic() - wall0
        info = redis_info(redis) if redis is not None else {}
    finally:
        for r in routers:
            r.stop()
        for inst in prefills + decodes:
            inst.stop()
        if redis is not None:
            redis.close()
    return {
        "name": name,
        "turns": turns,
        "failures": failures,
        "wall_s": wall,
        "redis_used_memory": info.get("used_memory_human", "").strip(),
        "redis_commands": info.get("total_commands_processed", "").strip(),
    }


def summary(result: dict) -> dict:
    resumed = [t for t in result["turns"] if t["turn"] > 1]
    prompt = sum(t["prompt_tokens"] for t in resumed)
    recomputed = sum(t["recomputed_tokens"] for t in resumed)
    before = [t["ttft_s"] for t in resumed if not t["after_kill"]]
    after = [t["ttft_s"] for t in resumed if t["after_kill"]]
    routes: dict[str, int] = {}
    for t in result["turns"]:
        routes[str(t["route"])] = routes.get(str(t["route"]), 0) + 1
    return {
        "hit_rate": (prompt - recomputed) / prompt if prompt else 0.0,
        "recomputed": recomputed,
        "prompt": prompt,
        "p50": reporting.median([t["ttft_s"] for t in resumed]) if resumed else 0.0,
        "p95": reporting.percentile([t["ttft_s"] for t in resumed], 95) if resumed else 0.0,
        "p50_before": reporting.median(before) if before else 0.0,
        "p50_after": reporting.median(after) if after else 0.0,
        "routes": routes,
    }


def report(results: list[dict], args: argparse.Namespace, info: dict, elapsed: float) -> str:
    lines = reporting.run_header(
        "Cluster: agents over 2 routers + Redis vs one router vs round robin", info, elapsed
    )
    lines.append(
        f"{args.sessions} agent sessions × {args.turns} turns, {args.concurrency} at a time; "
        f"system {args.system_tokens} tokens, +{args.new_tokens} tokens per turn, "
        f"{args.gen_tokens} generated; 2 P (core 0) + 2 D (core 1), "
        f"{args.kv_cache_gib} GiB device KV and "
        f"{args.host_store_gib} GiB host store each; one P SIGKILLed after half of the turns. "
        "Resumed turns = turn ≥ 2; hit rate = share of their prompt tokens not recomputed "
        "(device, host store or pulled from D)."
    )
    lines.append("")
    rows = []
    sums = {r["name"]: summary(r) for r in results}
    for r in results:
        s = sums[r["name"]]
        rows.append(
            [
                r["name"],
                f"{s['hit_rate']:.1%}",
                f"{s['recomputed']} / {s['prompt']}",
                f"{s['p50']:.2f}",
                f"{s['p95']:.2f}",
                f"{s['p50_before']:.2f} / {s['p50_after']:.2f}",
                ", ".join(f"{k} {v}" for k, v in sorted(s["routes"].items())),
                len(r["failures"]),
                f"{r['wall_s']:.0f}",
            ]
        )
    lines.append(
        reporting.md_table(
            [
                "config",
                "hit rate",
                "recomputed / prompt tokens",
                "p50 TTFT s",
                "p95 TTFT s",
                "p50 before / after kill",
                "routes",
                "failed requests",
                "wall s",
            ],
            rows,
        )
    )
    lines.append("")
    cluster, single, rr = (sums.get(n) for n in CONFIGS)
    if cluster and single:
        ratio = cluster["hit_rate"] / single["hit_rate"] if single["hit_rate"] else 0.0
        lines.append(
            f"- Target: cluster hit rate ≥ 90% of one router's: {ratio:.1%} — "
            f"{'met' if ratio >= 0.9 else 'NOT met'}."
        )
    if cluster and rr:
        lines.append(
            f"- Cluster vs round robin: hit rate {cluster['hit_rate']:.1%} vs "
            f"{rr['hit_rate']:.1%}; p50 TTFT {reporting.ratio(rr['p50'], cluster['p50'])} lower."
        )
    by_name = {r["name"]: r for r in results}
    base = by_name.get("single-router")
    if base is not None:
        for r in results:
            if r is base:
                continue
            a = {(t["session"], t["turn"]): t["content"] for t in base["turns"]}
            b = {(t["session"], t["turn"]): t["content"] for t in r["turns"]}
            same = sum(1 for k in a if k in b and a[k] == b[k])
            lines.append(f"- Answers {r['name']} vs single-router: {same}/{len(a)} identical.")
    redis = by_name.get("cluster")
    if redis is not None and redis.get("redis_used_memory"):
        lines.append(
            f"- Redis at the end: used_memory {redis['redis_used_memory']}, "
            f"{redis['redis_commands']} commands in all."
        )
    for r in results:
        for f in r["failures"][:5]:
            lines.append(f"- {r['name']} failure: {f}")
    return "\n".join(lines) + "\n"


def records_of(results: list[dict]) -> list[Record]:
    """Hit rate, p50 TTFT and failures per configuration, and the cluster's target."""
    sums = {r["name"]: summary(r) for r in results}
    out: list[Record] = []
    for r in results:
        s = sums[r["name"]]
        out += [
            result(NAME, r["name"], "hit rate of resumed turns", 100 * s["hit_rate"], "%"),
            result(NAME, r["name"], "p50 TTFT of resumed turns", s["p50"], "s"),
            result(NAME, r["name"], "failed requests", len(r["failures"]), "requests"),
        ]
    cluster, single = sums.get("cluster"), sums.get("single-router")
    if cluster and single and single["hit_rate"]:
        ratio = cluster["hit_rate"] / single["hit_rate"]
        out.append(
            result(
                NAME,
                "cluster/single-router",
                "hit rate",
                100 * ratio,
                "%",
                target=f">= {HIT_RATE_TARGET:.0%}",
                met=ratio >= HIT_RATE_TARGET,
            )
        )
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--system-tokens", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=80)
    ap.add_argument("--gen-tokens", type=int, default=12)
    common.add_server_args(ap, kv_cache_gib=0.25, max_model_len=4096, host_store_gib=0.25)
    common.add_run_args(ap, reserved_cpus=False)


def run(args: argparse.Namespace) -> list[Record]:
    log = reporting.Progress()
    info_future = reporting.machine_info_async()
    t0 = time.monotonic()
    results = [asyncio.run(run_config(name, args, log)) for name in args.configs]
    section = report(results, args, info_future.result(), time.monotonic() - t0)
    reporting.write_json(reporting.raw_path("cluster_agents"), results)
    reporting.publish(section, args.no_results)
    return records_of(results)


if __name__ == "__main__":
    raise SystemExit(cli.run_study(sys.modules[__name__], sys.argv[1:]))
