"""A server's profile under a workload, collected while it runs (``--profile-dir`` of
``agent_workload`` and ``turn_ttft``: every configuration gets ``DIR/<config>/``): the
connector's per-step trace (``KVBRANCH_STEP_TRACE``, kvbranch only), vLLM's request-phase
histograms from ``/metrics``, and optional py-spy samples of the server's processes; and, for
requests served one at a time, where each one's TTFT went around its prefill step
(:func:`request_breakdown`, in turn_ttft's report). The breakdown of a whole folder is the
study :mod:`benchmarks.history.step_breakdown`.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path
from typing import Any

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
