"""Multi-turn TTFT on prefill/decode disaggregation, side by side in one run, at each device
budget (``--kv-cache-gib 0.15 1.5``: small, P's own cache cannot keep the conversations; ample):

* ``pd-upstream``    — **upstream P/D**: vLLM's own bidirectional P/D, two plain vLLM 0.32
                       instances with vLLM's ``NixlConnector`` (``bidirectional_kv_xfer``) and a
                       minimal proxy that carries D's params to the next turn's P
                       (:mod:`benchmarks.upstream_pd`; its CPU-host fixes are named there and in
                       docs/pd.md, "The upstream baseline");
* ``pd-kvbranch``    — kvbranch P/D (``python -m server --disagg``): NIXL bidirectional with
                       verified handles, the host store, the kvbranch router;
* ``pd``             — P/D without the pull (``--disagg --no-connector --no-bidirectional``):
                       kvbranch's launcher, router and ``VerifiedNixlConnector`` with no D->P
                       pull and no host store (P recomputes what its own prefix cache lacks).
                       Not upstream: kvbranch's request guard and handle checks still run. The
                       key stays ``pd`` for the records of earlier runs;
* ``single-kvbranch``, ``single-plain`` (opt-in) — one instance on core 0, kvbranch or
                       ``--no-connector``;
* ``pd-kvbranch-sched`` (opt-in) — kvbranch P/D with ``--agent-priority``; ``<config>-spin1000``
                       and ``<config>-poll1``: vLLM's own message-queue spin and idle poll.

    .venv/bin/python -m benchmarks pd_turns                               # conversations
    .venv/bin/python -m benchmarks pd_turns --interleave                  # P's cache short
    .venv/bin/python -m benchmarks pd_turns --conversations 1 --reset-p-cache  # P's cache gone
    .venv/bin/python -m benchmarks pd_turns --workload agents             # forking agents
    .venv/bin/python -m benchmarks pd_turns --workload bfcl --turns 3     # BFCL traces
    .venv/bin/python -m benchmarks pd_turns --conversations 2 --turns 3 --kv-cache-gib 0.5

The workloads: :mod:`benchmarks.pd_workloads`. Every configuration gets fresh servers on the
same cores (P on core 0, D on core 1; single on core 0), one configuration at a time; at a
budget too small for ``--max-model-len`` the run's max model length is what the budget holds.
TTFT is measured at the first streamed content token through the router, the proxy or the
single server; greedy answers are compared across every configuration and budget, turn by turn.
Tokens pulled from D: the kvbranch split's ``remote_hit_tokens``, and for upstream P's own
``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``.

Raw data: benchmarks/out/pd_turns-<time>.json; plot: benchmarks/plots/pd_turns.png; the report is
printed and the records written to benchmarks/results/ (unless --no-results).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks import cli, common, reporting  # noqa: E402
from benchmarks.pd_report import UPSTREAM, plot, records_of, report  # noqa: E402
from benchmarks.pd_workloads import (  # noqa: E402
    add_workload_arguments,
    conversation_turns,
    run_workload,
    turn_order,
)
from benchmarks.records import Record  # noqa: E402
from benchmarks.upstream_pd import UpstreamPD  # noqa: E402
from benchmarks.upstream_pd.cluster import PULLED  # noqa: E402

__all__ = ["conversation_turns", "turn_order"]  # re-exported for cluster_agents and the tests

NAME = "pd_turns"
DESCRIPTION = (
    "multi-turn TTFT on P/D: vLLM's own bidirectional P/D vs kvbranch P/D vs P/D without the "
    "pull, at a small and an ample device budget"
)
CONFIGS: dict[str, list[str]] = {
    "pd": ["--disagg", "--no-connector", "--no-bidirectional"],
    "pd-kvbranch": ["--disagg"],
    "single-kvbranch": ["--cpu-cores", "0"],
    "single-plain": ["--cpu-cores", "0", "--no-connector"],
    # kvbranch P/D with agent-aware scheduling (off by default on P/D instances).
    "pd-kvbranch-sched": ["--disagg", "--agent-priority"],
    # kvbranch P/D with every turn through P (the D holding a branch never serves it alone).
    "pd-kvbranch-split": ["--disagg", "--router-policy", "always-split"],
    # kvbranch P/D with NIXL's threads at nice 19 from the start (the default watches them).
    "pd-kvbranch-lowered": ["--disagg", "--nixl-threads", "lowered"],
}
#: Opt-in: the same with vLLM's own 1 s message-queue busy-wait (the launcher's default is 2 ms,
#: server/engine/spin.py), for the side-by-side measurement of that default.
#: And with vLLM's own 1 ms poll of an engine that only holds blocks for its peer (the launcher's
#: default is 20 ms and a new request ends it at once, server/engine/idle.py).
for _name in list(CONFIGS):
    CONFIGS[f"{_name}-spin1000"] = [*CONFIGS[_name], "--mq-spin-ms", "1000"]
    CONFIGS[f"{_name}-poll1"] = [*CONFIGS[_name], "--idle-poll-ms", "0"]
CONFIGS[UPSTREAM] = []  # not the launcher: benchmarks/upstream_pd
DEFAULT_CONFIGS = [UPSTREAM, "pd-kvbranch", "pd"]
DEFAULT_BUDGETS = [0.15, 1.5]


def fitted_max_len(gib: float, max_model_len: int) -> int:
    """``max_model_len``, or what ``gib`` of device KV holds if less (vLLM and the launcher
    refuse a budget that cannot hold one sequence of the max length)."""
    from server.launcher.cli import kv_bytes_per_token, resolve_model

    per_token = kv_bytes_per_token(resolve_model(None), cuda=False)
    if per_token is None:
        return max_model_len
    blocks = int(gib * 2**30) // per_token // common.BLOCK_TOKENS
    # vLLM's own check leaves one of a budget's whole blocks out.
    return min(max_model_len, (blocks - 1) * common.BLOCK_TOKENS)


class Started:
    """A configuration's servers: its URL, how to stop it, tokens P pulled from D so far
    (``None``: counted from the turns' kvbranch split instead) and P's own URL (``None``: ask
    the router)."""

    def __init__(
        self,
        url: str,
        stop: Callable[[], None],
        pulled: Callable[[], float] | None = None,
        prefill_url: str | None = None,
    ) -> None:
        self.url, self.stop, self.pulled, self.prefill_url = url, stop, pulled, prefill_url
        self.proxy_stats: Callable[[], dict[str, int]] | None = None


#: vLLM's development routes (``/reset_prefix_cache``), on every server of a ``--reset-p-cache``
#: run; the children of ``--disagg`` inherit the environment.
DEV_MODE = {"VLLM_SERVER_DEV_MODE": "1"}


async def prefill_url(client: httpx.AsyncClient, started: Started) -> str:
    """P's URL: known (upstream, single), or the prefill instance the router lists."""
    if started.prefill_url is not None:
        return started.prefill_url
    health = (await client.get(f"{started.url}/v1/kvbranch/health", timeout=30)).json()
    return str(next(i["url"] for i in health["instances"] if i["role"] == "prefill"))


async def reset_device_cache(client: httpx.AsyncClient, url: str) -> None:
    """Empty vLLM's device prefix cache at ``url`` (not kvbranch's host store). vLLM refuses
    while blocks are in use (a prefill leg D has not read yet): retried for up to 30 s."""
    for _ in range(150):
        r = await client.post(f"{url}/reset_prefix_cache", timeout=30)
        if r.status_code == 200 and r.json().get("success", True):
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"{url}: the device prefix cache could not be reset")


def start(name: str, gib: float, max_len: int, args: argparse.Namespace) -> Started:
    if name == UPSTREAM:
        up = UpstreamPD(
            kv_cache_gib=gib,
            max_model_len=max_len,
            hold_ttl_s=int(args.pd_hold_ttl_s),
            failure_policy=args.upstream_failure_policy,
            idle_poll_ms=args.upstream_idle_poll_ms,
            name=f"{name}@{gib:g}",
            env=DEV_MODE if args.reset_p_cache else {},
        ).start()
        started = Started(
            up.url,
            up.stop,
            lambda: up.prompt_tokens_by_source().get(PULLED, 0.0),
            up.prefill.url,
        )
        started.proxy_stats = up.proxy_stats
        return started
    flags = list(CONFIGS[name])
    if "--disagg" in flags:
        flags += ["--pd-hold-ttl-s", str(args.pd_hold_ttl_s)]
    server_args = ["--kv-cache-gib", str(gib), "--max-model-len", str(max_len), *flags]
    env = DEV_MODE if args.reset_p_cache else None
    server = common.start_server(f"bench-{name}", server_args, reserved_cpus=None, env=env)
    return Started(server.url, server.stop, None, None if "--disagg" in flags else server.url)


async def run_config(
    name: str, gib: float, args: argparse.Namespace, log: reporting.Progress
) -> dict[str, Any]:
    max_len = fitted_max_len(gib, args.max_model_len)
    server = start(name, gib, max_len, args)
    out: dict[str, Any] = {"name": f"{name}@{gib:g}GiB", "config": name, "budget_gib": gib}
    try:
        before = server.pulled() if server.pulled else 0.0
        async with httpx.AsyncClient(timeout=1800) as client:
            sessions_api = "kvbranch" in name
            before_turn = None
            if args.reset_p_cache:
                p_url = await prefill_url(client, server)

                async def before_turn() -> None:
                    await reset_device_cache(client, p_url)

            out["turns"] = await run_workload(
                client, server.url, args, log, name, sessions_api, before_turn
            )
        rows = out["turns"]
        pulled = server.pulled() - before if server.pulled else None
        out["pulled_tokens"] = (
            pulled if pulled is not None else sum(t["remote_hit_tokens"] for t in rows)
        )
        out["proxy"] = server.proxy_stats() if server.proxy_stats else None
    finally:
        server.stop()
    out["max_model_len"] = max_len
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--configs",
        nargs="+",
        default=DEFAULT_CONFIGS,
        choices=list(CONFIGS),
        metavar="CONFIG",
        help="in this order (default: %(default)s; all: %(choices)s)",
    )
    add_workload_arguments(parser)
    parser.add_argument(
        "--reset-p-cache",
        action="store_true",
        help="conversations: empty P's device prefix cache before every turn after the first "
        "(vLLM's dev route; kvbranch's host store is kept)",
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        nargs="+",
        default=DEFAULT_BUDGETS,
        help="device KV budget per instance, one run of every configuration per value "
        "(1 GiB ~ 23k tokens; default: %(default)s)",
    )
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument(
        "--pd-hold-ttl-s",
        type=float,
        default=30.0,
        help="how long D holds a turn's blocks (kvbranch's --pd-hold-ttl-s, upstream's "
        "decoder_kv_blocks_ttl)",
    )
    parser.add_argument(
        "--upstream-failure-policy",
        choices=("fail", "recompute"),
        default="fail",
        help="upstream P/D's kv_load_failure_policy (vLLM's default: fail; the proxy then "
        "sends the turn's P leg again without D's params)",
    )
    parser.add_argument(
        "--upstream-idle-poll-ms",
        type=float,
        default=20.0,
        help="upstream P/D: how long an engine that only holds blocks waits between steps, "
        "as every instance kvbranch's launcher starts (0: vLLM's own 1 ms)",
    )
    common.add_run_args(parser, seed=7, reserved_cpus=False)


def run(args: argparse.Namespace) -> list[Record]:
    log = reporting.Progress()
    info_job = reporting.machine_info_async()
    results = [
        asyncio.run(run_config(name, gib, args, log))
        for gib in args.kv_cache_gib
        for name in args.configs
    ]
    elapsed = log.elapsed()
    info = info_job.result()
    out = reporting.raw_path("pd_turns")
    reporting.write_json(out, {"args": vars(args), "machine": info, "results": results})
    png = reporting.plot_path("pd_turns.png", args.no_results)
    plot(results, png)
    reporting.publish(report(results, args, info, elapsed), args.no_results)
    log(f"raw data: {out}")
    return records_of(results, args, reporting.plot_ref(png))


if __name__ == "__main__":
    raise SystemExit(cli.main([NAME, *sys.argv[1:]]))
