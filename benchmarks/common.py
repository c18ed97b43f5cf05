"""What the kvbranch benchmarks share on the serving side: starting and measuring servers with
the same core binding, and streaming requests timed to the first content token.

The benchmarks talk to the server with plain ``httpx`` (OpenAI-compatible HTTP), not through
the sdk's client, so they measure exactly what a client sees; the stream is parsed by the sdk's
public SSE parser and every kvbranch wire name (paths, xargs, the ``kvbranch`` split and stats
fields) comes from :mod:`sdk.contract`. Reports: :mod:`benchmarks.reporting`; synthetic text:
:mod:`benchmarks.textgen`.
(Over 400 lines on purpose: every benchmark's shared parts — servers, the streaming client,
timings, machine details — in one place, so that each configuration is measured the same way.)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.textgen import random_token_ids  # noqa: E402
from sdk.contract import (  # noqa: E402
    BRANCH_XARG,
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    RESPONSE_FIELD,
    ROUTE_HEADER,
    SESSIONS_PATH,
    STATS_PATH,
    CreateSessionRequest,
    ForkRequest,
    PromptSourceSplit,
    Stats,
    branches_path,
    prefetch_path,
)
from sdk.sse import aiter_sse  # noqa: E402
from server.launcher.process import MODEL_NAME, ServerProcess  # noqa: E402

BLOCK_TOKENS = 128
#: Issue 14: a turn recomputes at most its new tokens (never seen by the server; the previous
#: reply is not new, the server generated it) plus this much template glue.
GLUE_TOKENS = 8
#: vLLM's own OpenAI-body fields that carry a kvbranch session and branch (sdk/contract's
#: docstring): the session id, and the extension arguments the branch xarg rides in.
SESSION_FIELD = "session_id"
XARGS_FIELD = "vllm_xargs"

__all__ = ["BLOCK_TOKENS", "MODEL_NAME", "ServerProcess"]  # re-exported for the benchmarks


# --- command line --------------------------------------------------------------------------------
#: vLLM's CPU backend reserves one core for its scheduler process, plus one more whenever a KV
#: connector is configured; on a 2-core machine that binds plain vLLM's model to 1 OpenMP
#: thread and kvbranch's to 2 (the reservation exceeds the cores and is dropped). The
#: benchmarks pin the same reservation for every configuration so that they compute alike.
DEFAULT_RESERVED_CPUS = 1
#: Launcher flags for vLLM's own first-come-first-served scheduling (docs/scheduling.md): what
#: plain vLLM runs with, and kvbranch "without the policy" in the side-by-side runs.
SCHEDULER_OFF_FLAGS = ["--no-agent-priority", "--cold-prefill-chunk", "0"]


def add_run_args(ap: argparse.ArgumentParser, seed: int = 0, reserved_cpus: bool = True) -> None:
    """The options every server benchmark has: seed and the core reservation (the dispatcher,
    :mod:`benchmarks.cli`, adds ``--no-results``)."""
    ap.add_argument("--seed", type=int, default=seed)
    if reserved_cpus:
        ap.add_argument(
            "--reserved-cpus",
            type=int,
            default=DEFAULT_RESERVED_CPUS,
            help="VLLM_CPU_NUM_OF_RESERVED_CPU for every server, so that all "
            "configs get the same OpenMP cores (vLLM otherwise reserves one more "
            "core when a KV connector is loaded); -1: leave vLLM's default",
        )


def add_server_args(
    ap: argparse.ArgumentParser,
    kv_cache_gib: float,
    max_model_len: int,
    host_store_gib: float | None = 2.0,
) -> None:
    """The server sizes every configuration of a run shares (``host_store_gib=None``: the
    benchmark has no host-store option)."""
    ap.add_argument(
        "--kv-cache-gib",
        type=float,
        default=kv_cache_gib,
        help="device KV budget of every configuration (1 GiB ~ 23k tokens)",
    )
    ap.add_argument("--max-model-len", type=int, default=max_model_len)
    if host_store_gib is not None:
        ap.add_argument(
            "--host-store-gib", type=float, default=host_store_gib, help="kvbranch host store size"
        )


# --- servers -------------------------------------------------------------------------------------
def server_args(
    connector: bool,
    kv_cache_gib: float,
    host_store_gib: float,
    max_model_len: int,
    extra: list[str] | None = None,
) -> list[str]:
    args = ["--kv-cache-gib", str(kv_cache_gib), "--max-model-len", str(max_model_len)]
    if connector:
        args += ["--host-store-gib", str(host_store_gib)]
    else:
        args += ["--no-connector"]
    return args + list(extra or [])


def start_server(
    name: str,
    args: list[str],
    reserved_cpus: int | None = DEFAULT_RESERVED_CPUS,
    ready_timeout: float = 1200.0,
    env: dict[str, str] | None = None,
) -> ServerProcess:
    """Start ``python -m server`` with the shared core reservation. The generous readiness wait
    is for shared machines: a start took over 10 minutes at a load average of 80 on 2 cores."""
    env = dict(env or {})
    if reserved_cpus is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved_cpus)
    shown = " ".join([*(f"{k}={v}" for k, v in env.items()), "python -m server", *args])
    print(f"[{name}] starting server: {shown}", flush=True)
    t0 = time.monotonic()
    server = ServerProcess(args, name=name, env=env, ready_timeout=ready_timeout).start()
    print(
        f"[{name}] ready at {server.url} after {time.monotonic() - t0:.0f}s "
        f"(log {server.log_path}); {omp_binding(server)}",
        flush=True,
    )
    return server


@dataclass
class ServerSpec:
    """One server of a side-by-side run: launcher arguments, extra environment, core reservation
    (``None``: vLLM's default, as for ``--disagg``)."""

    args: list[str]
    env: dict[str, str] = field(default_factory=dict)
    reserved_cpus: int | None = DEFAULT_RESERVED_CPUS


@contextlib.contextmanager
def servers_up(specs: dict[str, ServerSpec]) -> Iterator[dict[str, ServerProcess]]:
    """Every named server up at once (the interleaved A/B benchmarks), all stopped on exit,
    also when one fails to start."""
    servers: dict[str, ServerProcess] = {}
    try:
        for name, spec in specs.items():
            servers[name] = start_server(
                name, spec.args, reserved_cpus=spec.reserved_cpus, env=spec.env
            )
        yield servers
    finally:
        for server in servers.values():
            server.stop()


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

        assert server.proc is not None
        for child in psutil.Process(server.proc.pid).children():
            pgids.add(os.getpgid(child.pid))
    except Exception:  # noqa: BLE001 - without psutil, the router's group only
        pass
    return pgids


class MemorySampler:
    """Peak summed RSS of every process in some process groups (a server's, or a P/D router's
    and its instances'), sampled in a thread through psutil (a server dependency). RSS sums
    count shared pages once per process (an upper bound)."""

    method = "psutil"  # how the reports say the peak was read

    def __init__(self, pgid: int | set[int], interval_s: float = 0.5) -> None:
        self.pgids = {pgid} if isinstance(pgid, int) else set(pgid)
        self.interval_s = interval_s
        self.peak_bytes = 0
        self.peak_procs = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _rss(self) -> tuple[int, int]:
        import psutil

        total, procs = 0, 0
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) in self.pgids:
                    total += proc.memory_info().rss
                    procs += 1
            except (ProcessLookupError, psutil.Error, OSError):
                continue
        return total, procs

    def sample(self) -> int:
        total, procs = self._rss()
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_procs = total, procs
        return total

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# --- requests ------------------------------------------------------------------------------------
def greedy_turn(messages: list[dict], max_tokens: int, session_id: str) -> dict[str, Any]:
    """The body of one greedy chat turn of a conversation on a kvbranch session (plain vLLM
    ignores the session field): what the multi-turn benchmarks send every turn."""
    return {
        "model": MODEL_NAME,
        "messages": messages,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        **session_fields(session_id),
    }


def session_fields(session_id: str, branch: str | None = None) -> dict[str, Any]:
    """The body fields that put a chat completion on a kvbranch session (and branch)."""
    body: dict[str, Any] = {SESSION_FIELD: session_id}
    if branch is not None:
        body[XARGS_FIELD] = {BRANCH_XARG: branch}
    return body


@dataclass
class StreamResult:
    ttft_s: float
    total_s: float
    content: str
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    split: dict | None = None  # the server's kvbranch accounting (PromptSourceSplit), if any
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    remote_hit_tokens: int = 0
    recomputed_tokens: int = 0
    started_at: float = 0.0
    extra: dict = field(default_factory=dict)
    #: When the request was sent, on ``time.perf_counter()`` (the server's step trace clock).
    sent_perf: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def turn_row(res: StreamResult, **context: Any) -> dict[str, Any]:
    """One streamed turn as the multi-turn benchmarks record it: ``context`` (conversation,
    turn, ...) first, then TTFT, prompt tokens by source, the P/D route and the answer."""
    return {
        **context,
        "ttft_s": res.ttft_s,
        "total_s": res.total_s,
        "prompt_tokens": res.prompt_tokens,
        "completion_tokens": res.completion_tokens,
        "device_hit_tokens": res.device_hit_tokens,
        "host_hit_tokens": res.host_hit_tokens,
        "remote_hit_tokens": res.remote_hit_tokens,
        "recomputed_tokens": res.recomputed_tokens,
        "content": res.content,
        "load1": res.extra.get("load1"),
        "prefill_leg_s": res.extra.get("prefill_leg_s"),
        "route": res.extra.get("route"),
    }


def _finish(result: StreamResult, split: PromptSourceSplit | None) -> StreamResult:
    if split is not None:
        result.split = split.model_dump()
        result.device_hit_tokens = split.device_hit_tokens
        result.host_hit_tokens = split.host_hit_tokens
        result.remote_hit_tokens = split.remote_hit_tokens
        result.recomputed_tokens = split.recomputed_tokens
    else:  # plain vLLM: its own prefix-cache count is all device hits
        result.device_hit_tokens = result.cached_tokens
        result.recomputed_tokens = result.prompt_tokens - result.cached_tokens
    return result


def server_timings(header: str) -> dict[str, float]:
    """``Server-Timing: prefill;dur=812.3, x;dur=1`` -> ``{"prefill": 812.3, "x": 1.0}`` (ms)."""
    out: dict[str, float] = {}
    for metric in header.split(","):
        name, _, params = metric.strip().partition(";")
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key == "dur" and name:
                try:
                    out[name] = float(value)
                except ValueError:
                    pass
    return out


async def stream_request(
    client: httpx.AsyncClient,
    url: str,
    body: dict,
    headers: dict | None = None,
    timeout_s: float = 1800.0,
) -> StreamResult:
    """POST a streaming chat or text completion; TTFT is the time to the first chunk that
    carries content (non-empty ``delta.content`` / ``text``); usage and the ``kvbranch`` split
    come from the final usage chunk."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    chat = url.endswith(CHAT_COMPLETIONS_PATH)
    started = time.time()
    t0 = time.perf_counter()
    ttft = None
    pieces: list[str] = []
    usage: dict = {}
    split = None
    async with client.stream(
        "POST", url, json=body, headers=headers or {}, timeout=timeout_s
    ) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            raise RuntimeError(f"{url} -> HTTP {resp.status_code}: {text[:500]}")
        timings = server_timings(resp.headers.get("server-timing", ""))
        route = resp.headers.get(ROUTE_HEADER)
        async for event in aiter_sse(resp.aiter_bytes()):
            if event.data.strip() == "[DONE]":
                break
            chunk = json.loads(event.data)
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content") if chat else choice.get("text")
                if piece:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    pieces.append(piece)
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get(RESPONSE_FIELD):
                split = PromptSourceSplit.model_validate(chunk[RESPONSE_FIELD])
    total = time.perf_counter() - t0
    details = usage.get("prompt_tokens_details") or {}
    result = StreamResult(
        ttft_s=ttft if ttft is not None else total,
        total_s=total,
        content="".join(pieces),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        completion_tokens=int(usage.get("completion_tokens", 0)),
        cached_tokens=int(details.get("cached_tokens") or 0),
        started_at=started,
        sent_perf=t0,
    )
    result.extra["load1"] = os.getloadavg()[0]  # the machine is shared: record how busy
    if route is not None:  # the P/D router: which way the turn went
        result.extra["route"] = route
    if "prefill" in timings:  # the P/D router: P's leg of the turn
        result.extra["prefill_leg_s"] = timings["prefill"] / 1000.0
    if timings:  # the P/D router's phases of the turn (server/router/turn.py), in ms
        result.extra["timings_ms"] = timings
    if ttft is None:
        result.extra["no_content"] = True
    return _finish(result, split)


async def stream_chat(client: httpx.AsyncClient, base_url: str, body: dict) -> StreamResult:
    """:func:`stream_request` on the server's chat completions route."""
    return await stream_request(client, f"{base_url}{CHAT_COMPLETIONS_PATH}", body)


async def cold_prefill_ttft(
    client: httpx.AsyncClient, base_url: str, rng: random.Random, n_tokens: int
) -> StreamResult:
    """TTFT of a never-seen prompt of exactly ``n_tokens`` tokens (text completion of token
    ids, 1 output token): the cost of prefilling only that many tokens from scratch."""
    body = {
        "model": MODEL_NAME,
        "prompt": random_token_ids(rng, n_tokens),
        "max_tokens": 1,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return await stream_request(client, f"{base_url}{COMPLETIONS_PATH}", body)


# --- kvbranch routes -----------------------------------------------------------------------------
async def get_stats(client: httpx.AsyncClient, base_url: str) -> Stats | None:
    """The server's kvbranch counters, or None where there are none (plain vLLM)."""
    try:
        resp = await client.get(f"{base_url}{STATS_PATH}", timeout=30)
    except httpx.HTTPError:
        return None
    return Stats.model_validate(resp.json()) if resp.status_code == 200 else None


async def create_session(
    client: httpx.AsyncClient, base_url: str, session_id: str
) -> httpx.Response:
    body = CreateSessionRequest(session_id=session_id).model_dump(exclude_none=True)
    return await client.post(f"{base_url}{SESSIONS_PATH}", json=body, timeout=60)


async def fork_branch(
    client: httpx.AsyncClient, base_url: str, session_id: str, parent: str, branch_id: str
) -> httpx.Response:
    body = ForkRequest(parent=parent, branch_id=branch_id).model_dump(exclude_none=True)
    return await client.post(f"{base_url}{branches_path(session_id)}", json=body, timeout=60)


async def prefetch_branch(
    client: httpx.AsyncClient,
    base_url: str,
    session_id: str,
    branch_id: str,
    to_device: bool = False,
) -> httpx.Response:
    return await client.post(
        f"{base_url}{prefetch_path(session_id, branch_id)}",
        json={"to_device": to_device},
        timeout=60,
    )


def describe_stats(st: Stats) -> str:
    """The server's counters at the end of a run, in one line of a report."""
    store = st.store
    return (
        f"prompt tokens by source {st.hits_tokens}, prefetches {st.prefetches}, store "
        f"{store.used_blocks}/{store.capacity_blocks} blocks used, evictions "
        f"{store.evictions}, saved {store.saved_blocks}, loaded {store.loaded_blocks}, "
        f"pins degraded {st.pins_degraded}"
    )
