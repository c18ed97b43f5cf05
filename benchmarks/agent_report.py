"""The report of ``benchmarks/agent_workload.py``: per-configuration summaries (TTFT by turn
index, job completion times, prompt tokens by source, throughput, peak RSS), the TTFT-vs-turn
plot, the Markdown report with ratios against the first configuration of the run, and its records.

Apart from the workload and its runner so that each file reads as one job."""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import common, reporting
from benchmarks.records import Record, result
from benchmarks.reporting import median, percentile, ratio

NAME = "agent_workload"  # the records are the workload's (benchmarks/agent_workload.py)


# --- summary -------------------------------------------------------------------------------------
def summarize(res: dict) -> dict:
    recs = res["records"]
    by_turn: dict[int, list[float]] = {}
    for r in recs:
        by_turn.setdefault(r["turn"], []).append(r["ttft_s"])
    late = [r["ttft_s"] for r in recs if r["turn"] >= 5]
    tokens = {
        k: sum(r[f"{k}_tokens"] for r in recs)
        for k in ("prompt", "device_hit", "host_hit", "recomputed", "completion")
    }
    rec_ok = [
        r["recomputed_tokens"] <= r["new_tokens"] + common.GLUE_TOKENS
        for r in recs
        if r["turn"] >= 2
    ]
    return {
        "ttft_by_turn": {
            t: (percentile(v, 50), percentile(v, 95), len(v)) for t, v in sorted(by_turn.items())
        },
        "ttft_p50_late": median(late),
        "ttft_p95_late": percentile(late, 95),
        "ttft_p50_all": median([r["ttft_s"] for r in recs]),
        "jct": {j["session"]: j["jct_s"] for j in res["jct"]},
        "jct_mean": sum(j["jct_s"] for j in res["jct"]) / max(len(res["jct"]), 1),
        "tokens": tokens,
        "out_tps": tokens["completion"] / res["wall_s"] if res["wall_s"] else float("nan"),
        "recompute_ok": (sum(rec_ok), len(rec_ok)),
        "requests": len(recs),
    }


def plot(results: dict[str, dict], sums: dict[str, dict], path: Path, title: str) -> bool:
    plt = reporting.pyplot()
    if plt is None:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for i, name in enumerate(results):
        turns = list(sums[name]["ttft_by_turn"])
        p50 = [sums[name]["ttft_by_turn"][t][0] for t in turns]
        p95 = [sums[name]["ttft_by_turn"][t][1] for t in turns]
        color = f"C{i}"
        ax.plot(turns, p50, marker="o", color=color, label=f"{name} p50")
        ax.plot(turns, p95, linestyle="--", color=color, alpha=0.5, label=f"{name} p95")
    reporting.save_plot(fig, ax, path, "turn index", "TTFT (s)", title)
    return True


def report(
    args: argparse.Namespace,
    workload: dict,
    results: dict[str, dict],
    sums: dict[str, dict],
    info: dict,
    elapsed: float,
    png: Path | None,
    raw: Path,
    wl_path: Path,
) -> str:
    """The run's Markdown report. Ratios are against the first configuration of the run (plain
    vLLM unless --configs says otherwise, e.g. "pd,pd-kvbranch": upstream P/D against kvbranch
    P/D)."""
    lines = [
        *reporting.run_header(f"agent_workload ({args.profile})", info, elapsed),
        workload_line(args, workload),
        *reporting.conditions_md(
            [r["extra"].get("load1", 0.0) for res in results.values() for r in res["records"]],
            args.reserved_cpus,
            {n: r.get("omp") for n, r in results.items()},
        ),
        f"- Workload file: `{wl_path.relative_to(reporting.ROOT)}`, raw data: "
        f"`{raw.relative_to(reporting.ROOT)}` (not committed)",
    ]
    if png:
        lines.append(f"- Plot: `{png.name}`")
    lines.append("")
    lines += turn_table(sums)
    lines += config_table(results, sums)
    lines += jct_table(sums)
    lines += ratio_lines(args, results, sums)
    lines += server_lines(results)
    if len(results) > 1:
        lines.append(identical_line(results))
    return "\n".join(lines) + "\n"


def workload_line(args: argparse.Namespace, workload: dict) -> str:
    p = workload["params"]
    return (
        f"- Workload: {p['sessions']} concurrent sessions x {p['turns']} turns, shared "
        f"system prompt {workload.get('system_tokens_actual', p['system_tokens'])} tokens "
        f"with {p['tools']} tool schemas, "
        f"~{p['obs_tokens']} observation tokens per turn, {args.gen_tokens} greedy output "
        f"tokens per turn, tool pauses {p['pause_min']}-{p['pause_max']} s, "
        + (
            f"fork at turn {workload['fork_turn']} into {p['branches']} alternatives, "
            if workload["fork_turn"]
            else "no fork, "
        )
        + f"seed {p['seed']}; device KV {args.kv_cache_gib} GiB "
        f"(~{int(args.kv_cache_gib * 23000)} tokens), host store {args.host_store_gib} GiB, "
        f"max-model-len {args.max_model_len}; streaming, TTFT at first content token"
    )


def turn_table(sums: dict[str, dict]) -> list[str]:
    """TTFT p50 / p95 per turn index and configuration, with the first configuration's p50
    over each other's."""
    names = list(sums)
    base_name, base = names[0], sums[names[0]]
    others = names[1:]
    turns = sorted({t for s in sums.values() for t in s["ttft_by_turn"]})
    header = ["turn", "n"] + [f"{n} p50 / p95 s" for n in names]
    header += [f"{base_name}/{n} p50" for n in others]
    rows = []
    for t in turns:
        row = [t, max(s["ttft_by_turn"].get(t, (0, 0, 0))[2] for s in sums.values())]
        for n in names:
            v = sums[n]["ttft_by_turn"].get(t)
            row.append(f"{v[0]:.2f} / {v[1]:.2f}" if v else "-")
        for n in others:
            a, b = base["ttft_by_turn"].get(t), sums[n]["ttft_by_turn"].get(t)
            row.append(ratio(a[0], b[0]) if a and b else "-")
        rows.append(row)
    return ["TTFT per turn index (all sessions and branches):\n", reporting.md_table(header, rows)]


def config_table(results: dict[str, dict], sums: dict[str, dict]) -> list[str]:
    header = [
        "config",
        "TTFT p50 turns>=5 s",
        "p95 turns>=5 s",
        "mean JCT s",
        "wall s",
        "out tok/s",
        "prompt tok",
        "device",
        "host",
        "recomputed",
        "peak server RSS GiB",
        "requests",
        "errors",
    ]
    rows = []
    for n, r in results.items():
        s = sums[n]
        tk = s["tokens"]
        rows.append(
            [
                n,
                s["ttft_p50_late"],
                s["ttft_p95_late"],
                s["jct_mean"],
                r["wall_s"],
                s["out_tps"],
                tk["prompt"],
                tk["device_hit"],
                tk["host_hit"],
                tk["recomputed"],
                f"{r['peak_rss_bytes'] / (1 << 30):.2f}",
                s["requests"],
                len(r["errors"]),
            ]
        )
    first = next(iter(results.values()))
    return [
        "Per configuration (prompt tokens by source from the server's accounting; "
        "peak RSS summed over the server's process group via "
        f"{first['mem_method']}):\n",
        reporting.md_table(header, rows),
    ]


def jct_table(sums: dict[str, dict]) -> list[str]:
    names = list(sums)
    header = ["session"] + [f"{n} JCT s" for n in names]
    rows = [
        [sid] + [sums[n]["jct"].get(sid, float("nan")) for n in names]
        for sid in sums[names[0]]["jct"]
    ]
    return ["Job completion time per session:\n", reporting.md_table(header, rows)]


def ratio_lines(
    args: argparse.Namespace, results: dict[str, dict], sums: dict[str, dict]
) -> list[str]:
    """Each configuration against the first: its ratios, and the targets where it is kvbranch
    and the first is not."""
    base_name, *others = list(results)
    base = sums[base_name]
    lines = []
    for n in others:
        s = sums[n]
        plain_rss = results[base_name]["peak_rss_bytes"]
        r_late = base["ttft_p50_late"] / s["ttft_p50_late"] if s["ttft_p50_late"] else 0
        lines.append(
            f"- Ratios {base_name}/{n}: TTFT p50 turns>=5 {r_late:.2f}x, TTFT p95 turns>=5 "
            f"{ratio(base['ttft_p95_late'], s['ttft_p95_late'])}, mean JCT "
            f"{ratio(base['jct_mean'], s['jct_mean'])}, recomputed prompt tokens "
            f"{ratio(base['tokens']['recomputed'], s['tokens']['recomputed'])}; "
            f"{n}/{base_name} output tok/s {ratio(s['out_tps'], base['out_tps'])}, peak "
            f"RSS {ratio(results[n]['peak_rss_bytes'], plain_rss)}"
        )
        if not results[n]["kvbranch"] or results[base_name]["kvbranch"]:
            continue  # the targets compare a kvbranch configuration with one without
        lines.append(
            f"- Target (memory-pressure profile) kvbranch p50 TTFT at turns >= 5 at "
            f"least 3.3x lower than plain: {'MET' if r_late >= 3.3 else 'NOT MET'} "
            f"({r_late:.2f}x, profile {args.profile})"
        )
        ok, tot = s["recompute_ok"]
        lines.append(
            f"- Target recomputed prompt tokens <= new tokens + {common.GLUE_TOKENS} per turn "
            f"({n}, turns >= 2): {'MET' if ok == tot else 'NOT MET'} ({ok}/{tot} "
            "requests)"
        )
    return lines


def server_lines(results: dict[str, dict]) -> list[str]:
    """Each kvbranch configuration's prefetches, forks and server counters; every errors."""
    lines = []
    for n, r in results.items():
        if r["kvbranch"]:
            st = r.get("stats")
            pf = r["prefetches"]
            lat = median([x["latency_s"] for x in pf])
            lines.append(
                f"- {n}: {len(pf)} prefetch calls (median route latency {lat * 1000:.0f} "
                f"ms, statuses {sorted({x['status'] for x in pf})}), {len(r['forks'])} "
                f"forks (statuses {sorted({x['status'] for x in r['forks']})}); server: "
                + (common.describe_stats(st) if st else "no stats")
            )
        if r["errors"]:
            lines.append(f"- {n} errors: {r['errors'][:5]}")
    return lines


def identical_line(results: dict[str, dict]) -> str:
    """How many requests every configuration answered alike (greedy: all of them)."""
    outs = {
        n: {(x["session"], x["branch"], x["turn"]): x["content"] for x in r["records"]}
        for n, r in results.items()
    }
    keys = set.intersection(*(set(o) for o in outs.values()))
    same = sum(1 for k in keys if len({o[k] for o in outs.values()}) == 1)
    return f"- Greedy outputs identical across configurations: {same}/{len(keys)} requests"


#: Issue 14's target for the memory-pressure profile: plain/kvbranch p50 TTFT at turns >= 5.
LATE_TTFT_TARGET = 3.3


def records_of(
    args: argparse.Namespace,
    workload: dict,
    results: dict[str, dict],
    sums: dict[str, dict],
    png: Path | None,
) -> list[Record]:
    """The run's results: p50 TTFT at turns >= 5 per configuration, and each kvbranch
    configuration's ratios and targets against the first configuration (named by profile,
    sessions x turns and device budget, so that profiles keep their own latest numbers)."""
    p = workload["params"]
    prefix = f"{args.profile} {p['sessions']}x{p['turns']}, {args.kv_cache_gib} GiB: "
    plots = reporting.plot_ref(png)
    names = list(sums)
    late_p50 = prefix + "p50 TTFT turns >= 5"
    out = [result(NAME, n, late_p50, sums[n]["ttft_p50_late"], "s", plots=plots) for n in names]
    base_name = names[0]
    base = sums[base_name]
    for n in names[1:]:
        s = sums[n]
        pair = f"{base_name}/{n}"
        late = base["ttft_p50_late"] / s["ttft_p50_late"] if s["ttft_p50_late"] else float("nan")
        targeted = results[n]["kvbranch"] and not results[base_name]["kvbranch"]
        out.append(
            result(
                NAME,
                pair,
                late_p50,
                late,
                "x",
                target=f">= {LATE_TTFT_TARGET}x (memory-pressure profile)" if targeted else "",
                met=late >= LATE_TTFT_TARGET if targeted else None,
                plots=plots,
            )
        )
        if base["jct_mean"] and s["jct_mean"]:
            out.append(
                result(NAME, pair, prefix + "mean JCT", base["jct_mean"] / s["jct_mean"], "x")
            )
        if targeted:
            ok, tot = s["recompute_ok"]
            out.append(
                result(
                    NAME,
                    n,
                    prefix + f"requests with recomputed <= new + {common.GLUE_TOKENS} "
                    f"(turns >= 2, of {tot})",
                    ok,
                    "requests",
                    target=f"all {tot}",
                    met=ok == tot,
                )
            )
    return out
