"""Forking agent sessions: the workload (a shared system prompt with tool schemas, tool
observations, a fork into alternatives at one turn, tool pauses, generated from a seed) and the
runner that plays it against one OpenAI-compatible endpoint, with kvbranch's session, fork and
prefetch routes where the server has them.

Shared by :mod:`benchmarks.agent_workload` (one configuration after the other) and pd_turns'
``agents`` workload (:mod:`benchmarks.pd_workloads`), so that both play the same sessions.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx

from benchmarks import common, reporting
from benchmarks.textgen import count_tokens, text_of_tokens
from sdk.contract import DEFAULT_BRANCH

#: What a workload is generated from (a profile of agent_workload, or pd_turns' options).
WORKLOAD_KEYS = (
    "sessions",
    "turns",
    "obs_tokens",
    "gen_tokens",
    "system_tokens",
    "tools",
    "pause_min",
    "pause_max",
    "fork_turn",
    "branches",
    "stagger_s",
    "seed",
)
TOOL_NAMES = [
    "read_file",
    "grep",
    "run_tests",
    "list_dir",
    "apply_patch",
    "search_docs",
    "http_get",
    "sql_query",
    "shell",
    "git_log",
]
APPROACHES = [
    "a minimal patch",
    "a rewrite of the failing function",
    "a configuration change",
    "reverting the last commit",
    "adding a regression test first",
    "more logging",
]


# --- workload ------------------------------------------------------------------------------------
def tool_schemas(n: int) -> str:
    tools = []
    for name in TOOL_NAMES[:n]:
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": f"{name.replace('_', ' ')} in the workspace",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "target": {"type": "string", "description": "path, pattern or query"},
                            "limit": {"type": "integer", "description": "maximum results"},
                        },
                        "required": ["target"],
                    },
                },
            }
        )
    return "\n".join(json.dumps(t) for t in tools)


def build_workload(p: dict) -> dict:
    rng = random.Random(p["seed"])
    system = (
        "You are an autonomous coding agent. Call one tool per turn by answering with a "
        '<tool_call>{"name": ..., "arguments": {...}}</tool_call> block after one '
        "short sentence of reasoning. Tool results come back in <tool_response> blocks."
        "\n\n<tools>\n" + tool_schemas(p["tools"]) + "\n</tools>\n\nWorkspace notes:\n"
    )
    have = count_tokens(system)
    system += text_of_tokens(rng, max(p["system_tokens"] - have, 16), "prose")
    fork_turn = p["fork_turn"] if p["branches"] > 1 and 2 <= p["fork_turn"] <= p["turns"] else 0
    sessions = []
    for s in range(p["sessions"]):
        lanes: dict[str, list[dict]] = {}
        lane_names = [DEFAULT_BRANCH]
        if fork_turn:
            lane_names += [f"alt{i}" for i in range(p["branches"])]
        for lane in lane_names:
            if lane == DEFAULT_BRANCH:
                turns = range(1, (fork_turn or p["turns"] + 1))
            else:
                turns = range(fork_turn, p["turns"] + 1)
            items = []
            for t in turns:
                if t == 1:
                    head = (
                        f"Task {s}: the {rng.choice(['billing', 'search', 'auth', 'ingest'])}"
                        f" service fails its nightly tests; find the cause and fix it. "
                        f"Here is the output of the first test run."
                    )
                elif lane != DEFAULT_BRANCH and t == fork_turn:
                    i = int(lane[3:])
                    head = (
                        f"Alternative {i}: explore {APPROACHES[i % len(APPROACHES)]}. "
                        f"<tool_response>"
                    )
                else:
                    head = f'<tool_response name="{rng.choice(TOOL_NAMES[: p["tools"]])}">'
                obs = text_of_tokens(rng, p["obs_tokens"], "observation")
                items.append(
                    {
                        "turn": t,
                        "user": f"{head}\n{obs}\n</tool_response>",
                        "pause_s": round(rng.uniform(p["pause_min"], p["pause_max"]), 3),
                    }
                )
            lanes[lane] = items
        sessions.append(
            {
                "session_id": f"agent-s{s}",
                "start_offset_s": round(rng.uniform(0, p["stagger_s"]), 3),
                "lanes": lanes,
            }
        )
    return {
        "params": {k: p[k] for k in WORKLOAD_KEYS},
        "fork_turn": fork_turn,
        "system_tokens_actual": count_tokens(system),
        "system": system,
        "sessions": sessions,
    }


# --- one configuration ---------------------------------------------------------------------------
class Runner:
    def __init__(
        self,
        name: str,
        kvbranch: bool,
        base: str,
        workload: dict,
        gen_tokens: int,
        client: httpx.AsyncClient,
        log: reporting.Progress,
    ) -> None:
        self.name, self.kvbranch, self.base = name, kvbranch, base
        self.workload, self.gen_tokens, self.client, self.log = workload, gen_tokens, client, log
        self.records: list[dict] = []
        self.prefetches: list[dict] = []
        self.forks: list[dict] = []
        self.errors: list[str] = []
        self.t0 = 0.0
        self.n_turns = workload["params"]["turns"]

    async def prefetch(self, sid: str, branch: str) -> None:
        t = time.perf_counter()
        try:
            r = await common.prefetch_branch(
                self.client,
                self.base,
                sid,
                branch,
                to_device=base_config(self.name) == "kvbranch-to-device",
            )
            self.prefetches.append(
                {
                    "session": sid,
                    "branch": branch,
                    "status": r.status_code,
                    "body": r.json(),
                    "latency_s": time.perf_counter() - t,
                }
            )
        except httpx.HTTPError as exc:
            self.errors.append(f"prefetch {sid}/{branch}: {exc}")

    async def run_lane(self, sess: dict, lane: str, messages: list[dict], prev_prompt: int) -> None:
        sid = sess["session_id"]
        fork_turn = self.workload["fork_turn"]
        for item in sess["lanes"][lane]:
            t = item["turn"]
            messages = messages + [{"role": "user", "content": item["user"]}]
            body = {
                "model": common.MODEL_NAME,
                "messages": messages,
                "max_tokens": self.gen_tokens,
                "temperature": 0.0,
                **common.session_fields(sid, lane),
            }
            try:
                res = await common.stream_chat(self.client, self.base, body)
            except Exception as exc:  # noqa: BLE001 - record and end this lane
                self.errors.append(f"{sid}/{lane} turn {t}: {exc}")
                self.log(f"[{self.name}] ERROR {sid}/{lane} turn {t}: {exc}")
                return
            rec = res.to_dict()
            rec.update(
                session=sid,
                branch=lane,
                turn=t,
                new_tokens=res.prompt_tokens - prev_prompt,
                finished_at=time.monotonic() - self.t0,
            )
            self.records.append(rec)
            # The next turn's new tokens: those the server never saw (it generated the reply).
            prev_prompt = res.prompt_tokens + res.completion_tokens
            self.log(
                f"[{self.name}] {sid}/{lane} turn {t}/{self.n_turns}: TTFT {res.ttft_s:.2f}s "
                f"prompt {res.prompt_tokens} (device {res.device_hit_tokens}, host "
                f"{res.host_hit_tokens}, recomputed {res.recomputed_tokens}) out "
                f"{res.completion_tokens}"
            )
            messages = messages + [{"role": "assistant", "content": res.content}]
            if t >= self.n_turns:
                return
            forking = lane == DEFAULT_BRANCH and fork_turn and t == fork_turn - 1
            if self.kvbranch:
                if forking:
                    for alt in [n for n in sess["lanes"] if n != DEFAULT_BRANCH]:
                        r = await common.fork_branch(
                            self.client, self.base, sid, DEFAULT_BRANCH, alt
                        )
                        self.forks.append(
                            {
                                "session": sid,
                                "branch": alt,
                                "status": r.status_code,
                                "body": r.json(),
                            }
                        )
                # Warm the device cache while the tool runs (forks share main's blocks).
                await self.prefetch(sid, lane)
            await asyncio.sleep(item["pause_s"])
            if forking:
                alts = [n for n in sess["lanes"] if n != DEFAULT_BRANCH]
                await asyncio.gather(*(self.run_lane(sess, a, messages, prev_prompt) for a in alts))
                return

    async def run_session(self, sess: dict) -> dict:
        await asyncio.sleep(sess["start_offset_s"])
        start = time.monotonic()
        sid = sess["session_id"]
        if self.kvbranch:
            r = await common.create_session(self.client, self.base, sid)
            if r.status_code != 201:
                self.errors.append(f"create session {sid}: {r.status_code} {r.text[:200]}")
        system = [{"role": "system", "content": self.workload["system"]}]
        await self.run_lane(sess, DEFAULT_BRANCH, system, 0)
        return {"session": sid, "jct_s": time.monotonic() - start}

    async def run(self) -> tuple[list[dict], float]:
        self.t0 = time.monotonic()
        jcts = await asyncio.gather(*(self.run_session(s) for s in self.workload["sessions"]))
        return list(jcts), time.monotonic() - self.t0


# --- configurations ------------------------------------------------------------------------------
def split_config(name: str) -> tuple[str, list[str]]:
    """``kvbranch:--max-num-batched-tokens=512 --max-num-seqs=4`` -> the configuration and the
    vLLM flags it adds."""
    base, _, flags = name.partition(":")
    return base, flags.split()


def base_config(name: str) -> str:
    return split_config(name)[0]
