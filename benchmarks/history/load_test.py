"""Load test: many concurrent agent sessions with forks and explicit pins, for minutes.

    .venv/bin/python -m benchmarks.history.load_test --quick  # ~60 s of load (plus server start)
    .venv/bin/python -m benchmarks.history.load_test          # ~3 min of load, 32 sessions

Starts its own kvbranch server (real vLLM, real model, connector on), then runs S concurrent
workers with the async sdk (``sdk.AsyncKVBranchClient``) until the duration is over. Each worker
opens a session (a seeded ~200-token system prompt of its own), chats T short turns (greedy, few
output tokens, a random think pause between turns), pins its main branch explicitly after the
first turn, forks at the fork turn, chats on the fork and pins it, prefetches the main branch,
and half the time unpins and deletes the fork; then it deletes the session and opens a new one.

Measured: operations ok / failed (the run fails if any failed), chat latency p50 / p95 (and
per route), the summed RSS of the server's process group sampled over time (start, peak, end),
and, after every session was deleted, the server's pinned blocks (must be 0) and sessions left.
Raw data goes to ``benchmarks/out/load_test-<profile>-<time>.json``; the report is printed and
the records written to ``benchmarks/results/`` (machine, command, date; each check a target).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import cli, common, reporting  # noqa: E402
from benchmarks.records import Record, result  # noqa: E402
from benchmarks.reporting import percentile  # noqa: E402
from benchmarks.textgen import WORDS  # noqa: E402
from sdk import AsyncKVBranchClient  # noqa: E402
from sdk.contract import Stats  # noqa: E402

NAME = "load_test"
DESCRIPTION = "many concurrent agent sessions with forks and explicit pins for minutes, on kvbranch"
GIB = 1 << 30


class Recorder:
    def __init__(self, t0: float) -> None:
        self.t0 = t0
        self.ops: list[dict] = []

    async def op(self, name: str, awaitable):
        start = time.perf_counter()
        try:
            result = await awaitable
        except Exception as exc:  # noqa: BLE001 - every failure is counted and reported
            self.ops.append(
                {
                    "op": name,
                    "ok": False,
                    "t": round(start - self.t0, 3),
                    "latency_s": time.perf_counter() - start,
                    "error": f"{type(exc).__name__}: {exc}"[:300],
                }
            )
            return None, False
        self.ops.append(
            {
                "op": name,
                "ok": True,
                "t": round(start - self.t0, 3),
                "latency_s": time.perf_counter() - start,
            }
        )
        return result, True


def system_text(rng: random.Random, words: int) -> str:
    return "You are a terse agent. Notes: " + " ".join(rng.choice(WORDS) for _ in range(words))


def user_text(rng: random.Random, turn: int) -> str:
    return (
        f"Step {turn}: tool {rng.choice(WORDS)} returned {rng.randrange(10**5)}. "
        f"Next {rng.choice(WORDS)}?"
    )


async def worker(
    i: int, client: AsyncKVBranchClient, rec: Recorder, args, deadline: float, counters: dict
) -> None:
    rng = random.Random(args.seed * 100_003 + i)
    await asyncio.sleep(rng.uniform(0, args.stagger_s))
    gen = {"max_tokens": args.max_tokens, "temperature": 0}
    while time.monotonic() < deadline:
        session, ok = await rec.op(
            "create_session",
            client.session(system=system_text(rng, args.system_words), pin_ttl_s=args.pin_ttl_s),
        )
        if not ok:
            await asyncio.sleep(1.0)
            continue
        counters["sessions"] += 1
        for turn in range(args.turns):
            if time.monotonic() >= deadline:
                break
            _, ok = await rec.op("chat", session.main.chat(user_text(rng, turn), **gen))
            if not ok:
                continue
            if turn == 0:
                await rec.op("pin", session.main.pin(args.pin_ttl_s))
            if turn == args.fork_turn:
                child, ok = await rec.op("fork", session.main.fork())
                if ok:
                    await rec.op("chat", child.chat(user_text(rng, 100 + turn), **gen))
                    await rec.op("pin", child.pin(args.pin_ttl_s))
                    await rec.op("prefetch", session.main.prefetch())
                    if rng.random() < 0.5:
                        await rec.op("unpin", child.unpin())
                        await rec.op("delete_branch", child.delete())
            await asyncio.sleep(rng.uniform(0, args.pause_max))
        await rec.op("delete_session", session.delete())


async def sample_rss(
    sampler: common.MemorySampler, t0: float, out: list, stop: asyncio.Event, every_s: float
) -> None:
    while not stop.is_set():
        rss = await asyncio.to_thread(sampler.sample)
        out.append((round(time.monotonic() - t0, 1), rss))
        try:
            await asyncio.wait_for(stop.wait(), timeout=every_s)
        except asyncio.TimeoutError:
            pass


async def load(args, server, log: reporting.Progress) -> dict:
    sampler = common.MemorySampler(common.server_pgid(server))
    t0 = time.monotonic()
    rss: list[tuple[float, int]] = []
    stop = asyncio.Event()
    sampling = asyncio.create_task(sample_rss(sampler, t0, rss, stop, args.sample_every_s))
    rec = Recorder(time.perf_counter())
    counters = {"sessions": 0}
    async with AsyncKVBranchClient(server.url, timeout=600.0) as client:
        stats0 = await client.stats()
        deadline = time.monotonic() + args.duration_s
        log(f"{args.sessions} workers for {args.duration_s:.0f}s")

        async def progress() -> None:
            while time.monotonic() < deadline:
                await asyncio.sleep(15)
                done = sum(1 for o in rec.ops if o["ok"])
                bad = sum(1 for o in rec.ops if not o["ok"])
                log(f"ops ok {done}, failed {bad}, rss {rss[-1][1] / GIB:.2f} GiB")

        reporter = asyncio.create_task(progress())
        await asyncio.gather(
            *(worker(i, client, rec, args, deadline, counters) for i in range(args.sessions))
        )
        reporter.cancel()
        load_end = time.monotonic() - t0
        log(f"load over after {load_end:.0f}s; all sessions deleted by their workers")
        await asyncio.sleep(2.0)
        stats1 = await client.stats()
    stop.set()
    await sampling
    rss.append((round(time.monotonic() - t0, 1), sampler.sample()))
    return {
        "ops": rec.ops,
        "rss": rss,
        "load_end_s": load_end,
        "counters": counters,
        "stats_before": stats0.model_dump(),
        "stats_after": stats1.model_dump(),
    }


def summarize(data: dict) -> dict:
    ops = data["ops"]
    by_op: dict[str, dict] = {}
    for o in ops:
        entry = by_op.setdefault(o["op"], {"ok": 0, "failed": 0, "lat": []})
        entry["ok" if o["ok"] else "failed"] += 1
        if o["ok"]:
            entry["lat"].append(o["latency_s"])
    rss = [b for _, b in data["rss"]]
    after = Stats.model_validate(data["stats_after"])
    store = after.store
    chat_lat = by_op.get("chat", {"lat": []})["lat"]
    return {
        "ops_ok": sum(1 for o in ops if o["ok"]),
        "ops_failed": sum(1 for o in ops if not o["ok"]),
        "errors": sorted({o["error"] for o in ops if not o["ok"]})[:20],
        "chat_requests": len(chat_lat),
        "chat_p50_s": percentile(chat_lat, 50),
        "chat_p95_s": percentile(chat_lat, 95),
        "chat_per_s": len(chat_lat) / data["load_end_s"] if data["load_end_s"] else 0.0,
        "per_op": {
            k: {
                "ok": v["ok"],
                "failed": v["failed"],
                "p50_s": percentile(v["lat"], 50),
                "p95_s": percentile(v["lat"], 95),
            }
            for k, v in sorted(by_op.items())
        },
        "rss_start_gib": rss[0] / GIB,
        "rss_peak_gib": max(rss) / GIB,
        "rss_end_gib": rss[-1] / GIB,
        "sessions_opened": data["counters"]["sessions"],
        "pinned_blocks_after": store.pinned_blocks,
        "pinned_bytes_after": store.pinned_bytes,
        "sessions_left": len(after.sessions),
        "store_used_gib": store.used_bytes / GIB,
        "store_capacity_gib": store.capacity_blocks * store.block_bytes / GIB,
        "store_after": store.model_dump(
            include={"used_blocks", "capacity_blocks", "evictions", "saved_blocks", "loaded_blocks"}
        ),
        "pins_degraded": after.pins_degraded,
        "pins_refused": after.pins_refused,
        "hits_tokens": after.hits_tokens,
        "prefetches": after.prefetches,
    }


def checks_of(summary: dict) -> dict[str, bool]:
    return {
        "no failed operation": summary["ops_failed"] == 0,
        "pinned blocks 0 after all sessions were deleted": summary["pinned_blocks_after"] == 0,
        "no session left": summary["sessions_left"] == 0,
    }


def records_of(args, summary: dict) -> list[Record]:
    load = f"{args.sessions} sessions, {args.duration_s:.0f} s"

    def none_left(metric: str, value: int, unit: str) -> Record:  # the checks: each must be 0
        return result(NAME, "kvbranch", metric, value, unit, target="0", met=value == 0)

    return [
        result(NAME, "kvbranch", f"operations ok ({load})", summary["ops_ok"], "operations"),
        none_left("failed operations", summary["ops_failed"], "operations"),
        result(NAME, "kvbranch", "chat p50 latency", summary["chat_p50_s"], "s"),
        result(NAME, "kvbranch", "chat p95 latency", summary["chat_p95_s"], "s"),
        none_left(
            "pinned blocks after every session was deleted",
            summary["pinned_blocks_after"],
            "blocks",
        ),
        none_left("sessions left after the load", summary["sessions_left"], "sessions"),
    ]


def report(
    args, summary: dict, info: dict, json_path: Path, wall_s: float, binding: str
) -> tuple[str, bool]:
    checks = checks_of(summary)
    rows = [
        [op, v["ok"], v["failed"], v["p50_s"], v["p95_s"]] for op, v in summary["per_op"].items()
    ]
    lines = [
        *reporting.run_header(f"Load test ({args.profile})", info, wall_s),
        f"- Server: `python -m server {' '.join(server_args_of(args))}`, "
        f"VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus} ({binding})",
        f"- Load: {args.sessions} concurrent sessions (async sdk) for {args.duration_s:.0f} s; "
        f"per session {args.turns} turns of {args.max_tokens} greedy output tokens, "
        f"~{args.system_words}-word system prompt, think pause 0-{args.pause_max} s, explicit "
        f"pin of main after turn 1 and of the fork, fork + prefetch at turn "
        f"{args.fork_turn + 1}, half the forks unpinned and deleted, then the session deleted "
        f"and a new one opened; seed {args.seed}",
        f"- Raw data: `{json_path.relative_to(reporting.ROOT)}`",
        "",
        reporting.md_table(["operation", "ok", "failed", "p50 s", "p95 s"], rows).rstrip(),
        "",
        f"- Operations: {summary['ops_ok']} ok, {summary['ops_failed']} failed; "
        f"{summary['chat_requests']} chat requests ({summary['chat_per_s']:.2f}/s), latency "
        f"p50 {summary['chat_p50_s']:.2f} s, p95 {summary['chat_p95_s']:.2f} s; "
        f"{summary['sessions_opened']} sessions opened",
        f"- Server RSS (summed over its process group): start {summary['rss_start_gib']:.2f} "
        f"GiB, peak {summary['rss_peak_gib']:.2f} GiB, end {summary['rss_end_gib']:.2f} GiB; "
        f"the host store held {summary['store_used_gib']:.2f} of its "
        f"{summary['store_capacity_gib']:.2f} GiB at the end (its pages count in RSS once "
        "written, so RSS grows with it up to the store's size)",
        f"- After the load: pinned blocks {summary['pinned_blocks_after']}, sessions left "
        f"{summary['sessions_left']}, store {summary['store_after']}, pins degraded "
        f"{summary['pins_degraded']}, refused {summary['pins_refused']}, prefetches "
        f"{summary['prefetches']}, prompt tokens by source {summary['hits_tokens']}",
        "- Checks: " + "; ".join(f"{k}: {'MET' if v else 'NOT MET'}" for k, v in checks.items()),
    ]
    if summary["errors"]:
        lines.append("- Errors: " + "; ".join(summary["errors"][:5]))
    return "\n".join(lines) + "\n", all(checks.values())


def server_args_of(args) -> list[str]:
    return common.server_args(
        True,
        args.kv_cache_gib,
        args.host_store_gib,
        args.max_model_len,
        ["--pin-ttl-s", str(int(args.pin_ttl_s))],
    )


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quick", action="store_true", help="~60 s of load instead of ~3 min")
    ap.add_argument("--sessions", type=int, default=32, help="concurrent sessions (workers)")
    ap.add_argument("--duration-s", type=float, help="seconds of load (default 180, quick 60)")
    ap.add_argument(
        "--turns",
        type=int,
        default=6,
        help="turns per session before it is deleted and a new one opened",
    )
    ap.add_argument("--fork-turn", type=int, default=2, help="0-based turn that forks")
    ap.add_argument("--max-tokens", type=int, default=8, help="output tokens per chat")
    ap.add_argument("--system-words", type=int, default=150, help="system prompt words")
    ap.add_argument("--pause-max", type=float, default=2.0, help="longest think pause (s)")
    ap.add_argument("--stagger-s", type=float, default=5.0, help="workers start within this")
    ap.add_argument("--pin-ttl-s", type=float, default=300.0, help="explicit and auto pin TTL")
    common.add_server_args(ap, 0.5, 2048, 1.0)
    ap.add_argument("--sample-every-s", type=float, default=2.0, help="RSS sampling period")
    common.add_run_args(ap)


def run(args: argparse.Namespace) -> list[Record]:
    args.profile = "quick" if args.quick else "default"
    if args.duration_s is None:
        args.duration_s = 60.0 if args.quick else 180.0

    log = reporting.Progress()
    info_future = reporting.machine_info_async()
    server = common.start_server("kvbranch", server_args_of(args), args.reserved_cpus)
    try:
        binding = common.omp_binding(server)
        data = asyncio.run(load(args, server, log))
    finally:
        server.stop()
    summary = summarize(data)
    json_path = reporting.raw_path(f"load_test-{args.profile}")
    reporting.write_json(json_path, {"args": vars(args), "summary": summary, **data})
    section, _ = report(args, summary, info_future.result(), json_path, log.elapsed(), binding)
    reporting.publish(section, args.no_results)
    return records_of(args, summary)


if __name__ == "__main__":
    raise SystemExit(cli.run_study(sys.modules[__name__], sys.argv[1:]))
