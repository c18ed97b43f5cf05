"""Planner: host-store hits, loads, saves and the prompt-source split, driven by small fakes."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from server.connector.core.block_index import HostBlockIndex
from server.connector.core.planner import (
    BRANCH_XARG,
    OWNER_XARG,
    PREFETCH_XARG,
    TAG_XARG,
)
from server.connector.core.sessions import DEFAULT_BRANCH
from tests.unit.server.connector.fakes import BS, make_planner


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    num_prompt_tokens: int
    block_hashes: list[bytes]
    num_computed_tokens: int = 0
    session_id: str | None = None
    cache_salt: str | None = None
    sampling_params: SimpleNamespace = field(
        default_factory=lambda: SimpleNamespace(extra_args=None)
    )


def make_request(
    rid: str,
    n_tokens: int,
    *,
    seed: str = "p",
    session_id=None,
    extra: dict | None = None,
    cache_salt=None,
) -> FakeRequest:
    tokens = [hash((seed, i)) % 30_000 for i in range(n_tokens)]
    hashes = [repr(tokens[: (k + 1) * BS]).encode() for k in range(n_tokens // BS)]
    return FakeRequest(
        rid,
        tokens,
        n_tokens,
        hashes,
        session_id=session_id,
        cache_salt=cache_salt,
        sampling_params=SimpleNamespace(extra_args=extra),
    )


def store(index: HostBlockIndex, req: FakeRequest, blocks) -> dict[int, int]:
    slots = {}
    for k in blocks:
        slots[k] = index.allocate(req.block_hashes[k], req.all_token_ids[k * BS : (k + 1) * BS])
        assert slots[k] is not None
    return slots


def announce(planner, index: HostBlockIndex, req: FakeRequest, blocks) -> dict[int, int]:
    """``store`` these blocks of ``req``, then hand ``req`` to the planner (``on_new_request``);
    the slots of the stored blocks."""
    slots = store(index, req, blocks)
    planner.on_new_request(req)
    return slots


def check_split(split: dict, prompt: int, device: int, host: int) -> None:
    assert split["prompt_tokens"] == prompt
    assert split["device_hit_tokens"] == device
    assert split["host_hit_tokens"] == host
    assert split["recomputed_tokens"] == prompt - device - host
    assert (
        split["device_hit_tokens"] + split["host_hit_tokens"] + split["recomputed_tokens"]
    ) == prompt


# --- num_new_matched_tokens -------------------------------------------------------------------
def test_no_host_blocks_no_match():
    planner, _, _ = make_planner()
    req = make_request("r", 12)
    planner.on_new_request(req)
    assert planner.num_new_matched_tokens(req, 0) == 0


def test_never_covers_last_prompt_token_exact_multiple():
    planner, index, _ = make_planner()
    req = make_request("r", 12)  # exactly 3 blocks
    announce(planner, index, req, range(3))
    assert planner.num_new_matched_tokens(req, 0) == 8  # last block holds the last token


def test_full_blocks_before_last_token_match():
    planner, index, _ = make_planner()
    req = make_request("r", 13)  # 3 full blocks + 1 token
    announce(planner, index, req, range(3))
    assert planner.num_new_matched_tokens(req, 0) == 12


def test_tiny_prompts_never_match():
    planner, index, _ = make_planner()
    for n in (1, 4, 5):
        req = make_request(f"r{n}", n, seed=f"s{n}")
        announce(planner, index, req, range(n // BS))
        expected = 4 if n == 5 else 0
        assert planner.num_new_matched_tokens(req, 0) == expected


def test_zero_slot_store_never_matches():
    planner, _, _ = make_planner(num_slots=0)
    req = make_request("r", 20)
    planner.on_new_request(req)
    assert planner.num_new_matched_tokens(req, 0) == 0


def test_loads_start_after_device_hit_and_are_consecutive():
    planner, index, _ = make_planner()
    req = make_request("r", 25)  # 6 full blocks + 1
    announce(planner, index, req, [1, 2, 4, 5])  # block 0 only on device, block 3 missing
    assert planner.num_new_matched_tokens(req, 4) == 8  # blocks 1, 2; stops at 3
    # nothing stored right after the device hit: no load even though later blocks exist
    req2 = make_request("r2", 25, seed="q")
    announce(planner, index, req2, [2, 3])
    assert planner.num_new_matched_tokens(req2, 4) == 0


def test_device_hit_covering_everything_means_no_host_load():
    planner, index, _ = make_planner()
    req = make_request("r", 13)
    announce(planner, index, req, range(3))
    assert planner.num_new_matched_tokens(req, 12) == 0


def test_token_mismatch_stops_match():
    planner, index, _ = make_planner()
    req = make_request("r", 17)
    store(index, req, range(4))
    req.all_token_ids[BS * 2] += 1  # block 2's tokens differ under the same hash
    planner.on_new_request(req)
    assert planner.num_new_matched_tokens(req, 0) == 8
    assert index.counters.token_mismatches == 1


# --- after_alloc ------------------------------------------------------------------------------
def test_after_alloc_emits_loads_and_records_split():
    planner, index, _ = make_planner()
    req = make_request("r", 22)  # 5 full blocks + 2
    slots = announce(planner, index, req, [1, 2, 3])
    matched = planner.num_new_matched_tokens(req, 4)
    assert matched == 12
    device_blocks = [50, 51, 52, 53, 54, 55]
    loads: list[tuple[int, tuple[int, ...]]] = []
    planner.after_alloc(req, device_blocks, matched)
    loads.extend(planner.pending_loads)
    assert loads == [(slots[1], (51,)), (slots[2], (52,)), (slots[3], (53,))]
    assert index.counters.loaded_blocks == 3
    assert planner.plans["r"].recorded
    assert planner.plans["r"].load_slots is None
    assert planner.requests == 1
    assert planner.hits_tokens == {"device": 4, "host": 12, "remote": 0, "recomputed": 6}
    check_split(planner.request_finished(req), 22, 4, 12)


def test_after_alloc_with_fewer_external_tokens_loads_fewer():
    planner, index, _ = make_planner()
    req = make_request("r", 17)
    slots = announce(planner, index, req, range(4))
    assert planner.num_new_matched_tokens(req, 0) == 16
    loads: list[tuple[int, tuple[int, ...]]] = []
    planner.after_alloc(req, [9, 8, 7, 6, 5], 8)
    loads.extend(planner.pending_loads)
    assert loads == [(slots[0], (9,)), (slots[1], (8,))]
    assert planner.hits_tokens == {"device": 0, "host": 8, "remote": 0, "recomputed": 9}


def test_after_alloc_without_external_tokens():
    planner, index, _ = make_planner()
    req = make_request("r", 10)
    planner.on_new_request(req)
    assert planner.num_new_matched_tokens(req, 0) == 0
    loads: list[tuple[int, tuple[int, ...]]] = []
    planner.after_alloc(req, [1, 2, 3], 0)
    loads.extend(planner.pending_loads)
    assert loads == []
    assert index.counters.loaded_blocks == 0
    assert planner.hits_tokens == {"device": 0, "host": 0, "remote": 0, "recomputed": 10}


def test_after_alloc_touches_loaded_blocks():
    planner, index, _ = make_planner(num_slots=3)
    other = make_request("o", 8, seed="other")
    req = make_request("r", 9)
    store(index, req, [0])
    store(index, other, [0, 1])  # LRU: r0, o0, o1
    planner.on_new_request(req)
    assert planner.num_new_matched_tokens(req, 0) == 4
    planner.after_alloc(req, [7, 8, 9], 4)
    index.allocate(b"new", [0] * BS)
    assert req.block_hashes[0] in index  # touched by the load, so o0 went instead
    assert other.block_hashes[0] not in index


def test_split_recorded_once():
    planner, _, _ = make_planner()
    req = make_request("r", 10)
    planner.on_new_request(req)
    planner.num_new_matched_tokens(req, 0)
    planner.after_alloc(req, [1, 2, 3], 0)
    planner.after_alloc(req, [1, 2, 3], 0)  # e.g. a second allocation after preemption
    assert planner.requests == 1
    planner.request_finished(req)
    assert planner.requests == 1


# --- plan_saves -------------------------------------------------------------------------------
def _resolver(mapping):
    return lambda rid: mapping.get(rid, [])


def test_plan_saves_each_full_block_once():
    planner, index, _ = make_planner()
    req = make_request("r", 14)
    planner.on_new_request(req)
    blocks = {"r": [[100, 101, 102, 103]]}
    saves = planner.plan_saves({"r": 6}, _resolver(blocks), set())
    assert [b for b, _ in saves] == [(100,)]
    req.num_computed_tokens = 6
    saves2 = planner.plan_saves({"r": 8}, _resolver(blocks), set())  # 14 done
    assert [b for b, _ in saves2] == [(101,), (102,)]
    req.num_computed_tokens = 14
    assert planner.plan_saves({"r": 1}, _resolver(blocks), set()) == []
    all_saves = saves + saves2
    assert len({s for _, s in all_saves}) == 3
    for k, (_, slot) in enumerate(all_saves):
        assert index.slot_of(req.block_hashes[k]) == slot
    assert index.counters.saved_blocks == 3


def test_plan_saves_skips_stored_blocks():
    planner, index, _ = make_planner()
    req = make_request("r", 16)
    announce(planner, index, req, [0, 2])
    saves = planner.plan_saves({"r": 16}, _resolver({"r": [[10, 11, 12, 13]]}), set())
    assert [b for b, _ in saves] == [(11,), (13,)]
    assert index.counters.saved_blocks == 4


def test_plan_saves_ignores_unknown_requests_and_empty_store():
    planner, _, _ = make_planner()
    assert planner.plan_saves({"ghost": 8}, _resolver({}), set()) == []
    planner0, _, _ = make_planner(num_slots=0)
    req = make_request("r", 8)
    planner0.on_new_request(req)
    assert planner0.plan_saves({"r": 8}, _resolver({"r": [[1, 2]]}), set()) == []


def test_plan_saves_without_block_ids_saves_nothing():
    planner, index, _ = make_planner()
    req = make_request("r", 8)
    planner.on_new_request(req)
    assert planner.plan_saves({"r": 8}, _resolver({}), set()) == []
    assert index.used_slots == 0


def test_plan_saves_respects_protected_slots():
    planner, index, _ = make_planner(num_slots=2)
    old = make_request("old", 8, seed="old")
    slots = store(index, old, [0, 1])
    req = make_request("r", 4)
    planner.on_new_request(req)
    saves = planner.plan_saves({"r": 4}, _resolver({"r": [[5]]}), {slots[0]})
    assert saves == [((5,), slots[1])]
    assert old.block_hashes[0] in index


def test_plan_saves_multiple_requests():
    planner, _, _ = make_planner()
    a = make_request("a", 8, seed="a")
    b = make_request("b", 4, seed="b")
    planner.on_new_request(a)
    planner.on_new_request(b)
    saves = planner.plan_saves({"a": 8, "b": 4}, _resolver({"a": [[1, 2]], "b": [[3]]}), set())
    assert sorted(blk for blk, _ in saves) == [(1,), (2,), (3,)]
    assert len({slot for _, slot in saves}) == 3


# --- request_finished -------------------------------------------------------------------------
def test_request_finished_updates_branch_and_returns_split():
    planner, index, registry = make_planner()
    req = make_request(
        "r",
        10,
        session_id="s1",
        cache_salt="salt",
        extra={BRANCH_XARG: "b1", TAG_XARG: "tag-1", OWNER_XARG: "t_o"},
    )
    planner.on_new_request(req)
    planner.num_new_matched_tokens(req, 0)
    planner.after_alloc(req, [1, 2, 3], 0)
    assert planner.split_for("tag-1")["prompt_tokens"] == 10
    req.num_computed_tokens = len(req.all_token_ids)  # a finished request computed its prompt
    split = planner.request_finished(req)
    check_split(split, 10, 0, 0)
    assert split["session_id"] == "s1" and split["branch_id"] == "b1"
    assert "r" not in planner.plans
    branch = registry.get_branch("s1", "b1", owner="t_o")
    assert branch.token_ids == req.all_token_ids
    assert branch.block_hashes == req.block_hashes
    assert branch.cache_salt == "salt"
    assert branch.requests == 1
    assert branch.pinned
    assert index.pinned_hashes == 3  # two full blocks and the tail (token 8; 9 has no KV)
    assert branch.tail_key is not None and branch.tail_start == 8


def test_request_finished_without_alloc_updates_branch_but_counts_nothing():
    planner, _, registry = make_planner()
    req = make_request("r", 9, session_id="s1")
    planner.on_new_request(req)
    assert planner.request_finished(req) is None  # aborted before allocation
    assert registry.get_branch("s1", DEFAULT_BRANCH).requests == 1
    assert planner.requests == 0


def test_request_without_session_keeps_no_state():
    planner, _, registry = make_planner()
    req = make_request("r", 9, extra={TAG_XARG: "t"})
    planner.on_new_request(req)
    planner.after_alloc(req, [1, 2, 3], 0)
    split = planner.request_finished(req)
    assert split["session_id"] is None and split["branch_id"] is None
    assert registry.sessions == {}


def test_full_split_device_host_recomputed_sums_to_prompt():
    planner, index, _ = make_planner()
    req = make_request("r", 30, session_id="s", extra={TAG_XARG: "t"})
    announce(planner, index, req, [2, 3, 4])
    matched = planner.num_new_matched_tokens(req, 8)
    assert matched == 12
    planner.after_alloc(req, list(range(8)), matched)
    split = planner.request_finished(req)
    check_split(split, 30, 8, 12)
    assert planner.split_for("t") == split


def test_request_finished_for_other_tenants_session_is_served():
    planner, _, registry = make_planner()
    registry.create_session("s", owner="t_a")
    req = make_request("r", 9, session_id="s", extra={OWNER_XARG: "t_b"})
    planner.on_new_request(req)
    planner.after_alloc(req, [], 0)
    split = planner.request_finished(req)
    check_split(split, 9, 0, 0)
    assert registry.get_branch("s", DEFAULT_BRANCH, "t_a").requests == 0


def test_prefetch_not_counted_and_no_branch_update():
    planner, index, registry = make_planner()
    req = make_request("p", 13, session_id="s", extra={PREFETCH_XARG: True, TAG_XARG: "pt"})
    announce(planner, index, req, [0, 1])
    matched = planner.num_new_matched_tokens(req, 0)
    planner.after_alloc(req, [1, 2, 3, 4], matched)
    split = planner.request_finished(req)
    check_split(split, 13, 0, 8)
    assert planner.prefetches == 1
    assert planner.requests == 0
    assert planner.hits_tokens == {"device": 0, "host": 0, "remote": 0, "recomputed": 0}
    assert registry.sessions == {}


def test_prefetch_does_not_touch_existing_branch():
    planner, _, registry = make_planner()
    registry.create_session("s")
    req = make_request("p", 13, session_id="s", extra={PREFETCH_XARG: 1})
    planner.on_new_request(req)
    planner.request_finished(req)
    branch = registry.get_branch("s", DEFAULT_BRANCH)
    assert branch.requests == 0 and branch.token_ids == []


def test_request_finished_expires_leases():
    clock = [0.0]
    planner, index, registry = make_planner(8, 8, ttl_s=5.0, clock=lambda: clock[0])
    a = make_request("a", 8, session_id="A")
    planner.on_new_request(a)
    planner.request_finished(a)
    assert registry.get_branch("A", DEFAULT_BRANCH).pinned
    clock[0] = 10.0
    b = make_request("b", 3)
    planner.on_new_request(b)
    planner.request_finished(b)
    assert not registry.get_branch("A", DEFAULT_BRANCH).pinned
    assert index.pinned_hashes == 0


def test_non_dict_extra_args_are_ignored():
    planner, _, registry = make_planner()
    req = make_request("r", 9, session_id="s")
    req.sampling_params = SimpleNamespace(extra_args=["not", "a", "dict"])
    planner.on_new_request(req)
    planner.after_alloc(req, [], 0)
    split = planner.request_finished(req)
    assert split["branch_id"] == DEFAULT_BRANCH
    req2 = make_request("r2", 9)
    req2.sampling_params = None
    planner.on_new_request(req2)
    planner.after_alloc(req2, [], 0)
    assert planner.request_finished(req2)["prompt_tokens"] == 9
    assert registry.get_branch("s", DEFAULT_BRANCH).requests == 1


def test_unknown_request_finished_returns_none():
    planner, _, _ = make_planner()
    req = make_request("never-seen", 9)
    assert planner.request_finished(req) is None
    assert planner.requests == 0


@pytest.mark.parametrize("n_tokens", [1, 4, 7, 8, 33])
def test_split_sums_for_various_lengths(n_tokens):
    planner, index, _ = make_planner()
    req = make_request("r", n_tokens)
    announce(planner, index, req, range(n_tokens // BS))
    matched = planner.num_new_matched_tokens(req, 0)
    assert matched < n_tokens
    assert matched % BS == 0
    planner.after_alloc(req, list(range(10)), matched)
    split = planner.request_finished(req)
    check_split(split, n_tokens, 0, matched)
    assert split["recomputed_tokens"] >= 1


def test_untagged_request_still_returns_split_after_alloc():
    """The split goes into kv_transfer_params even without the middleware's tag."""
    planner, index, _ = make_planner()
    req = make_request("r", 13)
    announce(planner, index, req, [0, 1])
    matched = planner.num_new_matched_tokens(req, 0)
    planner.after_alloc(req, [1, 2, 3, 4], matched)
    split = planner.request_finished(req)
    check_split(split, 13, 0, 8)
    assert planner.splits == {}  # untagged splits are not kept in the history


def test_device_hit_recorded_when_nothing_is_left_to_load():
    """A device hit that covers every loadable block must still count as device tokens."""
    planner, index, _ = make_planner()
    req = make_request("r", 14, extra={TAG_XARG: "t"})
    announce(planner, index, req, range(3))
    assert planner.num_new_matched_tokens(req, 12) == 0
    planner.after_alloc(req, [], 0)
    check_split(planner.request_finished(req), 14, 12, 0)
    assert planner.hits_tokens == {"device": 12, "host": 0, "remote": 0, "recomputed": 2}


def test_device_hit_recorded_without_host_store():
    planner, _, _ = make_planner(num_slots=0)
    req = make_request("r", 20)
    planner.on_new_request(req)
    assert planner.num_new_matched_tokens(req, 8) == 0
    planner.after_alloc(req, [], 0)
    check_split(planner.request_finished(req), 20, 8, 0)


def test_stale_load_plan_is_not_reused():
    """A second scheduling attempt with nothing to load must not replay the first's loads."""
    planner, index, _ = make_planner()
    req = make_request("r", 13)
    announce(planner, index, req, range(3))
    assert planner.num_new_matched_tokens(req, 0) == 12
    # not allocated this step (e.g. no room); next step the device holds the whole prefix
    assert planner.num_new_matched_tokens(req, 12) == 0
    loads: list[tuple[int, tuple[int, ...]]] = []
    planner.after_alloc(req, [], 0)
    loads.extend(planner.pending_loads)
    assert loads == []
    check_split(planner.request_finished(req), 13, 12, 0)


def test_tagged_split_found_after_plan_is_gone():
    planner, _, _ = make_planner()
    req = make_request("r", 9, extra={TAG_XARG: "t9"})
    planner.on_new_request(req)
    planner.after_alloc(req, [], 0)
    first = planner.request_finished(req)
    assert planner.request_finished(req) == first  # plan forgotten: found by its tag
    assert planner.requests == 1


def test_block_completed_by_the_last_sampled_token_is_not_pinned():
    """The last sampled token is never fed back, so the block it completes has a hash but no
    KV: pinning it would hold budget for a block that can never be stored."""
    planner, index, registry = make_planner()
    req = make_request("r", 8, session_id="s1")  # 2 full blocks of 4 tokens
    planner.on_new_request(req)
    req.num_computed_tokens = 7  # 8th token sampled last, its KV never computed
    planner.request_finished(req)
    branch = registry.get_branch("s1", "main")
    assert branch.block_hashes == req.block_hashes[:1]
    assert index.pin_count(req.block_hashes[1]) == 0
    # block 0 and the tail: tokens 4..6, whose KV exists (the tail of tails.py)
    assert index.pinned_hashes == 2 and branch.tail_start == 4


# --- accounting: remote pulls count only once they landed (issue 13 item 10) ------------------
def _start_remote_pull(planner, req, device_hit: int, remote: int) -> None:
    """What the scheduler does for a P/D pull: every child connector is asked, NIXL wins,
    KVBranchPDConnector notes the hit, and the kvbranch child is told 0 external tokens."""
    planner.on_new_request(req)
    planner.num_new_matched_tokens(req, device_hit)
    planner.note_remote_hit(req, remote)
    planner.after_alloc(req, [], 0)


def _pulling(device_hit: int, **request_kw):
    """A planner whose request "r" (22 tokens, ``device_hit`` of them on the device) has a P/D
    pull of 16 tokens in flight: (planner, request)."""
    planner, _, _ = make_planner()
    req = make_request("r", 22, **request_kw)
    _start_remote_pull(planner, req, device_hit, 16)
    return planner, req


def test_remote_hit_counts_after_the_load_landed():
    planner, req = _pulling(4, extra={TAG_XARG: "t"})
    assert planner.requests == 0  # still loading: nothing to report yet
    req.num_computed_tokens = 20  # vLLM after the async load: device 4 + remote 16
    planner.after_alloc(req, [], 0)
    assert planner.requests == 1
    assert planner.hits_tokens == {"device": 4, "host": 0, "remote": 16, "recomputed": 2}
    assert planner.remote_failed_tokens == 0


def test_failed_remote_pull_is_recomputed_and_reported():
    """failed_recving: vLLM (kv_load_failure_policy=recompute) resets the request to 0
    computed tokens and frees its blocks; the next scheduling pass asks the connectors again."""
    planner, req = _pulling(0)
    req.num_computed_tokens = 0
    planner.num_new_matched_tokens(req, 0)  # asked again: the pull failed
    planner.after_alloc(req, [], 0)
    assert planner.requests == 1
    assert planner.hits_tokens == {"device": 0, "host": 0, "remote": 0, "recomputed": 22}
    assert planner.remote_failed_tokens == 16


def test_partly_failed_remote_pull_counts_only_the_valid_prefix():
    """invalid_block_ids: vLLM truncates num_computed_tokens at the first failed block."""
    planner, req = _pulling(4)
    req.num_computed_tokens = 12  # device 4 + the first 2 pulled blocks
    planner.after_alloc(req, [], 0)
    assert planner.hits_tokens == {"device": 4, "host": 0, "remote": 8, "recomputed": 10}
    assert planner.remote_failed_tokens == 8


def test_request_aborted_while_its_pull_runs_is_not_counted():
    planner, req = _pulling(0)
    planner.request_finished(req)
    assert planner.requests == 0
    assert planner.hits_tokens == {"device": 0, "host": 0, "remote": 0, "recomputed": 0}


def test_request_aborted_while_waiting_is_not_counted_as_recompute():
    planner, _, registry = make_planner()
    req = make_request("r", 9, session_id="s1")
    planner.on_new_request(req)
    planner.num_new_matched_tokens(req, 0)  # asked, then never allocated (aborted)
    assert planner.request_finished(req) is None
    assert planner.requests == 0
    assert planner.hits_tokens["recomputed"] == 0
    assert registry.get_branch("s1", DEFAULT_BRANCH).requests == 1  # session state kept


def test_pins_degraded_counts_transitions_not_checks():
    """An automatic pin that can never fit degrades once, not once per request."""
    planner, _, registry = make_planner(budget_blocks=2)
    for i in range(3):
        req = make_request(f"r{i}", 17, session_id="s1")  # 4 full blocks > budget of 2
        planner.on_new_request(req)
        planner.after_alloc(req, [], 0)
        req.num_computed_tokens = 16
        planner.request_finished(req)
    assert registry.get_branch("s1", DEFAULT_BRANCH).degraded
    assert registry.leases.pins_degraded == 1


def test_request_aborted_while_its_pull_runs_keeps_no_tail_and_never_delays():
    """vLLM keeps the blocks of a request aborted in WAITING_FOR_REMOTE_KVS until the read's
    report and then forgets the request: a tail copy (a second report for it) killed D's engine
    core, and would have copied blocks the read had not written yet."""
    planner, req = _pulling(4, session_id="s1")
    req.num_computed_tokens = 20  # vLLM counts the pulled tokens before they land
    split, delay = planner.finish(req, [1, 2, 3, 4, 5, 6])
    assert (split, delay) == (None, False)
    assert planner.pending_tail_saves == []
    branch = planner.registry.get_branch("s1", DEFAULT_BRANCH)
    assert branch.block_hashes == req.block_hashes[:1]  # the device hit only: KV that exists


def test_request_finished_after_its_pull_landed_keeps_its_tail():
    planner, req = _pulling(4)
    req.num_computed_tokens = 20
    planner.after_alloc(req, [], 0)  # the read landed: vLLM scheduled the request
    req.num_computed_tokens = 22
    _, delay = planner.finish(req, [1, 2, 3, 4, 5, 6])
    assert delay and [rid for rid, _, _ in planner.pending_tail_saves] == ["r"]


def test_a_pull_the_forward_waits_for_counts_at_once_and_is_cut_if_it_did_not_land():
    planner, _, _ = make_planner()
    req = make_request("r", 22, extra={TAG_XARG: "t"})
    planner.on_new_request(req)
    planner.num_new_matched_tokens(req, 4)
    planner.note_remote_hit(req, 16, landing_now=True)
    planner.after_alloc(req, [], 0)
    assert planner.requests == 1  # recorded at the allocation: the read lands before the forward
    assert planner.hits_tokens == {"device": 4, "host": 0, "remote": 16, "recomputed": 2}
    planner.settle_failed_pull(req, 8)  # the step's output: only its first 8 tokens landed
    assert planner.hits_tokens == {"device": 4, "host": 0, "remote": 8, "recomputed": 10}
    assert planner.splits["t"]["remote_hit_tokens"] == 8
    assert planner.splits["t"]["recomputed_tokens"] == 10
    assert planner.remote_failed_tokens == 8
