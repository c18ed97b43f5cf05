"""A moved session's first turn on its new replica against a local host-store hit, on the same
two replicas under the same background load (the replicas benchmark's ``--moved-probes``).

The workload's own ratio (round robin over session affinity) mixes the pull's cost with where
each front queues a turn; this probe isolates it. Per probe, two sessions of the same shape (a
history of ``--probe-tokens`` tokens, then a short user turn):

* **moved**: turn 1 on replica A, turn 2 on replica B, which pulls the history from A's hold;
* **local**: turn 1 on replica A, A's hold left to end and its device cache reset, turn 2 on
  A, which loads the history from its own host store.

Meanwhile each replica computes cold prompts back to back (``--probe-load`` clients each), so
that an engine step is a real forward, as in a busy cluster. The replicas alternate roles from
probe to probe. ``sync`` replicas load a pull before the step's forward (``--sync-pull-wait-s
2``, the default); ``async`` ones (``--sync-pull-wait-s 0``) load it as vLLM does, two steps
later.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import statistics
from typing import Any

import httpx

from benchmarks import common, reporting
from benchmarks.textgen import text_of_tokens
from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
from server.launcher.process import ServerProcess, free_port

#: The probe replicas' ``--pd-hold-ttl-s``: the local session's turn 2 waits for its hold to
#: end. Shorter, and a claim could not keep the blocks for the pull's safety margin
#: (``CLAIM_MARGIN_S``): the moved turn would recompute.
HOLD_TTL_S = 12.0
#: Between a turn's answer and the next turn, as an agent's tool call takes (the replicas
#: workload's ``--pause-s``): the answered turn's hold is filed in the index meanwhile.
TOOL_S = 1.0
#: Background prompts: this many tokens each, one output token.
LOAD_TOKENS = 384
#: Each second turn (moved and local alike) first waits a random part of this long. The
#: replicas are busy with back-to-back background prefills (one engine step each, 0.3-1 s on
#: the boxes measured); a turn sent a fixed time after the load resumes meets the same point of
#: a step every time, so the step's phase, not the pull, decided the ratio (docs/cluster.md).
ARRIVAL_SPREAD_S = 1.5


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--moved-probes",
        type=int,
        default=6,
        help="probes of a moved turn against a local host-store hit (0: none)",
    )
    parser.add_argument("--probe-tokens", type=int, default=1500, help="each probe's history")
    parser.add_argument(
        "--probe-load", type=int, default=1, help="background clients per replica during probes"
    )
    parser.add_argument(
        "--probe-configs",
        nargs="+",
        default=["sync", "async"],
        choices=["sync", "async"],
        help="sync: pulls loaded before the step's forward; async: --sync-pull-wait-s 0",
    )
    parser.add_argument(
        "--nixl-progress-us",
        type=int,
        default=None,
        metavar="US",
        help="every kvbranch replica's --nixl-progress-us (0: no NIXL progress thread; "
        "default: the server's)",
    )


def transport_args(args: argparse.Namespace) -> list[str]:
    """The kvbranch replicas' NIXL progress-thread setting, when the run names one."""
    if args.nixl_progress_us is None:
        return []
    return ["--nixl-progress-us", str(args.nixl_progress_us)]


def replicas(
    config: str, index: str, secret: str, cores: list[str], args: argparse.Namespace
) -> list[Any]:
    """Two probe replicas on ``cores``: a short hold (the local turn waits for it to end) and
    vLLM's reset route (``VLLM_SERVER_DEV_MODE``)."""
    out = []
    for i, core in enumerate(cores):
        argv = ["--kv-cache-gib", str(args.kv_cache_gib), "--index", index]
        argv += ["--max-model-len", str(args.max_model_len)]
        argv += ["--host-store-gib", str(args.host_store_gib)]
        argv += ["--cpu-cores", core, "--nixl-port", str(free_port())]
        argv += ["--pd-hold-ttl-s", str(HOLD_TTL_S)]
        argv += ["--sync-pull-wait-s", "2" if config == "sync" else "0"]
        argv += transport_args(args)
        env = {ENV_CLUSTER_SECRET: secret, "PYTHONHASHSEED": "0", "VLLM_SERVER_DEV_MODE": "1"}
        out.append(ServerProcess(argv, name=f"probe-{config}-{i}", env=env, ready_timeout=1200))
    return out


class Load:
    """The background clients: running, paused (vLLM resets a device cache only while no block
    is in use) or stopped."""

    def __init__(self) -> None:
        self.running = asyncio.Event()
        self.running.set()
        self.stopped = False
        self.inflight = 0

    async def client(self, client: httpx.AsyncClient, url: str, seed: int) -> int:
        rng, done = random.Random(seed), 0
        while not self.stopped:
            await self.running.wait()
            if self.stopped:
                break
            self.inflight += 1
            try:
                with contextlib.suppress(httpx.HTTPError, RuntimeError):
                    await common.cold_prefill_ttft(client, url, rng, LOAD_TOKENS)
                    done += 1
            finally:
                self.inflight -= 1
        return done

    async def pause(self) -> None:
        self.running.clear()
        while self.inflight:
            await asyncio.sleep(0.05)

    def resume(self) -> None:
        self.running.set()

    def stop(self) -> None:
        self.stopped = True
        self.running.set()


async def _turn(client: httpx.AsyncClient, url: str, messages: list, session: str) -> Any:
    body = common.greedy_turn(messages, 16, session)
    return await common.stream_chat(client, url, body)


async def _reset_device(client: httpx.AsyncClient, url: str, wait_s: float = 30.0) -> None:
    """vLLM's device prefix cache only (the host store stays): refused while any block is in
    use, so retried."""
    deadline = asyncio.get_running_loop().time() + wait_s
    while True:
        r = await client.post(f"{url}/reset_prefix_cache")
        if r.status_code == 200 and r.json().get("success", True):
            return
        if asyncio.get_running_loop().time() > deadline:
            raise RuntimeError(f"{url}: the device cache could not be reset ({r.text[:200]})")
        await asyncio.sleep(0.5)


async def _probe(
    client: httpx.AsyncClient, urls: list[str], k: int, args: argparse.Namespace, load: Load
) -> dict[str, Any]:
    rng = random.Random(1000 + k)
    spread = random.Random(2000 + k)  # apart from rng: the histories stay those of before
    home, other = urls[k % 2], urls[1 - k % 2]
    row: dict[str, Any] = {"probe": k}
    for kind in ("moved", "local"):
        history = text_of_tokens(rng, args.probe_tokens)
        messages = [{"role": "system", "content": history}, {"role": "user", "content": "Go on."}]
        session = f"probe-{kind}-{k}-{rng.randrange(1 << 30)}"
        first = await _turn(client, home, messages, session)
        await asyncio.sleep(TOOL_S)  # the turn's hold reaches the index after its answer
        messages += [
            {"role": "assistant", "content": first.content},
            {"role": "user", "content": "And then?"},
        ]
        if kind == "local":
            await asyncio.sleep(HOLD_TTL_S)  # its hold ends: the blocks are released
            await load.pause()
            try:
                await _reset_device(client, home)
            finally:
                load.resume()
            await asyncio.sleep(1.0)  # the engines are busy again
            await asyncio.sleep(spread.uniform(0.0, ARRIVAL_SPREAD_S))
            second = await _turn(client, home, messages, session)
        else:
            await asyncio.sleep(spread.uniform(0.0, ARRIVAL_SPREAD_S))
            second = await _turn(client, other, messages, session)
        row[kind] = {
            "ttft_s": second.ttft_s,
            "prompt_tokens": second.prompt_tokens,
            "remote_hit_tokens": second.remote_hit_tokens,
            "host_hit_tokens": second.host_hit_tokens,
            "device_hit_tokens": second.device_hit_tokens,
            "recomputed_tokens": second.recomputed_tokens,
        }
    return row


async def run_probes(
    urls: list[str], args: argparse.Namespace, log: reporting.Progress, name: str
) -> list[dict[str, Any]]:
    """The probes on ``urls`` (two replicas), under the background load."""
    load = Load()
    async with httpx.AsyncClient(timeout=600) as client:
        clients = [
            asyncio.create_task(load.client(client, url, 7919 * i + j))
            for i, url in enumerate(urls)
            for j in range(args.probe_load)
        ]
        await asyncio.sleep(2.0)  # the load is running
        rows = []
        try:
            for k in range(args.moved_probes):
                row = await _probe(client, urls, k, args, load)
                log(
                    f"[{name}] probe {k}: moved {row['moved']['ttft_s']:.3f} s "
                    f"(pulled {row['moved']['remote_hit_tokens']}), local "
                    f"{row['local']['ttft_s']:.3f} s (host {row['local']['host_hit_tokens']})"
                )
                rows.append(row)
        finally:
            load.stop()
            await asyncio.gather(*clients)
    return rows


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Medians of the moved and local turns' TTFT, and how many moved turns pulled / local
    turns hit their host store (a probe that did neither measured something else)."""
    moved = [r["moved"]["ttft_s"] for r in rows]
    local = [r["local"]["ttft_s"] for r in rows]
    return {
        "moved": statistics.median(moved) if moved else float("nan"),
        "local": statistics.median(local) if local else float("nan"),
        "pulled": float(sum(1 for r in rows if r["moved"]["remote_hit_tokens"] > 0)),
        "host_hits": float(sum(1 for r in rows if r["local"]["host_hit_tokens"] > 0)),
        "probes": float(len(rows)),
    }
