"""Multi-turn TTFT on prefill/decode disaggregation, side by side in one run:

* ``pd``             — upstream P/D: vLLM's NixlConnector, no D->P pull (P recomputes what its
                       own prefix cache lacks: the last partial block and D's generated tokens);
* ``pd-kvbranch``    — kvbranch P/D: NIXL bidirectional + token-prefix check + host store, with
                       the kvbranch router carrying D's params from turn N to N+1;
* ``single-kvbranch``— one kvbranch instance on one core (the same compute as each P/D instance);
* ``single-plain``   — one plain vLLM instance on one core (P/D's own overhead is measured
                       against it);
* ``pd-kvbranch-sched`` (opt-in) — kvbranch P/D with ``--agent-priority`` (off by default on P/D
                       instances since 2026-12-03, docs/scheduling.md "On P/D").

    .venv/bin/python -m benchmarks pd_turns                 # ~15 minutes on 2 cores
    .venv/bin/python -m benchmarks pd_turns --conversations 2 --turns 4   # quicker
    .venv/bin/python -m benchmarks pd_turns --interleave --kv-cache-gib 0.1  # under pressure

Every configuration gets fresh servers on the same cores (P on core 0, D on core 1; single on
core 0). Conversations run one after the other; each turn adds a tool observation of
``--new-tokens`` tokens and generates ``--gen-tokens``; TTFT is measured at the first streamed
content token through the router (or the single server). Greedy outputs are compared across
configurations turn by turn.

Raw data: benchmarks/out/pd_turns-<time>.json; plot: benchmarks/plots/pd_turns.png; the report is
printed and the records written to benchmarks/results/ (unless --no-results).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import cli, common, reporting  # noqa: E402
from benchmarks.records import Record, result  # noqa: E402
from benchmarks.textgen import text_of_tokens  # noqa: E402

NAME = "pd_turns"
DESCRIPTION = (
    "multi-turn TTFT on prefill/decode disaggregation: upstream P/D vs kvbranch P/D vs single "
    "instances"
)
#: The targets: kvbranch P/D's p50 TTFT at turns >= 3 this much lower than upstream P/D's, and
#: turn 1 (nothing to reuse) within 3% of it.
PD_TARGET = 1.6
TURN1_TARGET = 1.03

CONFIGS = {
    "pd": ["--disagg", "--no-connector", "--no-bidirectional"],
    "pd-kvbranch": ["--disagg"],
    "single-kvbranch": ["--cpu-cores", "0"],
    "single-plain": ["--cpu-cores", "0", "--no-connector"],
    # kvbranch P/D with agent-aware scheduling (off by default on P/D instances).
    "pd-kvbranch-sched": ["--disagg", "--agent-priority"],
}
#: Opt-in: the same with vLLM's own 1 s message-queue busy-wait (the launcher's default is 2 ms,
#: server/engine/spin.py), for the side-by-side measurement of that default.
#: And with vLLM's own 1 ms poll of an engine that only holds blocks for its peer (the launcher's
#: default is 20 ms and a new request ends it at once, server/engine/idle.py).
for _name in list(CONFIGS):
    CONFIGS[f"{_name}-spin1000"] = [*CONFIGS[_name], "--mq-spin-ms", "1000"]
    CONFIGS[f"{_name}-poll1"] = [*CONFIGS[_name], "--idle-poll-ms", "0"]
DEFAULT_CONFIGS = ["pd", "pd-kvbranch", "single-kvbranch", "single-plain"]


def conversation_turns(
    seed: int, turns: int, system_tokens: int, new_tokens: int
) -> tuple[str, list[str]]:
    rng = random.Random(seed)
    system = "You are an agent that uses tools. Notes: " + text_of_tokens(rng, system_tokens)
    users = [f"Task {seed}: inspect the logs and report." + text_of_tokens(rng, 40)]
    users += [
        f"Tool result {t}: " + text_of_tokens(rng, new_tokens, style="observation")
        for t in range(1, turns)
    ]
    return system, users


async def run_config(name: str, args: argparse.Namespace, log: reporting.Progress) -> dict:
    server_args = [
        "--kv-cache-gib",
        str(args.kv_cache_gib),
        "--max-model-len",
        str(args.max_model_len),
        *CONFIGS[name],
    ]
    server = common.start_server(f"bench-{name}", server_args, reserved_cpus=None)
    turns: list[dict] = []
    convs = {
        conv: conversation_turns(args.seed + conv, args.turns, args.system_tokens, args.new_tokens)
        for conv in range(args.conversations)
    }
    history = {conv: [{"role": "system", "content": system}] for conv, (system, _) in convs.items()}
    try:
        async with httpx.AsyncClient(timeout=1800) as client:
            for conv, turn in turn_order(args.conversations, args.turns, args.interleave):
                messages = history[conv]
                messages.append({"role": "user", "content": convs[conv][1][turn - 1]})
                body = common.greedy_turn(messages, args.gen_tokens, f"pd-bench-{conv}")
                res = await common.stream_chat(client, server.url, body)
                turns.append(common.turn_row(res, conversation=conv, turn=turn))
                log(
                    f"[{name}] conv {conv} turn {turn}: TTFT {res.ttft_s:.2f}s, prompt "
                    f"{res.prompt_tokens} (device {res.device_hit_tokens}, host "
                    f"{res.host_hit_tokens}, remote {res.remote_hit_tokens}, recomputed "
                    f"{res.recomputed_tokens})"
                )
                messages.append({"role": "assistant", "content": res.content})
    finally:
        server.stop()
    return {"name": name, "server_args": server_args, "turns": turns}


def turn_order(conversations: int, turns: int, interleave: bool) -> list[tuple[int, int]]:
    """(conversation, turn) in request order: each conversation to its end, or (``interleave``)
    turn t of every conversation before turn t+1 of any, so that the others' turns pass
    between two turns of one conversation."""
    if interleave:
        return [(c, t) for t in range(1, turns + 1) for c in range(conversations)]
    return [(c, t) for c in range(conversations) for t in range(1, turns + 1)]


def mean_ttft(result: dict, first_turn: int) -> float:
    values = [t["ttft_s"] for t in result["turns"] if t["turn"] >= first_turn]
    return statistics.fmean(values) if values else float("nan")


def p50_ttft(result: dict, first_turn: int) -> float:
    values = [t["ttft_s"] for t in result["turns"] if t["turn"] >= first_turn]
    return statistics.median(values) if values else float("nan")


def per_turn_median(result: dict, turn: int) -> float:
    values = [t["ttft_s"] for t in result["turns"] if t["turn"] == turn]
    return statistics.median(values) if values else float("nan")


def plot(results: list[dict], turns: int, path: Path) -> None:
    plt = reporting.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    xs = list(range(1, turns + 1))
    for res in results:
        ax.plot(xs, [per_turn_median(res, t) for t in xs], marker="o", label=res["name"])
    reporting.save_plot(
        fig,
        ax,
        path,
        "turn",
        "median TTFT (s)",
        "Multi-turn TTFT: P/D with and without the D->P pull",
        dpi=120,
    )


def report(results: list[dict], args: argparse.Namespace, info: dict, elapsed: float) -> str:
    by = {r["name"]: r for r in results}
    header = ["turn", *[r["name"] for r in results]]
    rows = [
        [t, *[f"{per_turn_median(r, t):.2f}" for r in results]] for t in range(1, args.turns + 1)
    ]
    means = {r["name"]: mean_ttft(r, 2) for r in results}
    summary = [["mean TTFT turns >= 2 (s)", *[f"{means[r['name']]:.2f}" for r in results]]]
    rec = [
        [
            "recomputed prompt tokens, turns >= 2",
            *[
                str(sum(t["recomputed_tokens"] for t in r["turns"] if t["turn"] >= 2))
                for r in results
            ],
        ],
        [
            "tokens pulled from D (remote hits)",
            *[str(sum(t["remote_hit_tokens"] for t in r["turns"])) for r in results],
        ],
        [
            "median 1-min load average at requests (2 cores = 2.0)",
            *[f"{statistics.median([t['load1'] or 0 for t in r['turns']]):.1f}" for r in results],
        ],
    ]
    lines = [
        *reporting.run_header("pd_turns", info, elapsed),
        f"- {args.conversations} conversations x {args.turns} turns, system prompt "
        f"~{args.system_tokens} tokens, ~{args.new_tokens} new tokens and "
        f"{args.gen_tokens} generated tokens per turn; "
        + (
            "conversations interleaved turn by turn; "
            if args.interleave
            else "conversations one at a time; "
        )
        + f"device KV {args.kv_cache_gib} GiB per instance; "
        "P on core 0, D on core 1, single instances on core 0.",
        "",
        "Median TTFT per turn (s):",
        "",
        reporting.md_table(header, rows),
        "",
        reporting.md_table(["", *[r["name"] for r in results]], summary + rec),
        "",
    ]
    if "pd" in by and "pd-kvbranch" in by and max(t["turn"] for t in by["pd"]["turns"]) >= 3:
        p50 = {n: p50_ttft(by[n], 3) for n in ("pd", "pd-kvbranch")}
        lines.append(
            f"- p50 TTFT at turns >= 3: pd {p50['pd']:.2f} s, pd-kvbranch "
            f"{p50['pd-kvbranch']:.2f} s: {p50['pd'] / p50['pd-kvbranch']:.2f}x lower "
            "(target >= 1.6x; mean over turns >= 2: target pd-kvbranch at most 1/1.6 of pd)."
        )
    ratios = [
        ("pd-kvbranch", "pd", "P/D with the kvbranch pull vs upstream P/D"),
        ("pd-kvbranch", "single-kvbranch", "P/D kvbranch vs single-instance kvbranch"),
        ("pd", "single-plain", "Upstream P/D's overhead over a plain single instance"),
        *[
            (f"{n}-spin1000", n, f"{n}: vLLM's 1 s message-queue spin vs the 2 ms default")
            for n in by
        ],
        *[(f"{n}-poll1", n, f"{n}: vLLM's 1 ms idle poll vs the 20 ms default") for n in by],
    ]
    first = {n: [t["ttft_s"] for t in by[n]["turns"] if t["turn"] == 1] for n in by}
    for a, b in (("pd-kvbranch", "pd"), ("single-kvbranch", "single-plain")):
        if a in by and b in by:
            ma, mb = statistics.fmean(first[a]), statistics.fmean(first[b])
            lines.append(
                f"- Turn 1 (nothing to reuse), {a} vs {b}: mean TTFT {ma:.2f} s vs {mb:.2f} s "
                f"({ma / mb:.3f}x; target within 3%), medians {statistics.median(first[a]):.2f} "
                f"s vs {statistics.median(first[b]):.2f} s, n = {len(first[a])}."
            )
    for n in by:
        legs = [
            (t["prefill_leg_s"], t["ttft_s"])
            for t in by[n]["turns"]
            if t["turn"] == 1 and t.get("prefill_leg_s") is not None
        ]
        if legs:
            p = statistics.fmean(x for x, _ in legs)
            rest = statistics.fmean(y - x for x, y in legs)
            lines.append(
                f"- {n}, turn 1 split by the router's Server-Timing: P's leg {p:.2f} s, "
                f"then D's read and first token (with the router on both sides) {rest:.2f} s."
            )
    for a, b, label in ratios:
        if a in by and b in by:
            lines.append(
                f"- {label} (mean TTFT turns >= 2): {means[a]:.2f} s vs {means[b]:.2f} s "
                f"({means[a] / means[b]:.2f}x, {means[a] - means[b]:+.3f} s per turn)."
            )
    names = [r["name"] for r in results]
    same = 0
    total = 0
    for i, t in enumerate(results[0]["turns"]):
        total += 1
        same += all(
            r["turns"][i]["content"] == t["content"] for r in results[1:] if i < len(r["turns"])
        )
    lines.append(f"- Greedy outputs identical across {', '.join(names)}: {same}/{total} turns.")
    lines.append("- Plot: `benchmarks/plots/pd_turns.png`.")
    return "\n".join(lines)


def records_of(results: list[dict], plots: tuple[str, ...]) -> list[Record]:
    """Mean TTFT at turns >= 2 per configuration, and the two P/D targets."""
    by = {r["name"]: r for r in results}
    out = [
        result(NAME, n, "mean TTFT turns >= 2", mean_ttft(r, 2), "s", plots=plots)
        for n, r in by.items()
    ]
    if "pd" in by and "pd-kvbranch" in by:
        if max(t["turn"] for t in by["pd"]["turns"]) >= 3:
            ratio = p50_ttft(by["pd"], 3) / p50_ttft(by["pd-kvbranch"], 3)
            out.append(
                result(
                    NAME,
                    "pd/pd-kvbranch",
                    "p50 TTFT turns >= 3",
                    ratio,
                    "x",
                    target=f">= {PD_TARGET}x",
                    met=ratio >= PD_TARGET,
                )
            )
        first = {n: [t["ttft_s"] for t in by[n]["turns"] if t["turn"] == 1] for n in by}
        turn1 = statistics.fmean(first["pd-kvbranch"]) / statistics.fmean(first["pd"])
        out.append(
            result(
                NAME,
                "pd-kvbranch/pd",
                f"mean TTFT at turn 1 (n = {len(first['pd'])})",
                turn1,
                "x",
                target=f"within 3% (<= {TURN1_TARGET})",
                met=turn1 <= TURN1_TARGET,
            )
        )
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    reporting.add_int_args(parser, {"--conversations": 4, "--turns": 6, "--system-tokens": 500})
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=180,
        help="tool observation tokens added per turn (default %(default)s)",
    )
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="round-robin the conversations turn by turn (with a small --kv-cache-gib: P's own "
        "cache cannot keep a conversation between its turns, the case the D->P pull is for)",
    )
    common.add_server_args(parser, 1.0, 4096, None)
    common.add_run_args(parser, seed=7, reserved_cpus=False)


def run(args: argparse.Namespace) -> list[Record]:
    log = reporting.Progress()
    info_job = reporting.machine_info_async()
    results = [asyncio.run(run_config(name, args, log)) for name in args.configs]
    elapsed = log.elapsed()
    info = info_job.result()
    out = reporting.raw_path("pd_turns")
    reporting.write_json(out, {"args": vars(args), "machine": info, "results": results})
    png = reporting.plot_path("pd_turns.png", args.no_results)
    plot(results, args.turns, png)
    reporting.publish(report(results, args, info, elapsed), args.no_results)
    log(f"raw data: {out}")
    return records_of(results, reporting.plot_ref(png))


if __name__ == "__main__":
    raise SystemExit(cli.main([NAME, *sys.argv[1:]]))
