"""Plots of what the benchmarks recorded in the results log until 2026-12-05, readable at a glance
(each benchmark's records link its own plot now; these three are drawn from the log's tables):

* ``ttft_per_turn.png``     — TTFT per turn, plain vLLM against kvbranch, one panel per workload;
* ``recomputed_tokens.png`` — prompt tokens recomputed per turn (where per-turn counts were
  recorded) and per run (every workload's totals, log scale);
* ``pd_comparison.png``     — upstream P/D against kvbranch P/D (and single instances where the
  run had them), one panel per P/D workload.

    .venv/bin/python -m benchmarks.history.plots                 # writes benchmarks/plots/*.png
    .venv/bin/python -m benchmarks.history.plots --json benchmarks/out/turn_ttft-*.json

Sources, nothing else (no number is written in this file): the raw JSON the benchmarks wrote
(``benchmarks/out/{turn_ttft,agent_workload,pd_turns}-*.json``, not committed; ``--json``
names others) and the tables the same benchmarks appended to the old RESULTS.md log (now
``benchmarks/history/RESULTS-log-2026.md``; runs since write records, and their raw JSON). Each
panel shows the latest run of its workload (runs are grouped by sessions x turns, KV budget and
interleaving), and names its source: the RESULTS.md section or the JSON file. What a source
lacks (per-turn recomputed tokens of the agent workloads are only in their raw JSON) is printed.
(Over 400 lines on purpose: one figure per workload family, each with its own readers for the
raw JSON and for the RESULTS.md tables; split, a reader would drift from the figure it feeds.)
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import re
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import reporting

PLOTS_DIR = reporting.PLOTS_DIR
#: The log every run appended its tables to until 2026-12-05 (RESULTS.md is generated now).
HISTORY_MD = reporting.BENCH_DIR / "history" / "RESULTS-log-2026.md"
RAW_KINDS = ("turn_ttft", "agent_workload", "pd_turns")

#: Display names and colours, the same in every figure.
LABELS = {
    "plain": "plain vLLM",
    "single-plain": "plain vLLM (single)",
    "kvbranch": "kvbranch",
    "single-kvbranch": "kvbranch (single)",
    "pd": "upstream P/D (NIXL)",
    "pd-kvbranch": "kvbranch P/D",
}
COLORS = {
    "plain": "C0",
    "single-plain": "C0",
    "kvbranch": "C1",
    "single-kvbranch": "C1",
    "pd": "C2",
    "pd-kvbranch": "C3",
}
BASELINES = ("plain", "single-plain", "pd")
KVBRANCH = ("kvbranch", "single-kvbranch", "pd-kvbranch")


@dataclass
class Run:
    """One measured run of one workload, from a RESULTS.md section or a raw JSON file."""

    kind: str  # turn_ttft | agent | pd_turns | aiperf | token_exact
    workload: str  # short description, also the grouping key
    date: str  # "2026-12-01 14:31 UTC"
    machine: str
    source: str  # the RESULTS.md section or the JSON file
    ttft_what: str = "TTFT (s)"
    ttft: dict[str, dict[int, float]] = field(default_factory=dict)
    recomputed: dict[str, dict[int, float]] = field(default_factory=dict)
    recomputed_total: dict[str, float] = field(default_factory=dict)
    recomputed_total_what: str = "all turns"
    refs: dict[str, dict[int, float]] = field(default_factory=dict)  # dashed reference lines

    def sort_key(self) -> _dt.datetime:
        try:
            return _dt.datetime.strptime(self.date[:16], "%Y-%m-%d %H:%M")
        except ValueError:
            return _dt.datetime.min


# --- RESULTS.md ----------------------------------------------------------------------------------
def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _num(cell: str, index: int = 0) -> float | None:
    """The index-th number of a cell: "605 (0)" -> 605, "0/636/164" (index 2) -> 164."""
    found = re.findall(r"-?\d+(?:\.\d+)?|nan", cell)
    if len(found) <= index:
        return None
    return float(found[index])


def _tables(lines: list[str]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(caption, header, rows) of each markdown table; the caption is the text line above."""
    out = []
    i = 0
    caption = ""
    while i < len(lines):
        if lines[i].startswith("|") and i + 1 < len(lines) and lines[i + 1].startswith("|---"):
            header = _cells(lines[i])
            j = i + 2
            rows = []
            while j < len(lines) and lines[j].startswith("|"):
                rows.append(_cells(lines[j]))
                j += 1
            out.append((caption, header, rows))
            i = j
            continue
        if lines[i].strip():
            caption = lines[i].strip()
        i += 1
    return out


def _col(header: list[str], start: str) -> int | None:
    return next((k for k, h in enumerate(header) if h.startswith(start)), None)


def _machine(text: str) -> str:
    m = re.search(r"^- Machine: ([^,\n]+), (\d+) cores", text, re.M)
    return f"{m.group(1)}, {m.group(2)} cores" if m else "machine not recorded"


def _by_turn(rows: list[list[str]], col: int, index: int = 0, scale: float = 1.0) -> dict:
    out = {}
    for row in rows:
        turn, value = _num(row[0]), _num(row[col], index) if col < len(row) else None
        if turn is not None and value is not None and not math.isnan(value):
            out[int(turn)] = value * scale
    return out


def _parse_turn_ttft(run: Run, tables: list) -> None:
    for _caption, header, rows in tables:
        if "plain TTFT s" not in header or "kvb TTFT s" not in header:
            continue
        run.ttft["plain"] = _by_turn(rows, header.index("plain TTFT s"))
        run.ttft["kvbranch"] = _by_turn(rows, header.index("kvb TTFT s"))
        cold = _col(header, "cold prefill of new tok")
        if cold is not None:
            run.refs["cold prefill of the new tokens only"] = _by_turn(rows, cold)
        plain_rec = _col(header, "plain recomputed")
        kvb_rec = _col(header, "kvb device/host/recomputed")
        new = _col(header, "new tok")
        if plain_rec is not None:
            run.recomputed["plain"] = _by_turn(rows, plain_rec)
        if kvb_rec is not None:
            run.recomputed["kvbranch"] = _by_turn(rows, kvb_rec, 2)
        if new is not None:
            run.refs["new tokens (never seen by the server)"] = _by_turn(rows, new)
        for name, per_turn in run.recomputed.items():
            run.recomputed_total[name] = sum(per_turn.values())


def _config_recomputed(run: Run, header: list, rows: list) -> None:
    """A per-configuration table's ``recomputed`` column, as each run's total."""
    k = header.index("recomputed")
    for row in rows:
        value = _num(row[k])
        if value is not None:
            run.recomputed_total[row[0]] = value


def _parse_agent(run: Run, tables: list) -> None:
    run.ttft_what = "p50 TTFT (s)"
    for _caption, header, rows in tables:
        if header[:2] == ["turn", "n"]:
            for k, h in enumerate(header):
                if h.endswith(" p50 / p95 s"):
                    run.ttft[h.removesuffix(" p50 / p95 s")] = _by_turn(rows, k)
        elif header and header[0] == "config" and "recomputed" in header:
            _config_recomputed(run, header, rows)


def _parse_pd(run: Run, tables: list) -> None:
    run.ttft_what = "median TTFT (s)"
    run.recomputed_total_what = "turns >= 2"
    for _caption, header, rows in tables:
        if header and header[0] == "turn":
            for k, name in enumerate(header[1:], start=1):
                run.ttft[name] = _by_turn(rows, k)
        elif header and header[0] == "":
            for row in rows:
                if row[0].startswith("recomputed prompt tokens"):
                    for name, cell in zip(header[1:], row[1:], strict=False):
                        value = _num(cell)
                        if value is not None:
                            run.recomputed_total[name] = value


def _parse_aiperf(run: Run, tables: list) -> None:
    run.ttft_what = "p50 TTFT (s)"
    for _caption, header, rows in tables:
        if any(h.endswith(" TTFT p50 ms") for h in header):
            for k, h in enumerate(header):
                if h.endswith(" TTFT p50 ms"):
                    run.ttft[h.removesuffix(" TTFT p50 ms")] = _by_turn(rows, k, scale=1e-3)
        elif header and header[0] == "config" and "recomputed" in header:
            _config_recomputed(run, header, rows)


def _parse_token_exact(run: Run, tables: list) -> None:
    for _caption, header, rows in tables:
        after, before = _col(header, "recomputed after"), _col(header, "recomputed before")
        if after is None or before is None:
            continue
        run.recomputed["kvbranch"] = _by_turn(rows, after)
        run.recomputed["kvbranch before token-exact tails (full blocks only)"] = _by_turn(
            rows, before
        )
        new = _col(header, "new")
        if new is not None:
            run.refs["new tokens (never seen by the server)"] = _by_turn(rows, new)


def _workload(kind: str, text: str, configs: Sequence[str]) -> str | None:
    def grab(pattern: str) -> re.Match | None:
        return re.search(pattern, text)

    kv = grab(r"device KV ([\d.]+) GiB")
    kv_s = f", {kv.group(1)} GiB device KV" if kv else ""
    if kind == "turn_ttft":
        m = grab(r"(\d+) conversation, (\d+) turns")
        return f"1 conversation x {m.group(2)} turns, evicted between turns" if m else None
    if kind == "agent":
        m = grab(r"(\d+) concurrent sessions x (\d+) turns")
        pd = "P/D, " if "pd" in configs else ""
        return f"{pd}{m.group(1)} agents x {m.group(2)} turns with a fork{kv_s}" if m else None
    if kind == "pd_turns":
        m = grab(r"(\d+) conversations x (\d+) turns")
        order = "interleaved" if "interleaved" in text else "one at a time"
        return f"P/D, {m.group(1)} conversations x {m.group(2)} turns, {order}" if m else None
    if kind == "aiperf":
        m = grab(r"(\d+) synthetic conversations x (\d+) turns")
        return f"aiperf, {m.group(1)} conversations x {m.group(2)} turns{kv_s}" if m else None
    if kind == "token_exact":
        return "token-exact reuse, 1 session x 6 agent turns"
    return None


PARSERS = {
    "turn_ttft": _parse_turn_ttft,
    "agent": _parse_agent,
    "pd_turns": _parse_pd,
    "aiperf": _parse_aiperf,
    "token_exact": _parse_token_exact,
}


def _section_kind(title: str) -> str | None:
    for prefix, kind in (
        ("turn_ttft", "turn_ttft"),
        ("agent_workload", "agent"),
        ("pd_turns", "pd_turns"),
        ("aiperf", "aiperf"),
        ("Token-exact reuse", "token_exact"),
    ):
        if title.startswith(prefix):
            return kind
    return None


def runs_from_results(path: Path) -> list[Run]:
    """Every benchmark section of RESULTS.md that has the tables a figure needs."""
    if not path.exists():
        return []
    runs = []
    for chunk in re.split(r"^## ", path.read_text(), flags=re.M)[1:]:
        heading, _, body = chunk.partition("\n")
        title, _, date = heading.partition(" — ")
        kind = _section_kind(title)
        if kind is None:
            continue
        body = body.split("\n### ")[0]  # a subsection is another measurement
        tables = _tables(body.splitlines())
        run = Run(kind, "", date.strip(), _machine(body), f"RESULTS.md § {heading.strip()}")
        PARSERS[kind](run, tables)
        workload = _workload(kind, body, list(run.ttft) or list(run.recomputed_total))
        if workload and (run.ttft or run.recomputed):
            run.workload = workload
            runs.append(run)
    return runs


# --- raw JSON ------------------------------------------------------------------------------------
def _json_date(path: Path) -> str:
    m = re.search(r"(\d{8})-(\d{6})", path.name)
    if not m:
        return "date unknown"
    stamp = _dt.datetime.strptime(m.group(1) + m.group(2), "%Y%m%d%H%M%S")
    return stamp.strftime("%Y-%m-%d %H:%M") + " (raw file stamp)"


def _json_machine(data: dict) -> str:
    info = data.get("machine") or {}
    cpu = str(info.get("cpu", "machine not recorded"))
    return f"{cpu}, {info['cores']} cores" if "cores" in info else cpu


def _series(items: list[dict], key: str, agg: str) -> dict[int, float]:
    by: dict[int, list[float]] = {}
    for item in items:
        if item.get(key) is not None:
            by.setdefault(int(item["turn"]), []).append(float(item[key]))
    if agg == "sum":
        return {t: sum(v) for t, v in sorted(by.items())}
    return {t: statistics.median(v) for t, v in sorted(by.items())}


def run_from_json(path: Path) -> Run | None:
    """A run from a raw file of turn_ttft.py, agent_workload.py or pd_turns.py (their
    ``reporting.write_json`` output); None for a file of another kind."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    results = data.get("results") if isinstance(data, dict) else None
    if not results:
        return None
    args = data.get("args") or {}
    run = Run("", "", _json_date(path), _json_machine(data), f"{path.name} (raw JSON)")
    if isinstance(results, list):  # pd_turns: a list of {"name", "turns"}
        run.kind, run.ttft_what = "pd_turns", "median TTFT (s)"
        for res in results:
            run.ttft[res["name"]] = _series(res["turns"], "ttft_s", "median")
            run.recomputed[res["name"]] = _series(res["turns"], "recomputed_tokens", "sum")
        order = "interleaved" if str(args.get("interleave")) == "True" else "one at a time"
        n_conv = len({t["conversation"] for r in results for t in r["turns"]})
        n_turns = max(t["turn"] for r in results for t in r["turns"])
        run.workload = f"P/D, {n_conv} conversations x {n_turns} turns, {order}"
    elif all("records" in r for r in results.values()):  # agent_workload
        run.kind, run.ttft_what = "agent", "p50 TTFT (s)"
        for name, res in results.items():
            run.ttft[name] = _series(res["records"], "ttft_s", "median")
            run.recomputed[name] = _series(res["records"], "recomputed_tokens", "sum")
        recs = [r for res in results.values() for r in res["records"]]
        n_sess = len({r["session"] for r in recs})
        n_turns = max(r["turn"] for r in recs)
        pd = "P/D, " if "pd" in results else ""
        kv = args.get("kv_cache_gib")
        kv_s = f", {kv} GiB device KV" if kv else ""
        run.workload = f"{pd}{n_sess} agents x {n_turns} turns with a fork{kv_s}"
    elif all("turns" in r for r in results.values()):  # turn_ttft
        run.kind = "turn_ttft"
        for name, res in results.items():
            run.ttft[name] = _series(res["turns"], "ttft_s", "median")
            run.recomputed[name] = _series(res["turns"], "recomputed_tokens", "sum")
        ref = results.get("kvbranch") or next(iter(results.values()))
        run.refs["cold prefill of the new tokens only"] = _series(ref["turns"], "ref_ttft_s", "x")
        run.refs["new tokens (never seen by the server)"] = _series(ref["turns"], "new_tokens", "x")
        n_turns = max(t["turn"] for r in results.values() for t in r["turns"])
        run.workload = f"1 conversation x {n_turns} turns, evicted between turns"
    else:
        return None
    for name, per_turn in run.recomputed.items():
        run.recomputed_total[name] = sum(
            v for t, v in per_turn.items() if run.kind != "pd_turns" or t >= 2
        )
    if run.kind == "pd_turns":
        run.recomputed_total_what = "turns >= 2"
    return run


def default_json() -> list[Path]:
    return sorted(
        p
        for kind in RAW_KINDS
        for p in reporting.OUT_DIR.glob(f"{kind}-*.json")
        if not p.name.endswith("-workload.json")
    )


# --- selection -----------------------------------------------------------------------------------
def latest(runs: list[Run], want) -> list[Run]:
    """The latest run of each workload among those ``want`` accepts, oldest workload first."""
    best: dict[str, Run] = {}
    for run in runs:
        if want(run) and (
            run.workload not in best or run.sort_key() >= best[run.workload].sort_key()
        ):
            best[run.workload] = run
    return sorted(best.values(), key=Run.sort_key)


def _has(series: dict, names: Sequence[str]) -> bool:
    return any(n in series and series[n] for n in names)


def _vs_plain(run: Run) -> bool:
    return run.kind != "pd_turns" and "plain" in run.ttft and "kvbranch" in run.ttft


def _vs_pd(run: Run) -> bool:
    return "pd" in run.ttft and "pd-kvbranch" in run.ttft


# --- figures -------------------------------------------------------------------------------------
def _panel_title(run: Run) -> str:
    return f"{run.workload}\n{run.source.removeprefix('RESULTS.md § ')} — {run.machine}"


def _grid(plt, n: int, width: float = 6.4, height: float = 4.2):
    cols = 1 if n == 1 else 2
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _line(ax, series: dict[int, float], name: str, **kw) -> None:
    turns = sorted(series)
    ax.plot(
        turns,
        [series[t] for t in turns],
        marker=kw.pop("marker", "o"),
        label=LABELS.get(name, name),
        color=kw.pop("color", COLORS.get(name)),
        **kw,
    )


def _finish(fig, ax_list, path: Path, title: str, note: str) -> None:
    fig.suptitle(title, fontsize=13, fontweight="bold")
    fig.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=8, color="dimgray", wrap=True)
    fig.tight_layout(rect=(0, 0.03, 1, 0.96))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)


def _empty(plt, path: Path, title: str, why: str) -> None:
    fig, ax = plt.subplots(figsize=(8, 3))
    ax.axis("off")
    ax.text(0.5, 0.5, why, ha="center", va="center", wrap=True)
    _finish(fig, [ax], path, title, "")


def _xticks(ax, runs_series: list[dict[int, float]]) -> None:
    turns = sorted({t for s in runs_series for t in s})
    if turns and len(turns) <= 12:
        ax.set_xticks(turns)


KIND_ORDER = {"turn_ttft": 0, "agent": 1, "aiperf": 2, "pd_turns": 3}


def _ratio_panel(ax, chosen: list[Run], base: str, kvb: str, what: str) -> None:
    """baseline TTFT / kvbranch TTFT per turn, one line per run: above 1 kvbranch is faster."""
    for i, run in enumerate(chosen):
        a, b = run.ttft[base], run.ttft[kvb]
        turns = [t for t in sorted(a) if t in b and b[t]]
        ax.plot(
            turns,
            [a[t] / b[t] for t in turns],
            marker="o",
            color=f"C{(i + 4) % 10}",
            label=f"{_short(run)} ({run.date[5:16]})",
        )
    ax.axhline(1.0, color="black", linewidth=1)
    ax.text(0.99, 0.02, "below 1: kvbranch slower", transform=ax.transAxes, ha="right", fontsize=8)
    _xticks(ax, [r.ttft[base] for r in chosen])
    ax.set(
        xlabel="turn",
        ylabel=f"{what} (x)",
        title=f"{what} per turn, every panel's run\n(above 1: kvbranch faster)",
    )
    ax.title.set_fontsize(9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_ttft(plt, runs: list[Run], path: Path, note: str) -> list[Run]:
    chosen = sorted(
        latest(runs, _vs_plain), key=lambda r: (KIND_ORDER.get(r.kind, 9), r.sort_key())
    )
    title = "TTFT per turn: plain vLLM vs kvbranch (lower is better)"
    if not chosen:
        _empty(plt, path, title, "no recorded run with plain vLLM and kvbranch")
        return chosen

    def draw(ax: Any, run: Run) -> None:
        for name in ("plain", "kvbranch"):
            _line(ax, run.ttft[name], name)
        for name, series in run.refs.items():
            if name.startswith("cold prefill") and series:
                _line(ax, series, name, color="gray", linestyle="--", marker="x")

    pair = ("plain", "kvbranch", "plain vLLM TTFT / kvbranch TTFT")
    _turn_panels(plt, chosen, draw, pair, path, title, note)
    return chosen


def _turn_panels(
    plt: Any,
    chosen: list[Run],
    draw: Callable[[Any, Run], None],
    pair: tuple[str, str, str],
    path: Path,
    title: str,
    note: str,
) -> None:
    """One TTFT-per-turn panel per run (``draw`` puts its lines in), then the panel of the
    ``pair``'s ratio (baseline, kvbranch, label) over all of them."""
    fig, axes = _grid(plt, len(chosen) + 1)
    for ax, run in zip(axes, chosen, strict=False):
        draw(ax, run)
        _xticks(ax, list(run.ttft.values()))
        ax.set(xlabel="turn", ylabel=run.ttft_what, title=_panel_title(run))
        ax.title.set_fontsize(9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _ratio_panel(axes[-1], chosen, *pair)
    _finish(fig, axes, path, title, note)


def _short(run: Run) -> str:
    """ "P/D, 4 conversations x 6 turns, interleaved" -> "P/D 4x6 interleaved" (tick labels)."""
    m = re.search(r"(\d+) (agents|conversations?) x (\d+) turns", run.workload)
    size = f"{m.group(2).rstrip('s').replace('conversation', 'conv.')} {m.group(1)}x{m.group(3)}"
    prefix = next((p for p in ("P/D", "aiperf") if run.workload.startswith(p)), "")
    suffix = " interl." if "interleaved" in run.workload else ""
    if run.kind == "turn_ttft":
        size = "evicted conv. 1x" + m.group(3)
    return f"{prefix} {size}{suffix}".strip() if m else run.workload


def _pair(totals: dict[str, float]) -> tuple[str, str] | None:
    """The baseline and the kvbranch configuration whose totals a run compares."""
    for base, kvb in (("pd", "pd-kvbranch"), ("plain", "kvbranch")):
        if totals.get(base) and totals.get(kvb):
            return base, kvb
    return None


def plot_recomputed(plt, runs: list[Run], path: Path, note: str, shown: list[Run]) -> list[Run]:
    """Per-turn panels where per-turn counts were recorded; below, one full-width panel with
    the totals of the runs the other figures show (``shown``)."""
    per_turn = latest(runs, lambda r: _has(r.recomputed, KVBRANCH))
    totals = sorted(
        {id(r): r for r in shown if _pair(r.recomputed_total)}.values(),
        key=lambda r: (r.workload.startswith("P/D"), r.sort_key()),
    )
    title = "Prompt tokens recomputed (prefilled) per turn and per run (lower is better)"
    if not per_turn and not totals:
        _empty(plt, path, title, "no recorded run with per-turn or total recomputed tokens")
        return []
    cols = 2 if len(per_turn) > 1 else 1
    rows = math.ceil(len(per_turn) / cols) + (1 if totals else 0)
    fig = plt.figure(figsize=(6.4 * 2, 4.4 * rows))
    grid = fig.add_gridspec(rows, cols)
    axes = [fig.add_subplot(grid[i // cols, i % cols]) for i in range(len(per_turn))]
    for ax, run in zip(axes, per_turn, strict=True):
        for name, series in run.recomputed.items():
            style = {"linestyle": ":", "color": "C4"} if "before" in name else {}
            _line(ax, series, name, **style)
        for name, series in run.refs.items():
            if name.startswith("new tokens") and series:
                _line(ax, series, name, color="gray", linestyle="--", marker="x")
        _xticks(ax, list(run.recomputed.values()))
        what = "recomputed prompt tokens" + (
            " (sum over requests)" if run.kind in ("agent", "pd_turns") else ""
        )
        ax.set(xlabel="turn", ylabel=what, title=_panel_title(run))
        ax.title.set_fontsize(9)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if totals:
        ax = fig.add_subplot(grid[rows - 1, :])
        axes.append(ax)
        width = 0.38
        for i, run in enumerate(totals):
            base, kvb = _pair(run.recomputed_total) or ("", "")
            b, k = run.recomputed_total[base], run.recomputed_total[kvb]
            ax.bar(i - width / 2, b, width, color="C0", label="baseline" if i == 0 else None)
            ax.bar(i + width / 2, k, width, color="C1", label="kvbranch" if i == 0 else None)
            ax.text(i, max(b, k) * 1.15, f"{b / k:.1f}x fewer", ha="center", fontsize=8)
        ax.set_yscale("log")
        ax.set_xticks(range(len(totals)))
        ax.set_xticklabels(
            [f"{_short(r)}\n{r.date[5:16]}\n({r.recomputed_total_what})" for r in totals],
            fontsize=7.5,
        )
        ax.set_ylabel("recomputed prompt tokens\nwhole run (log scale)")
        ax.set_title(
            "Whole runs (the runs of the TTFT and P/D figures): baseline = plain vLLM, or "
            "upstream P/D for P/D runs; kvbranch = kvbranch, or kvbranch P/D",
            fontsize=9,
        )
        ax.set_ylim(top=max(max(r.recomputed_total.values()) for r in totals) * 3)
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize=8, loc="upper right")
    _finish(fig, axes, path, title, note)
    return per_turn + totals


def plot_pd(plt, runs: list[Run], path: Path, note: str) -> list[Run]:
    chosen = latest(runs, _vs_pd)
    title = "Prefill/decode disaggregation: upstream P/D vs kvbranch P/D (lower is better)"
    if not chosen:
        _empty(plt, path, title, "no recorded run with pd and pd-kvbranch")
        return chosen

    def draw(ax: Any, run: Run) -> None:
        for name in ("pd", "pd-kvbranch", "single-plain", "single-kvbranch"):
            if run.ttft.get(name):
                style = {"linestyle": "--", "alpha": 0.6} if name.startswith("single") else {}
                _line(ax, run.ttft[name], name, **style)

    pair = ("pd", "pd-kvbranch", "upstream P/D TTFT / kvbranch P/D TTFT")
    _turn_panels(plt, chosen, draw, pair, path, title, note)
    return chosen


# --- command -------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--json",
        type=Path,
        nargs="*",
        default=None,
        help="raw benchmark JSON files (default: benchmarks/out/{turn_ttft,agent_workload,"
        "pd_turns}-*.json)",
    )
    ap.add_argument(
        "--results",
        type=Path,
        default=HISTORY_MD,
        help="the Markdown log whose tables are read (default: the old RESULTS.md log)",
    )
    ap.add_argument("--no-results", action="store_true", help="use the JSON files only")
    ap.add_argument("--out-dir", type=Path, default=PLOTS_DIR)
    args = ap.parse_args(argv)
    plt = reporting.pyplot()
    if plt is None:
        return 1
    json_paths = default_json() if args.json is None else list(args.json)
    runs = [r for r in (run_from_json(p) for p in json_paths) if r is not None]
    n_json = len(runs)
    if not args.no_results:
        runs += runs_from_results(args.results)
    print(
        f"{n_json} raw JSON run(s) of {len(json_paths)} file(s); {len(runs) - n_json} from "
        f"{args.results if not args.no_results else 'no RESULTS.md'}"
    )
    sources = "RESULTS.md" if n_json == 0 else "raw JSON and RESULTS.md"
    if args.no_results:
        sources = "raw JSON"
    note = (
        f"Data: {sources} (python -m benchmarks.history.plots); each panel is the latest run of "
        "its workload, named above it. Shared 2-core CPU machine: compare configurations side by "
        "side, not absolute times."
    )
    shown: list[Run] = []
    for name in ("ttft_per_turn.png", "pd_comparison.png", "recomputed_tokens.png"):
        path = args.out_dir / name
        if name == "ttft_per_turn.png":
            used = plot_ttft(plt, runs, path, note)
        elif name == "pd_comparison.png":
            used = plot_pd(plt, runs, path, note)
        else:
            used = plot_recomputed(plt, runs, path, note, shown)
        shown += used
        print(f"{path}:")
        for run in used:
            print(f"  {run.workload}: {run.source}")
    missing = [r for r in runs if r.kind == "agent" and not r.recomputed]
    if missing:
        print(
            "per-turn recomputed tokens of the agent workloads are only in their raw JSON "
            f"(benchmarks/out/, not committed): missing for {len(missing)} run(s); their totals "
            "are plotted"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
