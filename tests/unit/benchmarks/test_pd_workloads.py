"""The mooncake workload of benchmarks/pd_workloads.py against a fake server: token-id prompts on
text completions with the conversation as the session, one row per step carrying what it
shares with the step before (the reuse ceiling of a trace whose turns are not fed back)."""

from __future__ import annotations

import argparse
import asyncio
import json

import httpx

from benchmarks import pd_workloads
from benchmarks.traces import mooncake
from sdk.contract import COMPLETIONS_PATH


def test_shared_prefix_counts_the_common_leading_tokens() -> None:
    assert pd_workloads.shared_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert pd_workloads.shared_prefix([], [1]) == 0
    assert pd_workloads.shared_prefix([1, 2], [1, 2, 3]) == 2


def test_mooncake_replays_the_trace_on_completions_with_sessions() -> None:
    parser = argparse.ArgumentParser()
    pd_workloads.add_workload_arguments(parser)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(
        ["--workload", "mooncake", "--conversations", "2", "--turns", "3"]
        + ["--mooncake-time-scale", "0", "--gen-tokens", "4"]
    )
    sent: list[dict] = []

    def answer(request: httpx.Request) -> httpx.Response:
        assert request.url.path == COMPLETIONS_PATH
        body = json.loads(request.content)
        sent.append(body)
        n = len(body["prompt"])
        usage = {"prompt_tokens": n, "completion_tokens": 1}
        events = [{"choices": [{"text": "x"}]}, {"choices": [], "usage": usage}]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return httpx.Response(200, text=text, headers={"content-type": "text/event-stream"})

    async def go() -> list[dict]:
        transport = httpx.MockTransport(answer)
        async with httpx.AsyncClient(transport=transport) as client:
            return await pd_workloads.run_workload(
                client, "http://fake", args, lambda *_: None, "t", False
            )

    rows = asyncio.run(go())
    convs = mooncake.load(2, max_turns=3, max_prompt_tokens=args.mooncake_max_prompt_tokens)
    assert len(rows) == sum(len(c.steps) for c in convs)
    assert {b["session_id"] for b in sent} == {c.id for c in convs}
    for conv in convs:
        mine = sorted((r for r in rows if r["conversation"] == conv.id), key=lambda r: r["turn"])
        prompts = [s.body["prompt"] for s in conv.steps]
        assert [r["prompt_tokens"] for r in mine] == [len(p) for p in prompts]
        assert mine[0]["shared_tokens"] == 0
        for r, before, now in zip(mine[1:], prompts, prompts[1:], strict=False):
            assert r["shared_tokens"] == pd_workloads.shared_prefix(before, now) > 0
