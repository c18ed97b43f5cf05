"""Where a server's time goes under a workload (issue 14 item 2): per-step breakdown, vLLM's
own request-phase histograms, and CPU samples of the server's processes.

Used by ``agent_workload.py --profile-dir DIR`` (every configuration gets ``DIR/<config>/``);
run alone it prints the breakdown of a profile folder written by such a run:

    .venv/bin/python benchmarks/step_profile.py benchmarks/out/profile-<run>/kvbranch

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
import signal
import statistics
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Hashable, Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from server.connector.engine.step_trace import ENV_STEP_TRACE  # noqa: E402

#: vLLM histograms read from ``/metrics`` (sums and counts over all label sets).
HISTOGRAMS = (
    "vllm:time_to_first_token_seconds",
    "vllm:request_queue_time_seconds",
    "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds",
    "vllm:e2e_request_latency_seconds",
)
COUNTERS = ("vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens")
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
#: Process titles vLLM sets (``set_process_title``), and the label each profile gets.
PROCESS_LABELS = (("EngineCore", "engine-core"), ("Worker", "worker"))


# --- collection ----------------------------------------------------------------------------------
class StepProfiler:
    """Collects one configuration's profile into ``folder`` while its server runs."""

    def __init__(self, folder: Path, py_spy: str | None = None, rate: int = 20) -> None:
        self.folder = folder
        self.py_spy = py_spy
        self.rate = rate
        self._spies: list[subprocess.Popen] = []
        self._started = 0.0
        folder.mkdir(parents=True, exist_ok=True)

    def env(self) -> dict[str, str]:
        """Environment for the server: the connector's step trace."""
        return {ENV_STEP_TRACE: str(self.folder / "steps")}

    def start(self, server_pid: int) -> None:
        self._started = time.monotonic()
        if not self.py_spy:
            return
        for label, pid in server_processes(server_pid):
            out = self.folder / f"pyspy-{label}.txt"
            cmd = [self.py_spy, "record", "--pid", str(pid), "--rate", str(self.rate)]
            cmd += ["--format", "raw", "--nonblocking", "--output", str(out)]
            log = (self.folder / f"pyspy-{label}.log").open("w")
            self._spies.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))

    def finish(self, base_url: str) -> None:
        """Read the server's metrics (before it stops) and stop the samplers."""
        try:
            metrics = scrape_metrics(base_url)
        except httpx.HTTPError as exc:
            metrics = {"error": str(exc)}
        (self.folder / "metrics.json").write_text(json.dumps(metrics, indent=1))
        # What a sample count is out of: py-spy's rate over the time it sampled.
        sampled = {"rate": self.rate, "seconds": time.monotonic() - self._started}
        (self.folder / "sampling.json").write_text(json.dumps(sampled))
        for spy in self._spies:
            spy.send_signal(signal.SIGINT)
        for spy in self._spies:
            try:
                spy.wait(timeout=60)
            except subprocess.TimeoutExpired:
                spy.kill()


def server_processes(server_pid: int) -> list[tuple[str, int]]:
    """(label, pid) of the API server, the engine core and the worker (by process title)."""
    import psutil

    found = [("api-server", server_pid)]
    for child in psutil.Process(server_pid).children(recursive=True):
        try:
            title = " ".join(child.cmdline()) or child.name()
        except psutil.Error:
            continue
        for needle, label in PROCESS_LABELS:
            if needle in title and all(label != seen for seen, _ in found):
                found.append((label, child.pid))
    return found


def sum_samples(metrics_text: str, key_of: Callable[[Any], Hashable | None]) -> dict[Any, float]:
    """The samples of a Prometheus text page summed by ``key_of(sample)`` (None: left out):
    the one parser behind :func:`scrape_metrics` and ``history/policy_ab``'s ``read_counters``."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[Any, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            key = key_of(sample)
            if key is not None:
                out[key] = out.get(key, 0.0) + sample.value
    return out


def metric_key(sample: Any) -> tuple[str, str] | str | None:
    """``(histogram, "sum" | "count")`` for :data:`HISTOGRAMS`, the name for :data:`COUNTERS`."""
    for name in HISTOGRAMS:
        for part in ("sum", "count"):
            if sample.name == f"{name}_{part}":
                return (name, part)
    for name in COUNTERS:
        if sample.name in (name, f"{name}_total"):
            return name
    return None


def scrape_metrics(base_url: str) -> dict[str, Any]:
    """Sum and count of each histogram in :data:`HISTOGRAMS`, and each counter's value."""
    sums = sum_samples(httpx.get(f"{base_url}/metrics", timeout=30).text, metric_key)
    out: dict[str, Any] = {}
    for key, value in sums.items():
        if isinstance(key, tuple):
            out.setdefault(key[0], {"sum": 0.0, "count": 0.0})[key[1]] = value
        else:
            out[key] = value
    return out


# --- analysis ------------------------------------------------------------------------------------
def read_jsonl(paths: Iterable[Path]) -> list[dict]:
    rows: list[dict] = []
    for path in paths:
        for line in path.read_text().splitlines():
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a killed process
    return sorted(rows, key=lambda r: r["t"])


def paired_steps(folder: Path) -> list[tuple[dict, dict | None]]:
    """The run's worker steps (``folder/steps``), each with the scheduler step that built its
    metadata: the last one built before the worker bound it (None before the first)."""
    steps = folder / "steps"
    worker = read_jsonl(steps.glob("worker-*.jsonl"))
    sched = read_jsonl(steps.glob("scheduler-*.jsonl"))
    pairs: list[tuple[dict, dict | None]] = []
    j = -1
    for w in worker:
        while j + 1 < len(sched) and sched[j + 1]["t"] <= w["t"]:
            j += 1
        pairs.append((w, sched[j] if j >= 0 else None))
    return pairs


def worker_times(w: dict) -> tuple[float, float, float]:
    """(load copy, forward, save copy) seconds of one worker step."""
    load = w.get("load1", 0.0) - w.get("load0", 0.0)
    return load, max(w["save0"] - w["t"] - load, 0.0), w["save1"] - w["save0"]


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


def request_breakdown(
    folder: Path, requests: Iterable[tuple[str, float, float]]
) -> list[dict[str, Any]]:
    """Where one request's TTFT went, for requests served one at a time: ``(label, sent,
    ttft_s)`` with ``sent`` on the step trace's clock (``time.perf_counter()``). The request's
    prefill is the first step with prefill tokens that the worker bound after ``sent``; its
    TTFT splits into *before* (the API server, the scheduler and any step before it), the
    host-store *load* copy, the *forward* and *after* (sampling, output processing, the stream
    to the client). Requests without such a step are left out."""
    pairs = [(w, s) for w, s in paired_steps(folder) if s is not None and s["prefill"]]
    out: list[dict[str, Any]] = []
    for label, sent, ttft in requests:
        first_token = sent + ttft
        found = next(((w, s) for w, s in pairs if sent <= w["t"] <= first_token), None)
        if found is None:
            continue
        w, s = found
        load, forward, save = worker_times(w)
        out.append(
            {
                "label": label,
                "ttft_s": ttft,
                "prefill_tokens": s["prefill"],
                "load_blocks": s["loads"],
                "before_s": w["t"] - sent,
                "load_s": load,
                "forward_s": forward,
                "save_s": save,
                "after_s": first_token - w["save1"],
            }
        )
    return out


def request_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table of :func:`request_breakdown` rows (milliseconds)."""
    lines = [
        "| request | TTFT ms | prefill tok | load blocks | before ms | load ms | forward ms "
        "| save ms | after ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {1000 * r['ttft_s']:.0f} | {r['prefill_tokens']} "
            f"| {r['load_blocks']} | {1000 * r['before_s']:.0f} | {1000 * r['load_s']:.1f} "
            f"| {1000 * r['forward_s']:.0f} | {1000 * r['save_s']:.1f} "
            f"| {1000 * r['after_s']:.0f} |"
        )
    return "\n".join(lines)


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
