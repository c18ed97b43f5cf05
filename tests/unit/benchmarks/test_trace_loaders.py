"""Both trace sets load from what the set-up put on the machine — no network at test time: the
BFCL wheel (scripts/setup.sh downloads it with pip into benchmarks/out/data) and Mooncake's
production trace (kept gzipped in benchmarks/traces/data). Real data, checked against what their
publishers state, and the replay's own rules (conversations from prefixes, scaled prompts that
keep the trace's sharing, tool times)."""

from __future__ import annotations

import gzip
import hashlib

import pytest

from benchmarks import bfcl_traces, traces
from benchmarks.traces import bfcl, mooncake

#: The checksum of Mooncake's conversation_trace.jsonl (benchmarks/traces.md).
MOONCAKE_SHA256 = "b8cbb061a85206d729d91cdc2981f43c9e0d99209dce588d3af5f7934408b9df"


def test_the_mooncake_file_is_the_published_one() -> None:
    with gzip.open(mooncake.DATA, "rb") as fh:
        assert hashlib.sha256(fh.read()).hexdigest() == MOONCAKE_SHA256


def test_mooncake_reads_every_request_as_its_readme_states() -> None:
    reqs = mooncake.read()
    assert len(reqs) == 12031  # "Conversation ... 12,031 requests"
    assert reqs[0].hash_ids == tuple(range(14)) and reqs[0].input_length == 6758
    assert all(a.timestamp_ms <= b.timestamp_ms for a, b in zip(reqs, reqs[1:], strict=False))
    avg_in = sum(r.input_length for r in reqs) / len(reqs)
    assert 12000 < avg_in < 12070  # "avg input length 12,035"


def test_mooncake_conversations_follow_prefixes() -> None:
    reqs = [
        mooncake.Request(0, 1500, 5, (0, 1, 2)),  # a user
        mooncake.Request(10, 1500, 5, (0, 7, 8)),  # another: only the system block is shared
        mooncake.Request(20, 2100, 5, (0, 1, 2, 3, 4)),  # the first user's next turn
        mooncake.Request(30, 2100, 5, (0, 1, 9, 10, 11)),  # shares 2 blocks: that user again
        mooncake.Request(40, 900, 5, (5,)),
    ]
    assert mooncake.chains(reqs) == [[0, 2, 3], [1], [4]]
    real = mooncake.chains(mooncake.read())
    assert sum(len(c) > 1 for c in real) == 2012
    assert sorted(i for c in real for i in c) == list(range(12031))


def test_mooncake_prompts_keep_the_traces_sharing_at_any_scale() -> None:
    a = mooncake.Request(0, 1100, 5, (3, 4, 5))
    b = mooncake.Request(0, 1300, 5, (3, 4, 6))
    pa, pb = mooncake.prompt_ids(a, 16), mooncake.prompt_ids(b, 16)
    assert pa[:32] == pb[:32] and pa[32:] != pb[32:]
    assert len(pa) == 32 + round((1100 - 1024) * 16 / 512)
    assert mooncake.prompt_ids(a, 16) == pa  # deterministic


def test_mooncake_load_gives_multi_turn_conversations_with_the_traces_think_times() -> None:
    convs = traces.load("mooncake", 5, tokens_per_block=32, time_scale=0.5, max_tokens=4)
    assert len(convs) == 5
    reqs, chains = mooncake.read(), mooncake.chains(mooncake.read())
    first = next(c for c in chains if len(c) > 1)
    conv = convs[0]
    assert conv.id == f"mooncake-{first[0]}" and len(conv.steps) >= 2
    gap = (reqs[first[1]].timestamp_ms - reqs[first[0]].timestamp_ms) / 1000 * 0.5
    assert conv.steps[0].pause_s == 0 and conv.steps[1].pause_s == pytest.approx(gap)
    assert all(not s.chat and 1 <= s.max_tokens <= 4 for c in convs for s in c.steps)
    assert conv.steps[1].body["prompt"][:32] == conv.steps[0].body["prompt"][:32]


def test_bfcl_reads_the_installed_multi_turn_set() -> None:
    convs = traces.load("bfcl", 3, max_turns=2, tool_s=1.5)
    assert len(convs) == 3
    for conv in convs:
        assert conv.id.startswith("multi_turn_base_") and len(conv.steps) >= 2
        system = conv.steps[0].body["messages"][0]
        assert system["role"] == "system" and "<tools>" in system["content"]
        assert [s.pause_s for s in conv.steps] == [0.0] + [1.5] * (len(conv.steps) - 1)
        last = conv.steps[-1].body["messages"]
        assert last[: len(conv.steps[0].body["messages"])] == conv.steps[0].body["messages"]
    assert (bfcl_traces.ensure_wheel() / "bfcl_eval").is_dir()


def test_bfcl_tool_times_are_seeded_per_step() -> None:
    a = bfcl.tool_pause("exp", 2.0, 0, "c1", 1)
    assert a == bfcl.tool_pause("exp", 2.0, 0, "c1", 1) and a > 0
    assert a != bfcl.tool_pause("exp", 2.0, 0, "c1", 2)
    assert bfcl.tool_pause("exp", 2.0, 0, "c1", 0) == 0.0
    with pytest.raises(ValueError):
        bfcl.tool_pause("normal", 2.0, 0, "c1", 1)


def test_an_unknown_set_is_named() -> None:
    with pytest.raises(ValueError, match="mooncake"):
        traces.load("sharegpt", 1)
