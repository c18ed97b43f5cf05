"""The workloads :mod:`benchmarks.pd_turns` runs through each P/D configuration, all returning
the same turn rows (:func:`benchmarks.common.turn_row` plus ``conversation``, ``branch`` and
``turn``), so that the report and the answer check are one for all:

* ``conversations`` — synthetic tool-using conversations (a system prompt, then a tool
  observation of ``--new-tokens`` per turn), the model's answers fed back; one at a time, or
  turn by turn across conversations (``--interleave``: with a small budget P's own cache
  cannot keep a conversation between its turns); with ``--reset-p-cache`` P's device prefix
  cache is emptied before every turn after the first (the setting vLLM's bidirectional mode
  was proposed for: P has lost the conversation, D still holds it);
* ``agents`` — the forking agents of :mod:`benchmarks.agent_workload` (concurrent sessions,
  tool pauses, each session forking into 2 branches at ``--fork-turn``), its own runner: the
  kvbranch configurations use the session, fork and prefetch routes as there, the others send
  the same requests with the session and branch in the body only;
* ``bfcl`` — the BFCL multi-turn traces of :mod:`benchmarks.bfcl_traces`, concurrently, one
  step after the other per conversation. The model's answers are *not* fed back (each step's
  prompt holds the trace's own tool calls), so a turn's prompt does not extend what D generated
  the turn before: the case where a pull must stop at the common prefix (docs/pd_notes.md
  pitfall 5);
* ``mooncake`` — Mooncake's production conversation trace (:mod:`benchmarks.traces.mooncake`:
  token-id prompts on text completions, the trace's think times scaled by
  ``--mooncake-time-scale``), its conversations concurrently, one step after the other. Not
  fed back either: a turn shares with the one before only the trace's common blocks, which each
  row carries as ``shared_tokens`` (what an unbounded cache could reuse).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from benchmarks import common, reporting
from benchmarks.textgen import text_of_tokens
from sdk.contract import COMPLETIONS_PATH, DEFAULT_BRANCH

WORKLOADS = ("conversations", "agents", "bfcl", "mooncake")


def add_workload_arguments(parser: argparse.ArgumentParser, default: str = "conversations") -> None:
    """The options of the workloads, for every benchmark that runs them."""
    parser.add_argument("--workload", choices=WORKLOADS, default=default)
    reporting.add_int_args(parser, {"--conversations": 4, "--turns": 6, "--system-tokens": 500})
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=180,
        help="tool observation tokens added per turn (default %(default)s)",
    )
    parser.add_argument("--gen-tokens", type=int, default=32)
    parser.add_argument(
        "--interleave",
        action="store_true",
        help="conversations: round-robin turn by turn (so that a small cache cannot keep a "
        "conversation between its turns: on P/D, the case the D->P pull is for)",
    )
    parser.add_argument("--fork-turn", type=int, default=3, help="agents: the turn that forks")
    parser.add_argument("--pause-s", type=float, default=1.0, help="agents, bfcl: tool time")
    parser.add_argument(
        "--bfcl-max-chars",
        type=int,
        default=14000,
        help="bfcl: only traces whose last step is at most this long (so that they fit the "
        "max model length a small budget holds)",
    )
    parser.add_argument(
        "--mooncake-block-tokens",
        type=int,
        default=32,
        help="mooncake: tokens standing for one 512-token trace block (default %(default)s)",
    )
    parser.add_argument(
        "--mooncake-time-scale",
        type=float,
        default=0.02,
        help="mooncake: the trace's think times times this (default %(default)s)",
    )
    parser.add_argument(
        "--mooncake-max-prompt-tokens",
        type=int,
        default=3000,
        help="mooncake: only conversations whose scaled prompts are at most this long",
    )


def conversation_turns(
    seed: int, turns: int, system_tokens: int, new_tokens: int
) -> tuple[str, list[str]]:
    rng = random.Random(seed)
    system = "You are an agent that uses tools. Notes: " + text_of_tokens(rng, system_tokens)
    users = [f"Task {seed}: inspect the logs and report." + text_of_tokens(rng, 40)]
    users += [
        f"Tool result {t}: " + text_of_tokens(rng, new_tokens, style="observation")
        for t in range(1, turns)
    ]
    return system, users


def turn_order(conversations: int, turns: int, interleave: bool) -> list[tuple[int, int]]:
    """(conversation, turn) in request order: each conversation to its end, or (``interleave``)
    turn t of every conversation before turn t+1 of any, so that the others' turns pass
    between two turns of one conversation."""
    if interleave:
        return [(c, t) for t in range(1, turns + 1) for c in range(conversations)]
    return [(c, t) for c in range(conversations) for t in range(1, turns + 1)]


def _log_row(log: reporting.Progress, name: str, row: dict[str, Any]) -> None:
    log(
        f"[{name}] {row['conversation']}/{row['branch']} turn {row['turn']}: TTFT "
        f"{row['ttft_s']:.2f}s, prompt {row['prompt_tokens']} (device {row['device_hit_tokens']}, "
        f"host {row['host_hit_tokens']}, remote {row['remote_hit_tokens']}, recomputed "
        f"{row['recomputed_tokens']})"
    )


#: Before a turn: empty P's device prefix cache (``--reset-p-cache``), or nothing.
BeforeTurn = Callable[[], Awaitable[None]] | None


async def conversations(
    client: httpx.AsyncClient,
    url: str,
    args: argparse.Namespace,
    log: reporting.Progress,
    name: str,
    before_turn: BeforeTurn = None,
) -> list[dict[str, Any]]:
    convs = {
        c: conversation_turns(args.seed + c, args.turns, args.system_tokens, args.new_tokens)
        for c in range(args.conversations)
    }
    history = {c: [{"role": "system", "content": system}] for c, (system, _) in convs.items()}
    rows = []
    for conv, turn in turn_order(args.conversations, args.turns, args.interleave):
        messages = history[conv]
        messages.append({"role": "user", "content": convs[conv][1][turn - 1]})
        body = common.greedy_turn(messages, args.gen_tokens, f"pd-bench-{conv}")
        if before_turn is not None and turn > 1:
            await before_turn()
        res = await common.stream_chat(client, url, body)
        rows.append(common.turn_row(res, conversation=str(conv), branch=DEFAULT_BRANCH, turn=turn))
        _log_row(log, name, rows[-1])
        messages.append({"role": "assistant", "content": res.content})
    return rows


async def agents(
    client: httpx.AsyncClient,
    url: str,
    args: argparse.Namespace,
    log: reporting.Progress,
    name: str,
    sessions_api: bool,
) -> list[dict[str, Any]]:
    from benchmarks.agent_sessions import Runner, build_workload

    params = {
        "sessions": args.conversations,
        "turns": args.turns,
        "obs_tokens": args.new_tokens,
        "gen_tokens": args.gen_tokens,
        "system_tokens": args.system_tokens,
        "tools": 4,
        "pause_min": args.pause_s / 2,
        "pause_max": args.pause_s * 1.5,
        "fork_turn": args.fork_turn,
        "branches": 2,
        "stagger_s": 2.0,
        "seed": args.seed,
    }
    runner = Runner(name, sessions_api, url, build_workload(params), args.gen_tokens, client, log)
    await runner.run()
    if runner.errors:
        raise RuntimeError(f"{name}: {runner.errors[:3]}")
    fields = {f.name for f in dataclasses.fields(common.StreamResult)}
    return [
        common.turn_row(
            common.StreamResult(**{k: v for k, v in r.items() if k in fields}),
            conversation=r["session"],
            branch=r["branch"],
            turn=r["turn"],
        )
        for r in runner.records
    ]


async def bfcl(
    client: httpx.AsyncClient,
    url: str,
    args: argparse.Namespace,
    log: reporting.Progress,
    name: str,
) -> list[dict[str, Any]]:
    from benchmarks import bfcl_traces

    convs = bfcl_traces.load(args.conversations, args.turns, max_chars=args.bfcl_max_chars)
    rows: list[dict[str, Any]] = []

    async def one(conv: dict[str, Any]) -> None:
        for step, messages in enumerate(conv["steps"]):
            body = common.greedy_turn(messages, args.gen_tokens, f"bfcl-{conv['id']}")
            res = await common.stream_chat(client, url, body)
            rows.append(
                common.turn_row(res, conversation=conv["id"], branch=DEFAULT_BRANCH, turn=step + 1)
            )
            _log_row(log, name, rows[-1])
            await asyncio.sleep(args.pause_s)

    await asyncio.gather(*(one(c) for c in convs))
    return rows


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens ``a`` and ``b`` have in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


async def mooncake(
    client: httpx.AsyncClient,
    url: str,
    args: argparse.Namespace,
    log: reporting.Progress,
    name: str,
) -> list[dict[str, Any]]:
    from benchmarks.traces import mooncake as trace

    convs = trace.load(
        args.conversations,
        max_turns=args.turns,
        tokens_per_block=args.mooncake_block_tokens,
        time_scale=args.mooncake_time_scale,
        max_tokens=args.gen_tokens,
        max_prompt_tokens=args.mooncake_max_prompt_tokens,
        seed=args.seed,
    )
    rows: list[dict[str, Any]] = []

    async def one(conv: Any) -> None:
        previous: list[int] = []
        for step, item in enumerate(conv.steps):
            await asyncio.sleep(item.pause_s)
            prompt = item.body["prompt"]
            body = {
                "model": common.MODEL_NAME,
                "prompt": prompt,
                "temperature": 0.0,
                "max_tokens": item.max_tokens,
                **common.session_fields(conv.id),
            }
            res = await common.stream_request(client, f"{url}{COMPLETIONS_PATH}", body)
            row = common.turn_row(res, conversation=conv.id, branch=DEFAULT_BRANCH, turn=step + 1)
            row["shared_tokens"] = shared_prefix(previous, prompt)
            rows.append(row)
            _log_row(log, name, row)
            previous = prompt

    await asyncio.gather(*(one(c) for c in convs))
    return rows


async def run_workload(
    client: httpx.AsyncClient,
    url: str,
    args: argparse.Namespace,
    log: reporting.Progress,
    name: str,
    sessions_api: bool,
    before_turn: BeforeTurn = None,
) -> list[dict[str, Any]]:
    if args.workload == "agents":
        return await agents(client, url, args, log, name, sessions_api)
    if args.workload == "bfcl":
        return await bfcl(client, url, args, log, name)
    if args.workload == "mooncake":
        return await mooncake(client, url, args, log, name)
    return await conversations(client, url, args, log, name, before_turn)
