"""Where a server's time went under a workload (issue 14 item 2): the breakdown of a profile
folder that ``--profile-dir`` (``agent_workload``, ``turn_ttft``: :class:`benchmarks.step_profile.
StepProfiler`) collected. A study that answered its question (RESULTS-log-2026.md, "Where the
time goes"); it reads the folder a run left and prints the report:

    .venv/bin/python -m benchmarks.history.step_breakdown benchmarks/out/profile-<run>/kvbranch

Three sources, each answering a different question:

* **steps** (``steps/*.jsonl``, kvbranch only: the connector's ``KVBRANCH_STEP_TRACE``): per
  engine step the forward, the host-store copies, the connector's scheduler hooks, and the gap
  until the next step (sampling, scheduling, output processing, IPC; idle when the gap is long);
  prefill and decode tokens per step;
* **metrics** (``metrics.json``, every configuration): vLLM's request-phase histograms from
  ``/metrics`` — queue time (waiting to be scheduled), prefill time (scheduled to first token),
  decode time — so TTFT splits into waiting and computing for plain vLLM too;
* **py-spy** (``pyspy-<process>.txt``, optional ``--py-spy PATH``): sampled stacks of the API
  server, the engine core and the worker; the share of samples per function says what besides
  the forward keeps a core busy.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.step_profile import COUNTERS, HISTOGRAMS, paired_steps, worker_times

STEP_TOTALS = (
    "forward_s",
    "load_s",
    "save_s",
    "connector_sched_s",
    "prefill_tokens",
    "decode_tokens",
    "load_blocks",
    "save_blocks",
    "prefill_steps",
    "prefill_step_forward_s",
    "idle_s",
    "idle_gaps",
    "between_steps_s",
)
#: A gap between two steps longer than this is the engine waiting for work.
IDLE_GAP_S = 0.25


class StepCost(NamedTuple):
    """One engine step: its worker and scheduler records, its copies and forward (seconds),
    and the gap from its end to the next step's start (None for the last step)."""

    worker: dict
    sched: dict | None
    load: float
    forward: float
    save: float
    gap: float | None

    @property
    def idle(self) -> bool:
        """A gap long enough to be the engine waiting for work, not its own overhead."""
        return self.gap is not None and self.gap > IDLE_GAP_S


def step_costs(pairs: list[tuple[dict, dict | None]]) -> Iterator[StepCost]:
    """Each step of :func:`paired_steps` with its times: the loop both breakdowns share."""
    for i, (w, s) in enumerate(pairs):
        gap = pairs[i + 1][0]["t"] - w["save1"] if i + 1 < len(pairs) else None
        yield StepCost(w, s, *worker_times(w), gap)


def step_breakdown(folder: Path) -> dict[str, Any] | None:
    """Totals over every engine step of a run (``folder/steps``), seconds and shares."""
    pairs = paired_steps(folder)
    if not pairs:
        return None
    worker = [w for w, _ in pairs]
    tot = Counter[str]()
    decode_only: list[float] = []
    for step in step_costs(pairs):
        s = step.sched
        tot["forward_s"] += step.forward
        tot["load_s"] += step.load
        tot["save_s"] += step.save
        if s is not None:
            tot["connector_sched_s"] += s.get("build_s", 0.0) + sum(s.get("hook_s", {}).values())
            tot["prefill_tokens"] += s["prefill"]
            tot["decode_tokens"] += s["decode"]
            tot["load_blocks"] += s["loads"]
            tot["save_blocks"] += s["saves"]
            if s["prefill"]:
                tot["prefill_steps"] += 1
                tot["prefill_step_forward_s"] += step.forward
            elif s["decode"]:
                decode_only.append(step.forward)
        if step.gap is not None:
            if step.idle:
                tot["idle_s"] += step.gap
                tot["idle_gaps"] += 1
            else:
                tot["between_steps_s"] += step.gap
    wall = worker[-1]["save1"] - worker[0]["t"]
    out: dict[str, Any] = {"steps": len(worker), "wall_s": wall}
    for key in STEP_TOTALS:
        out[key] = tot[key]
    out["decode_only_steps"] = len(decode_only)
    out["decode_only_forward_s"] = sum(decode_only)
    out["decode_step_median_ms"] = 1000 * statistics.median(decode_only) if decode_only else 0.0
    # "between steps" counts the connector's scheduler hooks too (they run in the scheduler).
    out["other_between_steps_s"] = max(out["between_steps_s"] - out["connector_sched_s"], 0.0)
    return out


def metrics_breakdown(folder: Path) -> dict[str, Any] | None:
    path = folder / "metrics.json"
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    out: dict[str, Any] = {}
    for name in HISTOGRAMS:
        entry = data.get(name)
        if entry and entry["count"]:
            out[name.split(":")[1].removesuffix("_seconds")] = entry["sum"] / entry["count"]
    for name in COUNTERS:
        if name in data:
            out[name.split(":")[1]] = data[name]
    return out


def pyspy_shares(path: Path, top: int = 12) -> tuple[int, list[tuple[str, float]]]:
    """(samples, [(function, share of samples whose stack contains it)]) of a py-spy raw
    profile, top ``top`` by share, leaving out the frames every sample shares."""
    samples = 0
    inclusive = Counter[str]()
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        samples += n
        funcs = {frame.split(" (")[0] + " " + _short_file(frame) for frame in stack.split(";")}
        for func in funcs:
            inclusive[func] += n
    if not samples:
        return 0, []
    rows = [(f, c / samples) for f, c in inclusive.most_common() if c / samples < 0.97]
    return samples, rows[:top]


def _short_file(frame: str) -> str:
    if "(" not in frame:
        return ""
    where = frame.rsplit("(", 1)[1].rstrip(")")
    return "(" + "/".join(where.split(":")[0].split("/")[-2:]) + ")"


def markdown(name: str, folder: Path) -> str:
    """The report of one configuration's profile folder."""
    lines = [f"#### {name}", ""]
    steps = step_breakdown(folder)
    if steps:
        wall = steps["wall_s"] or 1.0
        busy = wall - steps["idle_s"]
        lines += [
            f"Engine steps: {steps['steps']} over {wall:.0f} s; prefill tokens "
            f"{steps['prefill_tokens']} in {steps['prefill_steps']} steps, decode tokens "
            f"{steps['decode_tokens']}; decode-only steps {steps['decode_only_steps']} "
            f"(median forward {steps['decode_step_median_ms']:.0f} ms).",
            "",
            "| part of the engine's time | s | share of wall | share of busy |",
            "|---|---|---|---|",
        ]
        parts = [
            ("forward, steps with prefill", steps["prefill_step_forward_s"]),
            ("forward, decode-only steps", steps["decode_only_forward_s"]),
            ("host-store load copies", steps["load_s"]),
            ("host-store save copies", steps["save_s"]),
            ("connector scheduler hooks", steps["connector_sched_s"]),
            (
                "between steps (sampling, scheduling, output, IPC)",
                steps["other_between_steps_s"],
            ),
            (f"idle (gaps > {IDLE_GAP_S} s)", steps["idle_s"]),
        ]
        for label, value in parts:
            share_busy = "" if label.startswith("idle") else f"{100 * value / busy:.1f}%"
            lines.append(f"| {label} | {value:.1f} | {100 * value / wall:.1f}% | {share_busy} |")
        lines.append("")
    metrics = metrics_breakdown(folder)
    if metrics:
        lines.append(
            "vLLM request phases (mean s): "
            + ", ".join(
                f"{k} {v:.2f}" if isinstance(v, float) and k[0] != "n" else f"{k} {v:.0f}"
                for k, v in metrics.items()
            )
        )
        lines.append("")
    sampling = folder / "sampling.json"
    sampled = json.loads(sampling.read_text()) if sampling.exists() else None
    for path in sorted(folder.glob("pyspy-*.txt")):
        samples, rows = pyspy_shares(path)
        if not samples:
            continue
        label = path.stem.removeprefix("pyspy-")
        busy = (
            f", busy {100 * samples / (sampled['seconds'] * sampled['rate']):.0f}% of a core"
            if sampled
            else ""
        )
        lines += [f"py-spy `{label}` ({samples} samples{busy}), share of samples:", ""]
        lines += [f"- {100 * share:.0f}% `{func}`" for func, share in rows]
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    for arg in sys.argv[1:]:
        folder = Path(arg)
        print(markdown(folder.name, folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
