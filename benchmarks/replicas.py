"""Aggregated replicas of one model behind a front, kvbranch against plain vLLM: does a session's
KV follow it when its turns land on other replicas? (docs/cluster.md; benchmarks/README.md says
what each front and config is.) ``kvbranch``: N ``python -m server --role single --index``
replicas on a Redis started here, one cluster secret; ``vllm``: N :mod:`tests.vanilla_vllm`.
Replica i on core i (more replicas than cores share them in turn); fresh servers for every
(front, config), one set at a time. The hashing fronts live in the client (a transport
readdressing each request: no extra hop); ``router`` is ours. The workloads are pd_turns'
(:mod:`benchmarks.pd_workloads`, session and branch in the body only).

    .venv/bin/python -m benchmarks replicas --replicas 2 --front round-robin affinity router
    .venv/bin/python -m benchmarks replicas --conversations 1 --turns 2 --no-results  # a smoke
    .venv/bin/python -m benchmarks replicas --workload mooncake --conversations 6 --turns 3
    .venv/bin/python -m benchmarks replicas --front --moved-probes 20 --probe-configs sync
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import cli, common, moved_turn, reporting  # noqa: E402
from benchmarks.pd_report import answers, p50_ttft, shape  # noqa: E402
from benchmarks.pd_workloads import add_workload_arguments, run_workload  # noqa: E402
from benchmarks.records import Record, result  # noqa: E402
from benchmarks.step_profile import sum_samples  # noqa: E402
from sdk.contract import BRANCH_XARG, DEFAULT_BRANCH  # noqa: E402
from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET  # noqa: E402
from server.launcher.process import ServerProcess, free_port  # noqa: E402

NAME = "replicas"
DESCRIPTION = (
    "aggregated replicas behind round robin, session affinity or our router: kvbranch replicas "
    "that pull a session's KV from each other vs plain vLLM replicas"
)
FRONTS = ("round-robin", "affinity", "router")
DEFAULT_CONFIGS = ("kvbranch", "vllm")
#: ``kvbranch-lowered``: kvbranch replicas with NIXL's threads at nice 19 from the start
#: (``--nixl-threads lowered``), for a side-by-side measurement of the default (watched).
CONFIGS = (*DEFAULT_CONFIGS, "kvbranch-lowered")
TTFT_TARGET = 3.0  # vLLM's p50 TTFT of turns after the first over kvbranch's, behind one front
REUSE_TARGET = 95.0  # kvbranch's reuse, % of an unbounded cache's
MOVED_TARGET = 1.3  # a moved session's first turn (pulled) over a local host-store hit
SECRET = "replicas-bench-" + "0" * 50


class VanillaVLLM(ServerProcess):
    module = "tests.vanilla_vllm"


def pick(front: str, replicas: int, session: str, branch: str, sent: Counter[Any]) -> int:
    """The replica a request of ``session``/``branch`` goes to. ``affinity``: by a hash of the
    session id; ``round-robin``: the one after its branch's previous request's (with 2, every
    turn moves: an even spread at its worst for a session). ``sent``: requests per branch."""
    start = int.from_bytes(hashlib.sha256(session.encode()).digest()[:8], "big")
    if front == "affinity":
        return start % replicas
    sent[(session, branch)] += 1
    return (start + sent[(session, branch)] - 1) % replicas


class Front(httpx.AsyncBaseTransport):
    """A balancer in the client: each request readdressed to the replica :func:`pick` says."""

    def __init__(self, front: str, urls: list[str]) -> None:
        self.front, self.urls = front, [httpx.URL(u) for u in urls]
        self.sent: Counter[Any] = Counter()
        self.inner = httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content or b"{}")
        branch = (body.get(common.XARGS_FIELD) or {}).get(BRANCH_XARG, DEFAULT_BRANCH)
        session = str(body.get(common.SESSION_FIELD, ""))
        to = self.urls[pick(self.front, len(self.urls), session, branch, self.sent)]
        request.url = request.url.copy_with(scheme=to.scheme, host=to.host, port=to.port)
        request.headers["host"] = to.netloc.decode()
        return await self.inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self.inner.aclose()


def replica_core(i: int) -> str:
    """The core replica ``i`` is bound to: the cores this process may run on, in turn (with
    more replicas than cores, replicas share: 3 on 2 cores put replicas 0 and 2 on the first)."""
    try:
        cores = sorted(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        cores = list(range(os.cpu_count() or 1))
    return str(cores[i % len(cores)])


def replica(config: str, i: int, index: str, args: argparse.Namespace) -> ServerProcess:
    core = replica_core(i)
    sizes = ["--kv-cache-gib", str(args.kv_cache_gib), "--max-model-len", str(args.max_model_len)]
    name = f"replicas-{config}-{i}"
    if config == "vllm":
        env = {"VLLM_CPU_OMP_THREADS_BIND": core}
        return VanillaVLLM([*sizes, "--no-connector"], name=name, env=env, ready_timeout=1200)
    argv = [*sizes, "--host-store-gib", str(args.host_store_gib), "--index", index]
    argv += ["--cpu-cores", core, "--nixl-port", str(free_port())]
    argv += moved_turn.transport_args(args)
    if config == "kvbranch-lowered":
        argv += ["--nixl-threads", "lowered"]
    env = {ENV_CLUSTER_SECRET: SECRET, "PYTHONHASHSEED": "0"}
    return ServerProcess(argv, name=name, env=env, ready_timeout=1200)


async def run_set(
    front: str, config: str, args: argparse.Namespace, log: reporting.Progress
) -> dict[str, Any]:
    """Fresh replicas (and router) for one (front, config), the workload through the front."""
    from tests.redis_server import RedisServer

    out: dict[str, Any] = {"name": f"{config} {front}", "front": front, "config": config}
    redis = RedisServer().start()
    procs = [replica(config, i, redis.url, args) for i in range(args.replicas)]
    with server_set(procs, redis, out, out["name"], log):
        start_all(procs)
        urls = [p.url for p in procs]
        transport = None if front == "router" else Front(front, urls)
        if front == "router":
            seeds = [a for u in urls for a in ("--replica", u)]
            env = {ENV_CLUSTER_SECRET: SECRET}
            procs.append(ServerProcess(["--role", "router", "--index", redis.url, *seeds], env=env))
            procs[-1].start()
            urls = [procs[-1].url]
        log(f"[{out['name']}] ready; logs: {', '.join(str(p.log_path) for p in procs)}")
        async with httpx.AsyncClient(timeout=1800, transport=transport) as client:
            out["turns"] = await run_workload(client, urls[0], args, log, out["name"], False)
        if config != "vllm":
            out["replica_metrics"] = [peer_metrics(p) for p in procs[: args.replicas]]
            log(f"[{out['name']}] peer pulls: {out['replica_metrics']}")
    return out


#: The ``/metrics`` rows kept from each kvbranch replica after a workload: where its turns'
#: histories came from and what its pull-or-recompute decisions were (why a turn recomputed).
PEER_ROWS = ("kvbranch_peer_turns_total", "kvbranch_peer_pull_decisions_total")


def peer_metrics(proc: ServerProcess) -> dict[str, Any]:
    """A replica's peer-pull counters (:data:`PEER_ROWS`), by row with its labels."""
    try:
        text = httpx.get(proc.url + "/metrics", timeout=10).text
    except httpx.HTTPError as exc:
        return {"error": type(exc).__name__}

    def row(sample: Any) -> str | None:
        labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
        return f"{sample.name}{{{labels}}}" if sample.name in PEER_ROWS else None

    return sum_samples(text, row)


def start_all(procs: list[ServerProcess]) -> None:
    """Launch every server, then wait for each (they start side by side)."""
    for p in procs:
        p.launch()
    for p in procs:
        p.wait_ready()


@contextlib.contextmanager
def server_set(
    procs: list[ServerProcess], redis: Any, out: dict[str, Any], label: str, log: Any
) -> Iterator[None]:
    """The body (it starts ``procs``: :func:`start_all`); a failure is recorded in ``out``
    (the other sets still run; the report says why); every server in ``procs`` (also one the
    body appended) and ``redis`` stopped after."""
    try:
        yield
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
        log(f"[{label}] failed: {out['error']}")
    finally:
        for p in reversed(procs):
            p.stop()
        redis.close()


def reuse(turns: list[dict[str, Any]], fed_back: bool) -> tuple[int, int]:
    """(prompt tokens reused, what one instance with an unbounded cache could reuse) over the
    turns after the first: a turn's previous turn on its branch (a fork's first turn: its
    parent's), prompt and (``fed_back``) answer, at most all but one prompt token; a turn that
    says what it shares with the one before (``shared_tokens``: a trace's common blocks) that."""
    by = {(t["conversation"], t["branch"], t["turn"]): t for t in turns}
    got = ceiling = 0
    for (conv, branch, turn), t in by.items():
        prev = by.get((conv, branch, turn - 1)) or by.get((conv, DEFAULT_BRANCH, turn - 1))
        if turn > 1 and prev is not None:
            seen = prev["prompt_tokens"] + (prev["completion_tokens"] if fed_back else 0)
            seen = t.get("shared_tokens", seen)
            ceiling += min(seen, t["prompt_tokens"] - 1)
            got += t["prompt_tokens"] - t["recomputed_tokens"]
    return got, ceiling


def summary(res: dict[str, Any], args: argparse.Namespace) -> dict[str, float]:
    got, ceiling = reuse(res["turns"], args.workload not in ("bfcl", "mooncake"))
    return {
        "first": p50_ttft(res, 1, 1),
        "late": p50_ttft(res, 2),
        "reuse": 100.0 * got / ceiling if ceiling else float("nan"),
        "pulled": float(sum(t["remote_hit_tokens"] for t in res["turns"])),
    }


def records_of(results: list[dict[str, Any]], args: argparse.Namespace) -> list[Record]:
    done = [r for r in results if "turns" in r]
    sums = {r["name"]: summary(r, args) for r in done}
    note = f"{args.replicas} replicas, {shape(args)}, {args.kv_cache_gib:g} GiB KV each"
    # The forking agents' records on 2 replicas carry no prefix (the headline reads them);
    # another workload or replica count names itself, so that its numbers never stand in for
    # those as "the latest".
    at = "" if (args.workload, args.replicas) == ("agents", 2) else f"{shape(args)}: "
    if args.replicas != 2:
        at = f"{args.replicas} replicas, {at}"
    out = []
    for r in done:
        s, kv = sums[r["name"]], r["config"] != "vllm"
        met = s["reuse"] >= REUSE_TARGET if kv else None
        out.append(result(NAME, r["name"], at + "p50 TTFT turns >= 2", s["late"], "s", note=note))
        target = f">= {REUSE_TARGET:g}%" if kv else ""
        metric = at + "prompt tokens reused, % of unbounded cache"
        out.append(result(NAME, r["name"], metric, s["reuse"], "%", target, met, note=note))
        plain = sums.get(f"vllm {r['front']}")
        if kv and plain:
            x = plain["late"] / s["late"]
            config, target = f"vllm/{r['config']} {r['front']}", f">= {TTFT_TARGET:g}x"
            metric = at + "p50 TTFT turns >= 2 ratio"
            out.append(result(NAME, config, metric, x, "x", target, x >= TTFT_TARGET, note=note))
    moved, local = sums.get("kvbranch round-robin"), sums.get("kvbranch affinity")
    if moved and local:
        # Round robin moves every turn (pulled), affinity none; the ratio also carries where
        # each front queues a turn, so the target is judged by the probe (moved_turn.py).
        x, metric = moved["late"] / local["late"], at + "round robin / affinity, p50 TTFT"
        out.append(result(NAME, "kvbranch round-robin/affinity", metric, x, "x", note=note))
    if len(done) > 1:
        same, total, _ = answers(done)
        pct = 100.0 * same / total
        metric = at + "answers identical"
        out.append(result(NAME, "all", metric, pct, "%", "100%", same == total, note=note))
    return out


def probe_records(probes: list[dict[str, Any]], args: argparse.Namespace) -> list[Record]:
    """The moved-turn probe: a moved session's first turn over a local host-store hit, under
    the same background load; the target is judged for the default (``sync``) replicas'."""
    out = []
    for p in probes:
        if "rows" not in p:
            continue
        m = moved_turn.summary(p["rows"])
        note = (
            f"2 replicas, {args.probe_tokens}-token history, {args.probe_load} background "
            f"client(s) each, {m['probes']:g} probes: {m['pulled']:g} pulled, "
            f"{m['host_hits']:g} host-store hits; moved {m['moved']:.3f} s, "
            f"local {m['local']:.3f} s (p50)"
        )
        x = m["moved"] / m["local"]
        shipped = p["config"] == "sync"
        target = f"<= {MOVED_TARGET:g}x" if shipped else ""
        out.append(
            result(
                NAME,
                f"kvbranch probe ({p['config']} pulls)",
                "moved turn / local host-store hit, p50 TTFT",
                x,
                "x",
                target,
                x <= MOVED_TARGET if shipped else None,
                note=note,
            )
        )
    return out


async def run_probe_set(config: str, args: argparse.Namespace, log: reporting.Progress) -> dict:
    """Two fresh probe replicas (``config``: sync or async pulls) and the probes on them."""
    from tests.redis_server import RedisServer

    out: dict[str, Any] = {"config": config}
    redis = RedisServer().start()
    procs = moved_turn.replicas(config, redis.url, SECRET, [replica_core(i) for i in (0, 1)], args)
    with server_set(procs, redis, out, f"probe {config}", log):
        start_all(procs)
        log(f"[probe {config}] ready; logs: {', '.join(str(p.log_path) for p in procs)}")
        out["rows"] = await moved_turn.run_probes([p.url for p in procs], args, log, config)
    return out


def probe_report(probes: list[dict[str, Any]]) -> str:
    rows = []
    for p in probes:
        if "rows" not in p:
            rows.append([p["config"], p.get("error", "")[:80], "", "", ""])
            continue
        m = moved_turn.summary(p["rows"])
        ratio = f"{m['moved'] / m['local']:.2f}x"
        pulled = f"{m['pulled']:g}/{m['probes']:g} pulled, {m['host_hits']:g} host hits"
        rows.append([p["config"], f"{m['moved']:.3f}", f"{m['local']:.3f}", ratio, pulled])
    head = ["pulls", "moved turn p50 TTFT (s)", "local host-store hit (s)", "ratio", "checked"]
    return "Moved turn against a local host-store hit, under load:\n\n" + reporting.md_table(
        head, rows
    )


def report(results: list[dict[str, Any]], args: argparse.Namespace, info: Any, s: float) -> str:
    rows = []
    for r in results:
        if "turns" not in r:
            rows.append([r["front"], r["config"], r["error"][:80], "", "", ""])
            continue
        m = summary(r, args)
        rows.append([r["front"], r["config"], *(f"{m[k]:.3g}" for k in m)])
    head = ["front", "config", "p50 TTFT turn 1 (s)", "p50 TTFT turns >= 2 (s)"]
    head += ["reused, % of unbounded cache", "tokens pulled"]
    done = [r for r in results if "turns" in r]
    same, total, _ = answers(done) if done else (0, 0, {})
    lines = reporting.run_header(f"Aggregated replicas: {shape(args)}", info, s)
    lines += [reporting.md_table(head, rows), f"Answers identical in every run: {same}/{total}."]
    return "\n\n".join(lines) + "\n"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--front",
        nargs="*",
        default=list(FRONTS),
        choices=FRONTS,
        help="the fronts to run the workload behind (--front alone: none, only the "
        "moved-turn probes)",
    )
    parser.add_argument(
        "--configs",
        nargs="+",
        default=list(DEFAULT_CONFIGS),
        help=f"of {','.join(CONFIGS)} (default: {','.join(DEFAULT_CONFIGS)})",
    )
    add_workload_arguments(parser, default="agents")
    common.add_server_args(parser, kv_cache_gib=0.4, max_model_len=4096, host_store_gib=2.0)
    common.add_run_args(parser, seed=7, reserved_cpus=False)
    moved_turn.add_arguments(parser)


def run(args: argparse.Namespace) -> list[Record]:
    args.configs = [c for group in args.configs for c in group.split(",")]
    if set(args.configs) - set(CONFIGS):
        raise SystemExit(f"--configs: one of {CONFIGS}, not {args.configs}")
    log = reporting.Progress()
    info = reporting.machine_info_async()
    # Our router in front of plain vLLM is no configuration anyone runs (it reads what kvbranch
    # instances publish): plain vLLM replicas are measured behind the hashing fronts only.
    sets = [(f, c) for f in args.front for c in args.configs if (f, c) != ("router", "vllm")]
    results = [asyncio.run(run_set(f, c, args, log)) for f, c in sets]
    probes = (
        [asyncio.run(run_probe_set(c, args, log)) for c in args.probe_configs]
        if args.moved_probes > 0 and "kvbranch" in args.configs
        else []
    )
    raw = reporting.raw_path(NAME)
    reporting.write_json(raw, {"args": vars(args), "results": results, "probes": probes})
    text = report(results, args, info.result(), log.elapsed())
    if probes:
        text += "\n" + probe_report(probes) + "\n"
    reporting.publish(text, args.no_results)
    log(f"raw data: {raw}")
    return records_of(results, args) + probe_records(probes, args)


if __name__ == "__main__":
    raise SystemExit(cli.main([NAME, *sys.argv[1:]]))
