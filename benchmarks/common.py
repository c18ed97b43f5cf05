"""Shared helpers of the kvbranch benchmarks: machine details, server start/stop, streaming TTFT
measurement, synthetic text of a given token count, server memory sampling, results writing.

The benchmarks talk to the server with plain ``httpx`` (OpenAI-compatible HTTP), never through
the sdk, so they measure exactly what a client sees.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.server_process import MODEL_NAME, ServerProcess  # noqa: E402  (reused, not copied)

BENCH_DIR = Path(__file__).resolve().parent
OUT_DIR = BENCH_DIR / "out"
RESULTS_MD = BENCH_DIR / "RESULTS.md"
BLOCK_TOKENS = 128


# --- machine -------------------------------------------------------------------------------------
def machine_info() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    ram = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                ram = f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
                break
    except OSError:
        pass
    versions = {}
    probe = ("import json, vllm, torch, transformers; print(json.dumps({'vllm': vllm.__version__,"
             " 'torch': torch.__version__, 'transformers': transformers.__version__}))")
    try:
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             timeout=120, cwd=ROOT)
        versions = json.loads(out.stdout.strip().splitlines()[-1])
    except Exception:  # noqa: BLE001 - best effort
        versions = {}
    return {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "ram": ram,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "vllm": versions.get("vllm", "?"),
        "torch": versions.get("torch", "?"),
        "transformers": versions.get("transformers", "?"),
    }


def machine_info_async():
    """:func:`machine_info` in a background thread; call ``.result()`` on the returned future."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(max_workers=1)
    future = pool.submit(machine_info)
    pool.shutdown(wait=False)
    return future


def machine_md(info: dict[str, str]) -> str:
    return (f"- Machine: {info['cpu']}, {info['cores']} cores, {info['ram']} RAM, "
            f"Linux {info['kernel']}\n"
            f"- Software: Python {info['python']}, vLLM {info['vllm']}, torch {info['torch']}, "
            f"transformers {info['transformers']}\n")


def load_md(loads: list[float]) -> str:
    """One line on how busy the (shared) machine was while measuring."""
    if not loads:
        return ""
    return (f"- Machine load (1-min load average at request starts, {os.cpu_count()} cores): "
            f"min {min(loads):.1f}, median {statistics.median(loads):.1f}, max {max(loads):.1f}"
            " — other developers' servers and tests share these cores, so absolute times are "
            "noisy; compare the configurations side by side")


def now_str() -> str:
    return _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")


def git_rev() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, cwd=ROOT).stdout.strip()
    except Exception:  # noqa: BLE001
        return "?"


def command_line() -> str:
    script = Path(sys.argv[0])
    try:
        script = script.resolve().relative_to(ROOT)
    except ValueError:
        pass
    return " ".join([".venv/bin/python", str(script), *sys.argv[1:]])


# --- tokenizer and synthetic text ----------------------------------------------------------------
_TOKENIZER = None


def tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        from transformers import AutoTokenizer

        from server.model_cache import ensure_model

        _TOKENIZER = AutoTokenizer.from_pretrained(str(ensure_model()))
    return _TOKENIZER


WORDS = ("the a of to and in is for on with as by at from that this it be are was not or "
         "config value request server cache block token session branch agent tool result "
         "error warning file path line function class return import module test build run "
         "deploy service user query index table column row key memory thread process queue "
         "input output status check update create delete read write open close start stop "
         "parse load save retry timeout latency batch model layer vector shard node cluster "
         "network socket handler route event log metric count total size limit offset page "
         "green blue red fast slow small large first last next previous new old local remote "
         "because when while after before during until unless however therefore").split()
IDENTS = ("alpha beta gamma delta sigma omega kappa lambda theta zeta orion vega lyra "
          "cygnus draco hydra").split()


def _observation_line(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return (f"src/{rng.choice(IDENTS)}/{rng.choice(WORDS)}_{rng.randrange(100)}.py:"
                f"{rng.randrange(1, 900)}: {' '.join(rng.choices(WORDS, k=rng.randint(4, 9)))}")
    if kind == 1:
        return (f"{rng.choice(IDENTS)}.{rng.choice(WORDS)} = {rng.randrange(10**6)} "
                f"({rng.choice(['ok', 'warn', 'fail'])}, {rng.random() * 100:.2f} ms)")
    if kind == 2:
        return f"- {' '.join(rng.choices(WORDS, k=rng.randint(8, 16)))}."
    return json.dumps({"id": rng.randrange(10**5), "name": rng.choice(IDENTS),
                       "status": rng.choice(WORDS), "score": round(rng.random(), 3)})


def text_of_tokens(rng: random.Random, n_tokens: int, style: str = "prose") -> str:
    """Deterministic (given ``rng``) text of about ``n_tokens`` tokens of the model's tokenizer."""
    tok = tokenizer()
    parts: list[str] = []
    count = 0
    while count < n_tokens + 8:
        if style == "observation":
            line = _observation_line(rng)
        else:
            line = " ".join(rng.choices(WORDS, k=rng.randint(8, 18))).capitalize() + "."
        parts.append(line)
        count += len(tok.encode(line, add_special_tokens=False)) + 1
    text = ("\n" if style == "observation" else " ").join(parts)
    ids = tok.encode(text, add_special_tokens=False)[:n_tokens]
    return tok.decode(ids)


def random_token_ids(rng: random.Random, n_tokens: int) -> list[int]:
    """Token ids of ordinary words (for cold prefill references): unique per ``rng`` state."""
    tok = tokenizer()
    text = text_of_tokens(rng, n_tokens + 16)
    ids = tok.encode(text, add_special_tokens=False)
    return ids[:n_tokens]


# --- servers -------------------------------------------------------------------------------------
def server_args(connector: bool, kv_cache_gib: float, host_store_gib: float,
                max_model_len: int, extra: list[str] | None = None) -> list[str]:
    args = ["--kv-cache-gib", str(kv_cache_gib), "--max-model-len", str(max_model_len)]
    if connector:
        args += ["--host-store-gib", str(host_store_gib)]
    else:
        args += ["--no-connector"]
    return args + list(extra or [])


class MemorySampler:
    """Peak summed RSS of every process in some process groups (a server's, or a P/D router's
    and its instances'), sampled in a thread (psutil if importable, else /proc). RSS sums count
    shared pages once per process (an upper bound)."""

    def __init__(self, pgid: int | set[int], interval_s: float = 0.5) -> None:
        self.pgids = {pgid} if isinstance(pgid, int) else set(pgid)
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.peak_procs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        try:
            import psutil  # noqa: F401

            self.method = "psutil"
        except ImportError:
            self.method = "/proc"

    def sample(self) -> int:
        total, procs = 0, 0
        if self.method == "psutil":
            import psutil

            for proc in psutil.process_iter(["pid"]):
                try:
                    if os.getpgid(proc.pid) in self.pgids:
                        total += proc.memory_info().rss
                        procs += 1
                except (ProcessLookupError, psutil.Error, OSError):
                    continue
        else:
            page = os.sysconf("SC_PAGE_SIZE")
            for entry in Path("/proc").iterdir():
                if not entry.name.isdigit():
                    continue
                try:
                    stat = (entry / "stat").read_text()
                    fields = stat[stat.rindex(")") + 2:].split()
                    if int(fields[2]) in self.pgids:  # field 5 (pgrp)
                        total += int((entry / "statm").read_text().split()[1]) * page
                        procs += 1
                except (OSError, ValueError, IndexError):
                    continue
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_procs = total, procs
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> "MemorySampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


#: vLLM's CPU backend reserves one core for its scheduler process, plus one more whenever a KV
#: connector is configured; on a 2-core machine that binds plain vLLM's model to 1 OpenMP
#: thread and kvbranch's to 2 (the reservation exceeds the cores and is dropped). The
#: benchmarks pin the same reservation for every configuration so that they compute alike.
DEFAULT_RESERVED_CPUS = 1


def start_server(name: str, args: list[str],
                 reserved_cpus: int | None = DEFAULT_RESERVED_CPUS) -> ServerProcess:
    env = {} if reserved_cpus is None else {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(reserved_cpus)}
    shown = " ".join(f"{k}={v}" for k, v in env.items())
    print(f"[{name}] starting server: {shown} python -m server {' '.join(args)}", flush=True)
    t0 = time.monotonic()
    server = ServerProcess(args, name=name, env=env).start()
    print(f"[{name}] ready at {server.url} after {time.monotonic() - t0:.0f}s "
          f"(log {server.log_path}); {omp_binding(server)}", flush=True)
    return server


def omp_binding(server: ServerProcess) -> str:
    """The engine's OpenMP core binding, from the server log."""
    try:
        text = server.log_path.read_text(errors="replace")
    except OSError:
        return "OpenMP binding unknown"
    for line in text.splitlines():
        if "core ids=" in line:
            return "OpenMP " + line.split("\t")[-1].strip().split("] ")[-1].strip()
    return "OpenMP binding unknown"


def server_pgid(server: ServerProcess) -> int:
    assert server.proc is not None
    return os.getpgid(server.proc.pid)


def server_pgids(server: ServerProcess) -> set[int]:
    """The server's process group plus those of the instances it started (``--disagg``: the
    router's P and D run in process groups of their own)."""
    pgids = {server_pgid(server)}
    try:
        import psutil

        for child in psutil.Process(server.proc.pid).children():
            pgids.add(os.getpgid(child.pid))
    except Exception:  # noqa: BLE001 - without psutil, the router's group only
        pass
    return pgids


# --- streaming requests --------------------------------------------------------------------------
@dataclass
class StreamResult:
    ttft_s: float
    total_s: float
    content: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    split: dict | None = None  # the server's kvbranch accounting, when present
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    recomputed_tokens: int = 0
    started_at: float = 0.0
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def _finish(result: StreamResult) -> StreamResult:
    if result.split:
        result.device_hit_tokens = int(result.split.get("device_hit_tokens", 0))
        result.host_hit_tokens = int(result.split.get("host_hit_tokens", 0))
        result.recomputed_tokens = int(result.split.get("recomputed_tokens", 0))
    else:  # plain vLLM: its own prefix-cache count is all device hits
        result.device_hit_tokens = result.cached_tokens
        result.host_hit_tokens = 0
        result.recomputed_tokens = result.prompt_tokens - result.cached_tokens
    return result


async def stream_request(client: httpx.AsyncClient, url: str, body: dict,
                         headers: dict | None = None, timeout_s: float = 1800.0) -> StreamResult:
    """POST a streaming chat or text completion; TTFT is the time to the first chunk that
    carries content (non-empty ``delta.content`` / ``text``); usage and the ``kvbranch`` split
    come from the final usage chunk."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    chat = url.endswith("/chat/completions")
    started = time.time()
    t0 = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    usage: dict = {}
    split = None
    async with client.stream("POST", url, json=body, headers=headers or {},
                             timeout=timeout_s) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"{url} -> HTTP {resp.status_code}: {text[:500]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data.strip() == "[DONE]":
                break
            chunk = json.loads(data)
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    pieces.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("kvbranch"):
                split = chunk["kvbranch"]
    total = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    result = StreamResult(
        ttft_s=ttft if ttft is not None else total, total_s=total, content="".join(pieces),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens") or 0), split=split, started_at=started)
    result.extra["load1"] = os.getloadavg()[0]  # the machine is shared: record how busy
    if ttft is None:
        result.extra["no_content"] = True
    return _finish(result)


async def cold_prefill_ttft(client: httpx.AsyncClient, base_url: str, rng: random.Random,
                            n_tokens: int) -> StreamResult:
    """TTFT of a never-seen prompt of exactly ``n_tokens`` tokens (text completion of token
    ids, 1 output token): the cost of prefilling only that many tokens from scratch."""
    body = {"model": MODEL_NAME, "prompt": random_token_ids(rng, n_tokens), "max_tokens": 1,
            "temperature": 0.0, "ignore_eos": True}
    return await stream_request(client, f"{base_url}/v1/completions", body)


async def get_stats(client: httpx.AsyncClient, base_url: str) -> dict | None:
    try:
        resp = await client.get(f"{base_url}/v1/kvbranch/stats", timeout=30)
    except httpx.HTTPError:
        return None
    return resp.json() if resp.status_code == 200 else None


# --- numbers and results -------------------------------------------------------------------------
def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    vals = sorted(values)
    if len(vals) == 1:
        return vals[0]
    pos = (len(vals) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(vals) - 1)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def ratio(a: float, b: float) -> str:
    if not b or a != a or b != b:
        return "n/a"
    return f"{a / b:.2f}x"


def md_table(header: list[str], rows: list[list[Any]]) -> str:
    def cell(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def append_results(section: str) -> None:
    """Append a section to benchmarks/RESULTS.md (creating it with a title)."""
    if not RESULTS_MD.exists():
        RESULTS_MD.write_text("# kvbranch benchmark results\n\nSections are appended by the "
                              "benchmark commands in this folder; newest last.\n")
    with RESULTS_MD.open("a") as fh:
        fh.write("\n" + section.rstrip() + "\n")
    print(f"results appended to {RESULTS_MD}", flush=True)


def write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, default=str))


class Progress:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self, msg: str) -> None:
        print(f"[{time.monotonic() - self.t0:7.1f}s] {msg}", flush=True)
