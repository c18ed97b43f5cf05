"""``python -m benchmarks report``: ``benchmarks/RESULTS.md`` and the README's figures rebuilt
from the records alone.

Why generated: the file used to be a log appended by every run with a headline table written by
hand, which drifted from the sections below it. Here the headline is the few claims chosen in
``benchmarks/headline.toml`` (:mod:`benchmarks.headline`), the same rows the README shows between
its markers, and each benchmark gets one short section with its latest numbers and the run(s)
they come from (machine, commit, command, plots). The output is a pure function of the records
— no clock, no machine probe — so ``report --check`` can tell whether the committed files are
what the committed records give.

"Latest" is per number: for each benchmark, the newest record of every (config, metric) pair.
A benchmark whose profiles measure different metrics (a quick and a full profile) keeps the
latest of each, each shown with its own run. Numbers measured per agent count are one table row
per count (:func:`per_count_table`), so that a sweep takes a few lines, not one line a number.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

from benchmarks import headline, records
from benchmarks.records import Record
from benchmarks.report_format import cell, fmt_value

RESULTS_MD = Path(__file__).resolve().parent / "RESULTS.md"
README_MD = Path(__file__).resolve().parent.parent / "README.md"
HISTORY = "history/RESULTS-log-2026.md"
STUDIES = Path(__file__).resolve().parent / "history"
#: ``config@variant``: a config run on another model family (``turn_ttft --family NAME``).
VARIANT = "@"
#: A metric measured at one agent count of a sweep: ``bfcl agents=4 resumed TTFT p90``.
PER_COUNT = re.compile(r"^(?P<head>.*?)\bagents=(?P<n>\d+) (?P<what>.+)$")


def fmt_met(r: Record) -> str:
    if not r.target:
        return ""
    return "–" if r.met is None else ("MET" if r.met else "**NOT MET**")


def run_key(r: Record) -> tuple[str, str, str, str]:
    return (r.date, r.commit, r.command, r.machine)


#: Metrics a benchmark no longer writes, per benchmark: metric (after a run's shape prefix,
#: ``"bfcl 4x3: "``) -> what replaced it. Their records stay in ``results/``; the page names
#: them once instead of showing each run's last number of a target no longer judged.
RETIRED: dict[str, dict[str, str]] = {
    "replicas": {
        "moved turn / local turn, p50 TTFT": "the moved-turn probe (moved turn / local "
        "host-store hit) and, without a target, round robin / affinity",
    },
}


def is_retired(r: Record) -> bool:
    return r.metric.rpartition(": ")[2] in RETIRED.get(r.benchmark, {})


def latest(all_records: list[Record]) -> dict[str, list[Record]]:
    """Per benchmark, the newest record of each (config, metric), in the order the newest run
    wrote them (older runs' numbers after it)."""
    order = sorted(range(len(all_records)), key=lambda i: (all_records[i].date, i))
    best: dict[tuple[str, str, str], tuple[int, Record]] = {}
    for i in order:
        r = all_records[i]
        if not is_retired(r):
            best[(r.benchmark, r.config, r.metric)] = (i, r)
    out: dict[str, list[tuple[str, int, Record]]] = {}
    for (bench, _, _), (i, r) in best.items():
        out.setdefault(bench, []).append((r.date, i, r))
    return {
        bench: [r for _, _, r in sorted(rows, key=lambda t: (t[0], -t[1]), reverse=True)]
        for bench, rows in sorted(out.items())
    }


def anchor(bench: str) -> str:
    """GitHub's heading anchor of a section titled with the benchmark's name."""
    return "".join(c for c in bench.lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def runs_of(rows: list[Record]) -> dict[tuple[str, str, str, str], list[Record]]:
    """The section's records grouped by the run that wrote them, newest run first."""
    runs: dict[tuple[str, str, str, str], list[Record]] = {}
    for r in rows:
        runs.setdefault(run_key(r), []).append(r)
    return runs


def shared_note(recs: list[Record]) -> list[str]:
    """The parts of the records' notes (``; ``-separated) that every record of the run has: said
    once for the run instead of in every cell."""
    parts = [r.note.split("; ") if r.note else [] for r in recs]
    return [p for p in parts[0] if all(p in other for other in parts[1:])]


def own_note(r: Record, shared: list[str]) -> str:
    return "; ".join(p for p in (r.note.split("; ") if r.note else []) if p not in shared)


def run_lines(recs: list[Record], shared: list[str]) -> list[str]:
    """Where one run's numbers come from, in one line: date, commit, machine, command, and what
    every record's note says."""
    r = recs[0]
    line = f"- Run {r.date}, git {r.commit or '?'}, {r.machine or '?'}: `{r.command or '?'}`"
    if shared:
        line += f". Note: {cell('; '.join(shared))}"
    return [line]


def value_cell(r: Record, shared: list[str]) -> str:
    """A value with its own note and its target's verdict, for one cell of a run's table."""
    text = fmt_value(r.value, r.unit)
    note = own_note(r, shared)
    if note:
        text += f" ({cell(note)})"
    if r.target:
        text += f" (target {cell(r.target)}: {fmt_met(r)})"
    return text


def pivot(
    keyed: list[tuple[str, str, Record]], first: str, fmt: Callable[[Record], str]
) -> list[str]:
    """A table of (row, column, record) triples: one row per row key, one column per column key,
    both in the order the run wrote them."""
    rows: dict[str, dict[str, Record]] = {}
    columns: list[str] = []
    for row, column, r in keyed:
        rows.setdefault(row, {})[column] = r
        if column not in columns:
            columns.append(column)
    lines = [
        f"| {first} | " + " | ".join(cell(c) for c in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for row, cells in rows.items():
        values = [fmt(cells[c]) if c in cells else "" for c in columns]
        lines.append(f"| {cell(row)} | " + " | ".join(values) + " |")
    return lines


def per_count_key(r: Record) -> tuple[str, str] | None:
    """(``config`` and agent count, what was measured) of a per-count metric, else None."""
    m = PER_COUNT.match(r.metric)
    if m is None:
        return None
    return f"{r.config}, {m['head'].strip()} {m['n']}".replace("  ", " "), m["what"]


def run_tables(recs: list[Record], shared: list[str]) -> list[str]:
    """One run's numbers: one row per metric and a column per config (a run of one config: one
    line per metric under the run's line, a table of one column being longer for nothing);
    numbers measured per agent count one row per config and count, a column per thing
    measured."""
    counted: list[tuple[str, str, Record]] = []
    rest: list[tuple[str, str, Record]] = []
    for r in recs:
        key = per_count_key(r)
        if key is None:
            rest.append((r.metric, r.config, r))
        else:
            counted.append((key[0], key[1], r))
    lines: list[str] = []
    fmt = partial(value_cell, shared=shared)
    if rest and len({config for _, config, _ in rest}) == 1:
        lines += [f"  - {metric} ({config}): {fmt(r)}" for metric, config, r in rest]
    elif rest:
        lines += ["", *pivot(rest, "metric", fmt)]
    if counted:
        lines += ["", *pivot(counted, "config, agents", fmt)]
    return lines


def variant_table(recs: list[Record]) -> list[str]:
    """Records of ``config@variant`` configs (the same measurement on another model family, one
    run each): one row per variant with the run it comes from (and what all its notes say), one
    column per config and metric."""
    groups: dict[str, list[Record]] = {}
    for r in recs:
        groups.setdefault(r.config.rsplit(VARIANT, 1)[1], []).append(r)
    shared = {v: shared_note(group) for v, group in groups.items()}
    keyed = [
        (v, f"{r.config.rsplit(VARIANT, 1)[0]}: {r.metric}", r)
        for v, g in groups.items()
        for r in g
    ]
    lines = pivot(keyed, "variant", lambda r: value_cell(r, shared[r.config.rsplit(VARIANT, 1)[1]]))
    lines[0] += " run |"
    lines[1] += "---|"
    for i, (variant, group) in enumerate(groups.items(), 2):
        r = group[0]
        run = f"{r.date.removesuffix(' UTC')}, git {r.commit or '?'}: `{r.command}`"
        lines[i] += f" {cell('; '.join([run, *shared[variant]]))} |"
    return lines


def section(bench: str, rows: list[Record]) -> list[str]:
    """A benchmark's section: its plots, each run its latest numbers come from, then its
    ``config@variant`` runs in one table."""
    lines = [f"## {bench}", ""]
    plots = sorted({p for r in rows for p in r.plots})
    retired = RETIRED.get(bench, {})
    if retired:
        # A run's list item may follow the paragraph directly; the plots need a blank line.
        words = "; ".join(f"`{m}` ({by})" for m, by in retired.items())
        lines += [f"Retired (records kept in `results/`): {words}.", *([""] if plots else [])]
    lines += [f"![{p}]({p})" for p in plots]
    if plots:
        lines.append("")
    variants = [r for r in rows if VARIANT in r.config]
    for recs in runs_of([r for r in rows if VARIANT not in r.config]).values():
        shared = shared_note(recs)
        lines += run_lines(recs, shared) + run_tables(recs, shared) + [""]
    if variants:
        lines += [
            f"Variants (`config{VARIANT}name`: the same run on another model family),",
            f"one row each, on {variants[0].machine or '?'}:",
            "",
            *variant_table(variants),
            "",
        ]
    return lines


def intro(all_records: list[Record]) -> list[str]:
    return [
        "# kvbranch benchmark results",
        "",
        "Generated by `python -m benchmarks report` from `benchmarks/results/` and `headline.toml`",
        "(do not edit). Each number is the latest of its benchmark, configuration and metric;",
        f"compare configurations within a run, not absolute times. Older: [{HISTORY}]({HISTORY}).",
        "",
        headline.hardware_line(all_records),
        "",
    ]


def is_study(bench: str) -> bool:
    """A finished study: its module lives in ``benchmarks/history/``."""
    return (STUDIES / f"{bench}.py").exists()


def study_line(bench: str, rows: list[Record]) -> str:
    """A finished study in one line: its latest run and every target it did not meet (the
    tables are in the history log, the records in ``results/``)."""
    r = max(rows, key=lambda x: x.date)
    judged = [x for x in rows if x.target and x.met is not None]
    missed = [x for x in judged if not x.met]
    line = f"- **{bench}**: run {r.date}, git {r.commit or '?'}: `{r.command or '?'}`; "
    line += f"{len(judged) - len(missed)} of {len(judged)} targets met" if judged else "no targets"
    if missed:
        words = "; ".join(f"{x.metric} {fmt_value(x.value, x.unit)} ({x.target})" for x in missed)
        line += f"; not met: {cell(words)}"
    return line


def render(all_records: list[Record], claims: list[headline.Claim] | None = None) -> str:
    """The whole RESULTS.md for these records (deterministic: no clock, no probe). Finished
    studies a headline row does not name take one line each, at the end."""
    by_bench = latest(all_records)
    chosen = headline.load() if claims is None else claims
    lines = intro(all_records)
    lines += ["## Headline", ""]
    lines += headline.table(headline.rows(chosen, by_bench), anchor)
    lines.append("")
    named = {c.benchmark for c in chosen}
    studies = [b for b in by_bench if is_study(b) and b not in named]
    for bench, rows in by_bench.items():
        if bench not in studies:
            lines += section(bench, rows)
    if studies:
        lines += [
            "## Finished studies",
            "",
            "Their modules are in `history/`, their records in `results/`; older tables: "
            f"[{HISTORY}]({HISTORY}).",
            "",
        ]
        lines += [study_line(b, by_bench[b]) for b in studies]
    return "\n".join(lines).rstrip() + "\n"


def render_readme(
    readme: str, all_records: list[Record], claims: list[headline.Claim] | None = None
) -> str:
    """``readme`` with its generated figures: the headline rows of the same records."""
    chosen = headline.load() if claims is None else claims
    rows = headline.rows(chosen, latest(all_records))
    block = headline.readme_lines(rows, headline.hardware_line(all_records))
    return headline.with_readme_block(readme, block)


def _outputs(args: argparse.Namespace) -> dict[Path, str]:
    """Each file the report writes, with the text the records give it."""
    all_records = records.read_all(args.results_dir)
    claims = headline.load(args.headline)
    out = {args.out: render(all_records, claims)}
    if args.readme is not None:
        current = args.readme.read_text() if args.readme.exists() else ""
        out[args.readme] = render_readme(current, all_records, claims)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m benchmarks report", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--results-dir", type=Path, default=records.RESULTS_DIR)
    ap.add_argument("--out", type=Path, default=RESULTS_MD)
    ap.add_argument("--headline", type=Path, default=headline.HEADLINE_TOML)
    ap.add_argument(
        "--readme", type=Path, default=README_MD, help="the README whose figures are generated"
    )
    ap.add_argument("--no-readme", dest="readme", action="store_const", const=None)
    ap.add_argument(
        "--check", action="store_true", help="write nothing; exit 1 if a file is not up to date"
    )
    args = ap.parse_args(list(argv) if argv is not None else None)
    try:
        outputs = _outputs(args)
    except ValueError as exc:
        print(f"report: {exc}", file=sys.stderr)
        return 1
    stale = [p for p, text in outputs.items() if (p.read_text() if p.exists() else "") != text]
    if args.check:
        for path in stale:
            print(f"{path} is not what the records give: run `python -m benchmarks report`")
        if not stale:
            print("the results page and the README's figures are up to date")
        return 1 if stale else 0
    for path, text in outputs.items():
        path.write_text(text)
        print(f"wrote {path} ({text.count(chr(10))} lines)")
    return 0
