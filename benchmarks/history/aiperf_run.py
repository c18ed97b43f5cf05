"""NVIDIA's aiperf (a third-party load generator) running its multi-turn chat workload against
plain vLLM and kvbranch, side by side, scaled to a 2-core machine and the embedded model.

    python3 -m venv benchmarks/.aiperf-venv                        # aiperf in its own venv
    benchmarks/.aiperf-venv/bin/pip install aiperf==0.13.0
    .venv/bin/python -m benchmarks.history.aiperf_run                      # 4 sessions x 4 turns

Each configuration gets a fresh server (the same core reservation and device KV budget as the
other benchmarks: ``benchmarks/common.py``), then ``aiperf profile`` runs S synthetic
conversations of T turns each (aiperf keeps each conversation's history and sends it again
with every turn, as a chat client does), C conversations at a time, with a think time between
turns; aiperf sends each conversation's id in the ``X-Session-ID`` header
(``--session-header``), which kvbranch maps to a session and plain vLLM ignores. Both
configurations get the same seeded dataset. aiperf's own numbers (TTFT, latency, throughput,
from its ``profile_export_aiperf.json`` and per-request ``profile_export.jsonl``) go into the
report, with kvbranch's prompt-token accounting from ``/v1/kvbranch/stats``.

aiperf lives in its own venv (it pins versions of its own); only its command line is used.
Artifacts: benchmarks/out/aiperf-<time>/<config>/; the report is printed and the
records written to benchmarks/results/ (unless --no-results).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import cli, common, reporting  # noqa: E402
from benchmarks.records import Record, result  # noqa: E402
from sdk.contract import SESSION_HEADER  # noqa: E402

NAME = "aiperf_run"
DESCRIPTION = "NVIDIA aiperf's multi-turn chat workload against plain vLLM and kvbranch"
AIPERF = reporting.BENCH_DIR / ".aiperf-venv" / "bin" / "aiperf"
#: aiperf's record metrics shown per configuration (its names; values in its units).
METRICS = (
    "time_to_first_token",
    "request_latency",
    "inter_token_latency",
    "output_token_throughput",
    "request_throughput",
)


#: The workload, scaled to 2 cores and the embedded model: flag, default, meaning.
WORKLOAD = (
    ("--sessions", 4, "conversations"),
    ("--turns", 4, "turns per conversation"),
    ("--concurrency", 4, "conversations at a time"),
    ("--isl", 200, "new user tokens per turn"),
    ("--osl", 16, "output tokens per turn"),
    ("--system-tokens", 400, "shared system prompt tokens"),
    ("--turn-delay-ms", 2000, "think time between turns"),
)


def aiperf_command(args: argparse.Namespace, url: str, artifacts: Path) -> list[str]:
    from server.launcher.model_cache import ensure_model

    return [
        str(args.aiperf),
        "profile",
        "--model",
        common.MODEL_NAME,
        "--url",
        url,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        str(ensure_model()),
        "--conversation-num",
        str(args.sessions),
        "--conversation-turn-mean",
        str(args.turns),
        "--conversation-turn-stddev",
        "0",
        "--conversation-turn-delay-mean",
        str(args.turn_delay_ms),
        "--conversation-turn-delay-stddev",
        "0",
        "--concurrency",
        str(args.concurrency),
        "--isl",
        str(args.isl),
        "--isl-stddev",
        "0",
        "--osl",
        str(args.osl),
        "--shared-system-prompt-length",
        str(args.system_tokens),
        "--prompt-corpus",
        "coding",
        "--session-header",
        SESSION_HEADER,
        "--extra-inputs",
        "temperature:0",
        "--extra-inputs",
        "ignore_eos:true",
        "--use-server-token-count",
        "--random-seed",
        str(args.seed),
        "--workers-max",
        "1",
        "--record-processors",
        "1",
        "--ui-type",
        "none",
        "--no-gpu-telemetry",
        "--artifact-dir",
        str(artifacts),
    ]


def run_aiperf(cmd: list[str], artifacts: Path, timeout_s: float) -> dict[str, Any]:
    artifacts.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    # Not HF_HUB_OFFLINE: aiperf 0.13's offline path looks the tokenizer up as a hub repo id
    # and rejects a local folder; the online path loads the folder without any network call.
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        env.pop(name, None)
    t0 = time.monotonic()
    with (artifacts / "aiperf.log").open("w") as log:
        proc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, cwd=artifacts
        )
    return {"rc": proc.returncode, "wall_s": time.monotonic() - t0}


def _find(artifacts: Path, name: str) -> Path | None:
    found = sorted(artifacts.rglob(name))
    return found[0] if found else None


def read_summary(artifacts: Path) -> dict[str, dict[str, Any]]:
    """aiperf's aggregate metrics: ``{metric: {"unit": ..., "avg": ..., "p50": ...}}``."""
    path = _find(artifacts, "profile_export_aiperf.json")
    if path is None:
        return {}
    data = json.loads(path.read_text())
    records = data.get("records", data)
    out = {}
    for name in METRICS:
        entry = records.get(name) if isinstance(records, dict) else None
        if isinstance(entry, dict):
            out[name] = entry
    return out


#: vLLM counters read from aiperf's own scrape of the server's /metrics (its server-metrics
#: export), so plain vLLM's prefix-cache reuse is reported the same way as kvbranch's.
VLLM_COUNTERS = (
    "vllm:prompt_tokens",
    "vllm:prefix_cache_queries",
    "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_hits",
)


def read_server_counters(artifacts: Path) -> dict[str, float]:
    """Counter totals over the run from aiperf's scrape of ``/metrics``: vLLM's prompt and
    prefix-cache counters, and kvbranch's prompt tokens by source (``source:<name>``)."""
    path = _find(artifacts, "server_metrics_export.json")
    if path is None:
        return {}
    metrics = json.loads(path.read_text()).get("metrics") or {}
    out: dict[str, float] = {}
    for name in (*VLLM_COUNTERS, "kvbranch_prompt_tokens"):
        for series in (metrics.get(name) or {}).get("series") or []:
            total = (series.get("stats") or {}).get("total")
            if not isinstance(total, (int, float)):
                continue
            source = (series.get("labels") or {}).get("source")
            key = f"source:{source}" if name == "kvbranch_prompt_tokens" else name
            out[key] = out.get(key, 0.0) + float(total)
    return out


def read_turns(artifacts: Path) -> dict[int, list[float]]:
    """TTFT (ms) of every request by its turn index (0-based), from aiperf's per-request
    export."""
    path = _find(artifacts, "profile_export.jsonl")
    by_turn: dict[int, list[float]] = {}
    if path is None:
        return by_turn
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        rec = json.loads(line)
        meta, metrics = rec.get("metadata") or {}, rec.get("metrics") or {}
        ttft = metrics.get("time_to_first_token")
        value = ttft.get("value") if isinstance(ttft, dict) else ttft
        if value is None or meta.get("turn_index") is None:
            continue
        by_turn.setdefault(int(meta["turn_index"]), []).append(float(value))
    return by_turn


def run_config(
    name: str, args: argparse.Namespace, out_dir: Path, log: reporting.Progress
) -> dict[str, Any]:
    connector = name == "kvbranch"
    server = common.start_server(
        name,
        common.server_args(connector, args.kv_cache_gib, args.host_store_gib, args.max_model_len),
        reserved_cpus=args.reserved_cpus,
    )
    artifacts = out_dir / name
    cmd = aiperf_command(args, server.url, artifacts)
    loads = [os.getloadavg()[0]]
    try:
        log(f"[{name}] {shlex.join(cmd)}")
        ran = run_aiperf(cmd, artifacts, args.timeout_s)
        loads.append(os.getloadavg()[0])
        log(f"[{name}] aiperf exit {ran['rc']} after {ran['wall_s']:.0f}s")
        stats = asyncio.run(_stats(server.url)) if connector else None
        binding = common.omp_binding(server)
    finally:
        server.stop()
    return {
        "name": name,
        "cmd": cmd,
        **ran,
        "summary": read_summary(artifacts),
        "turns": read_turns(artifacts),
        "counters": read_server_counters(artifacts),
        "stats": stats,
        "omp": binding,
        "load1": loads,
        "artifacts": str(artifacts.relative_to(reporting.ROOT)),
    }


async def _stats(url: str) -> Any:
    async with httpx.AsyncClient() as client:
        return await common.get_stats(client, url)


def _stat(result: dict[str, Any], metric: str, key: str) -> float:
    value = (result["summary"].get(metric) or {}).get(key)
    return float(value) if isinstance(value, (int, float)) else float("nan")


def _metrics_table(results: dict[str, dict]) -> str:
    names = list(results)
    header = ["aiperf metric"] + [f"{n} avg / p50 / p90" for n in names]
    if len(names) > 1:
        header.append(f"{names[0]}/{names[1]} avg")
    rows = []
    for metric in METRICS:
        units = [
            str(r["summary"][metric].get("unit", ""))
            for r in results.values()
            if r["summary"].get(metric)
        ]
        row: list[Any] = [f"{metric} ({units[0] if units else '?'})"]
        for n in names:
            values = [_stat(results[n], metric, k) for k in ("avg", "p50", "p90")]
            row.append(" / ".join(f"{v:.1f}" for v in values if v == v) or "-")
        if len(names) > 1:
            a, b = (_stat(results[n], metric, "avg") for n in names[:2])
            row.append(reporting.ratio(a, b))
        rows.append(row)
    return reporting.md_table(header, rows)


def _turns_table(results: dict[str, dict]) -> str:
    names = list(results)
    turns = sorted({t for r in results.values() for t in r["turns"]})
    header = ["turn", "requests"] + [f"{n} TTFT p50 ms" for n in names]
    if len(names) > 1:
        header.append(f"{names[0]}/{names[1]}")
    rows = []
    for t in turns:
        p50 = [reporting.median(results[n]["turns"].get(t, [])) for n in names]
        row: list[Any] = [t + 1, max(len(r["turns"].get(t, [])) for r in results.values())]
        row += p50 + ([reporting.ratio(p50[0], p50[1])] if len(names) > 1 else [])
        rows.append(row)
    return reporting.md_table(header, rows)


def _tokens_table(results: dict[str, dict]) -> str:
    """Prompt tokens by where their KV came from, from the servers' own counters."""
    rows = []
    for n, r in results.items():
        c = r["counters"]
        if "source:recomputed" in c:  # kvbranch: its own accounting
            split = [c.get(f"source:{k}", 0.0) for k in ("device", "host", "remote", "recomputed")]
        else:  # plain vLLM: prefix-cache hits are all on the device
            hits = c.get("vllm:prefix_cache_hits", 0.0)
            split = [hits, 0.0, 0.0, c.get("vllm:prefix_cache_queries", 0.0) - hits]
        rows.append([n, int(c.get("vllm:prompt_tokens", 0)), *(int(x) for x in split)])
    return reporting.md_table(
        ["config", "prompt tokens", "device", "host", "remote", "recomputed"], rows
    )


def report(
    args: argparse.Namespace, results: dict[str, dict], info: dict[str, str], elapsed: float
) -> str:
    names = list(results)
    first = results[names[0]]
    shown = shlex.join(first["cmd"]).replace(str(args.aiperf), "benchmarks/.aiperf-venv/bin/aiperf")
    shown = shown.replace(str(reporting.ROOT) + "/", "")
    lines = [
        *reporting.run_header(
            f"aiperf multi-turn (NVIDIA aiperf {args.aiperf_version})", info, elapsed
        ),
        f"- aiperf command ({names[0]}; the other configuration differs only in --url and "
        f"--artifact-dir): `{shown}`",
        f"- Workload: {args.sessions} synthetic conversations x {args.turns} turns, "
        f"{args.concurrency} at a time, ~{args.isl} new user tokens and {args.osl} output "
        f"tokens per turn (ignore_eos, greedy), shared system prompt {args.system_tokens} "
        f"tokens, {args.turn_delay_ms} ms between turns, history resent every turn, session "
        f"id in `{SESSION_HEADER}`; device KV {args.kv_cache_gib} GiB "
        f"(~{int(args.kv_cache_gib * 23000)} tokens), host store {args.host_store_gib} GiB, "
        f"max-model-len {args.max_model_len}",
        *reporting.conditions_md(
            [x for r in results.values() for x in r["load1"]],
            args.reserved_cpus,
            {n: r["omp"] for n, r in results.items()},
        ),
        "- Not a quiet run: the machine is shared with other developers' servers and tests "
        "(see the load average); compare the configurations side by side, not the absolute "
        "times.",
        f"- Artifacts: `{first['artifacts'].rsplit('/', 1)[0]}/<config>/` (not committed)",
        "",
        _metrics_table(results),
        "TTFT by turn (aiperf's per-request export):\n",
        _turns_table(results),
        "Prompt tokens by where their KV came from (the servers' counters, scraped by aiperf "
        "from `/metrics`):\n",
        _tokens_table(results),
    ]
    for n, r in results.items():
        if r["rc"] != 0:
            lines.append(f"- {n}: aiperf exited {r['rc']} (log `{r['artifacts']}/aiperf.log`)")
        if r["stats"] is not None:
            lines.append(f"- {n} server at the end: {common.describe_stats(r['stats'])}")
    return "\n".join(lines) + "\n"


def records_of(results: dict[str, dict]) -> list[Record]:
    """Mean TTFT over all turns and p50 TTFT at the last turn per configuration, and the
    first configuration's over the second's (aiperf's own numbers, ms)."""
    out: list[Record] = []
    last_turn: dict[str, float] = {}
    for name, res in results.items():
        mean = _stat(res, "time_to_first_token", "avg")
        out.append(result(NAME, name, "mean TTFT, all turns", mean, "ms"))
        if res["turns"]:
            t = max(res["turns"])
            last_turn[name] = reporting.median(res["turns"][t])
            out.append(result(NAME, name, f"p50 TTFT at turn {t + 1}", last_turn[name], "ms"))
    names = list(results)
    if len(names) > 1:
        a, b = names[0], names[1]
        mean_a = _stat(results[a], "time_to_first_token", "avg")
        mean_b = _stat(results[b], "time_to_first_token", "avg")
        out.append(result(NAME, f"{a}/{b}", "mean TTFT, all turns", mean_a / mean_b, "x"))
        if a in last_turn and b in last_turn:
            t = max(results[a]["turns"])
            ratio = last_turn[a] / last_turn[b]
            out.append(result(NAME, f"{a}/{b}", f"p50 TTFT at turn {t + 1}", ratio, "x"))
    return out


def add_arguments(ap: argparse.ArgumentParser) -> None:
    for flag, default, text in WORKLOAD:
        ap.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    common.add_server_args(ap, 0.1, 2048, 2.0)
    ap.add_argument("--configs", default="plain,kvbranch", help="run in this order")
    ap.add_argument("--aiperf", type=Path, default=AIPERF, help="the aiperf command")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per aiperf run")
    common.add_run_args(ap)


def run(args: argparse.Namespace) -> list[Record]:
    if not args.aiperf.exists():
        raise SystemExit(f"{args.aiperf} not found: install aiperf in its own venv (see --help)")
    args.aiperf_version = subprocess.run(
        [str(args.aiperf), "--version"], capture_output=True, text=True, timeout=120
    ).stdout.strip().splitlines()[-1:] or ["?"]
    args.aiperf_version = args.aiperf_version[0]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in ("plain", "kvbranch"):
            raise SystemExit(f"unknown config {c!r} (plain, kvbranch)")

    log = reporting.Progress()
    info_job = reporting.machine_info_async()
    out_dir = reporting.raw_path("aiperf").with_suffix("")
    results = {name: run_config(name, args, out_dir, log) for name in configs}
    info = info_job.result()
    reporting.write_json(
        out_dir / "results.json", {"args": vars(args), "machine": info, "results": results}
    )
    reporting.publish(report(args, results, info, log.elapsed()), args.no_results)
    failed = [n for n, r in results.items() if r["rc"] != 0]
    if failed:
        raise SystemExit(f"aiperf failed for {', '.join(failed)}: no records (see the report)")
    return records_of(results)


if __name__ == "__main__":
    raise SystemExit(cli.run_study(sys.modules[__name__], sys.argv[1:]))
