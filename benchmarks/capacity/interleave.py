"""``capacity --interleave PASSES``: an A/B of configurations at one agent count, in interleaved
passes, for a difference smaller than the noise between runs (what policy_ab measured:
docs/scheduling.md).

Every configuration's server is up at once (the same core reservation: only one works at a
time); each pass runs the same agents through each server in turn, in alternating order (A B,
then B A), under the pass's own cache salt. Per pass and configuration: p50 and p90 of resumed
turns, p90 of cold ones, output tokens/s; each against the first configuration as that pass's
ratio, reported as the median of the passes with a 95% bootstrap interval. No target is
decided here: the interval is the result.
"""

from __future__ import annotations

import argparse
import asyncio
import random

from benchmarks import common, reporting
from benchmarks.capacity import configs, sweep
from benchmarks.records import Record, result

#: What each pass is compared on: (StepSummary field, words, whether higher is better).
METRICS = (
    ("resumed_p50", "resumed TTFT p50", False),
    ("resumed_p90", "resumed TTFT p90", False),
    ("cold_p90", "cold TTFT p90", False),
    ("output_tps", "output throughput", True),
)


def pass_order(names: list[str], i: int) -> list[str]:
    """Pass ``i``'s order: as named on even passes, reversed on odd ones."""
    return list(names) if i % 2 == 0 else list(reversed(names))


def ratios(passes: list[dict[str, sweep.StepSummary]], base: str, other: str) -> dict[str, list]:
    """Per metric, each pass's ratio written so that above 1 ``other`` is better."""
    out: dict[str, list[float]] = {}
    for key, _, higher in METRICS:
        pairs = [(getattr(p[base], key), getattr(p[other], key)) for p in passes]
        out[key] = [(b / a if higher else a / b) for a, b in pairs if a > 0 and b > 0]
    return out


def build_records(
    trace: str, agents: int, passes: list[dict[str, sweep.StepSummary]], identical: dict
) -> list[Record]:
    """Each configuration against the first: per metric the median of the passes' ratios (named
    as the records name ratios: ``base/other`` for a time, ``other/base`` for a throughput),
    its interval in the note; and the answers against the first's."""
    base, *others = list(passes[0])
    rng, at, out = random.Random(1), f"{trace} agents={agents}", []
    for other in others:
        per_pass = ratios(passes, base, other)
        for key, words, higher in METRICS:
            if not per_pass[key]:
                continue
            lo, hi = reporting.bootstrap_median(per_pass[key], rng)
            note = f"> 1: {other} better; 95% CI {lo:.3f}-{hi:.3f}, {len(per_pass[key])} passes"
            pair = f"{other}/{base}" if higher else f"{base}/{other}"
            metric = f"{at} {words}, interleaved (median of passes)"
            value = reporting.median(per_pass[key])
            out.append(result(sweep.BENCHMARK, pair, metric, value, "x", note=note))
        same, compared = identical[other]
        if compared:
            metric, goal = f"{at} answers identical to {base}, interleaved", "1.0 (token-identical)"
            fraction, note = same / compared, f"{same}/{compared} turns"
            out.append(
                result(
                    sweep.BENCHMARK,
                    other,
                    metric,
                    fraction,
                    "fraction",
                    goal,
                    same == compared,
                    note=note,
                )
            )
    return out


async def run_passes(args: argparse.Namespace, convs: list, names: list[str], log) -> tuple:
    """Every configuration's server up at once, ``args.interleave`` passes at the first count of
    ``--agents``; (count, per-pass summaries, answers identical to the first configuration's)."""
    from openai import AsyncOpenAI

    from benchmarks.capacity import replay

    agents = int(args.agents.split(",")[0])
    passes: list[dict[str, sweep.StepSummary]] = []
    identical = dict.fromkeys(names, (0, 0))
    with common.servers_up({name: configs.config_spec(name, args) for name in names}) as servers:
        oai = {
            n: AsyncOpenAI(base_url=f"{s.url}/v1", api_key="none", max_retries=0)
            for n, s in servers.items()
        }
        models = {n: (await c.models.list()).data[0].id for n, c in oai.items()}
        for i in range(args.interleave):
            turns, summaries = {}, {}
            for n in pass_order(names, i):
                turns[n], wall = await replay.run_agents(
                    oai[n],
                    models[n],
                    convs,
                    agents,
                    args.per_agent,
                    f"p{i}",
                    args.trace == "bfcl",
                    args.stagger_s,
                )
                summaries[n] = s = sweep.summarize(agents, turns[n], wall, float("inf"))
                log(f"pass {i} [{n}]: resumed p50 {s.resumed_p50:.2f} s, {s.output_tps:.2f} tok/s")
            passes.append({n: summaries[n] for n in names})
            for n in names[1:]:
                same, compared = sweep.compare_answers(turns[n], turns[names[0]])
                identical[n] = (identical[n][0] + same, identical[n][1] + compared)
    return agents, passes, identical


def run(
    args: argparse.Namespace, convs: list, names: list[str], workload: str, log
) -> list[Record]:
    """The interleaved A/B: its passes, a short report, its records."""
    if len(names) < 2 or args.interleave < 2:
        raise SystemExit("--interleave needs at least 2 passes and 2 --configs")
    agents, passes, identical = asyncio.run(run_passes(args, convs, names, log))
    recs = build_records(args.trace, agents, passes, identical)
    rows = [[r.config, r.metric, f"{r.value:.3f}", r.note] for r in recs]
    table = reporting.md_table(["configuration", "metric", "median of passes", "note"], rows)
    title = f"# capacity --interleave {args.interleave} ({args.trace}, {agents} agents)"
    reporting.publish(f"{title}\n\n- Workload: {workload}\n\n{table}\n", args.no_results)
    return recs
