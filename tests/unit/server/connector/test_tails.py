"""Token-exact reuse (issue 14 item 1): tail keying, matching, saving and pinning, driven by
small fakes through the planner, the block index and the session registry (pure logic; the
real engine is in tests/integration/test_tail_reuse.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.connector.core.block_index import MAX_TAILS_PER_PARENT
from server.connector.core.planner import BRANCH_XARG, PREFETCH_XARG, Planner
from server.connector.core.tails import finished_tail, identity_of, parent_key, tail_key
from tests.unit.server.connector.fakes import BS, FakeRequest, make_planner


def finish(
    planner: Planner,
    rid: str,
    prompt: list[int],
    output: list[int],
    *,
    session=None,
    branch=None,
    salt=None,
    extra=None,
):
    """Run a request to its end: prompt computed, every output token but the last fed back.
    Returns (request, delayed, device block ids)."""
    tokens = prompt + output
    xargs = dict(extra or {})
    if branch:
        xargs[BRANCH_XARG] = branch
    req = FakeRequest(
        rid,
        tokens,
        len(prompt),
        num_computed_tokens=len(tokens) - 1,
        session_id=session,
        cache_salt=salt,
        sampling_params=SimpleNamespace(extra_args=xargs or None),
    )
    planner.on_new_request(req)
    blocks = list(range(100, 100 + -(-len(tokens) // BS)))
    _, delayed = planner.finish(req, blocks)
    return req, delayed, blocks


def new_prompt(planner: Planner, rid: str, tokens: list[int], device_hit: int = 0, salt=None):
    req = FakeRequest(rid, tokens, len(tokens), cache_salt=salt)
    planner.on_new_request(req)
    matched = planner.num_new_matched_tokens(req, device_hit)
    return req, matched


HISTORY = list(range(1, 11))  # 10 prompt tokens: blocks [1-4] [5-8], then 9, 10
REPLY = [50, 51]  # KV for 50 only: 51 is the last sampled token
#: The finished request's tail: tokens 8..10 of the sequence, in its block 2.
TAIL = (9, 10, 50)


# --- keys ---------------------------------------------------------------------------------------
def test_finished_tail_covers_partial_block_and_reply_without_last_sampled_token():
    req = FakeRequest("r", HISTORY + REPLY, 10, num_computed_tokens=11)
    tail = finished_tail(req, BS)
    assert tail is not None
    assert (tail.block, tail.start, tail.tokens) == (2, 8, TAIL)
    assert tail.parent == parent_key(req.block_hashes, 2, identity_of(req))
    assert tail.key == tail_key(tail.parent, tail.tokens)


def test_no_tail_on_a_block_boundary_or_for_multimodal_requests():
    aligned = FakeRequest("r", list(range(9)), 9, num_computed_tokens=8)  # KV for 8 = 2 blocks
    assert finished_tail(aligned, BS) is None
    media = FakeRequest("m", HISTORY + REPLY, 10, num_computed_tokens=11, mm_features=[object()])
    assert identity_of(media) is None and finished_tail(media, BS) is None


def test_tokens_still_in_flight_are_not_part_of_the_tail():
    req = FakeRequest("r", HISTORY + REPLY, 10, num_computed_tokens=11)
    req.num_in_flight_tokens = 1  # async scheduling: token 50's step has not come back
    assert finished_tail(req, BS).tokens == (9, 10)


def test_parent_key_separates_salts_and_prefixes():
    a = FakeRequest("a", HISTORY, 10, cache_salt="t1")
    b = FakeRequest("b", HISTORY, 10, cache_salt="t2")
    assert parent_key(a.block_hashes, 2, identity_of(a)) != parent_key(
        b.block_hashes, 2, identity_of(b)
    )
    # a tail at token 0 has no parent block: the identity alone scopes it
    assert parent_key([], 0, identity_of(a)) != parent_key([], 0, identity_of(b))


# --- save -------------------------------------------------------------------------------------
def test_finished_request_delays_free_until_its_tail_copy_is_planned():
    planner, index, _ = make_planner()
    _, delayed, blocks = finish(planner, "r1", HISTORY, REPLY)
    assert delayed
    saves, done = planner.plan_tail_saves(set())
    assert done == ["r1"]
    assert len(saves) == 1 and saves[0][0] == (blocks[2],)  # the partial block, device side
    assert index.counters.saved_tails == 1 and index.counters.saved_blocks == 0
    assert planner.plan_tail_saves(set()) == ([], [])  # once


def test_a_tail_already_stored_is_not_copied_again_and_frees_at_once():
    planner, _, _ = make_planner()
    finish(planner, "r1", HISTORY, REPLY)
    planner.plan_tail_saves(set())
    _, delayed, _ = finish(planner, "r2", HISTORY, REPLY)
    assert not delayed and planner.pending_tail_saves == []


def test_no_slot_for_the_tail_still_reports_the_request_done():
    """The blocks must be freed whatever happens to the copy."""
    planner, index, registry = make_planner(num_slots=1)
    index.allocate(b"pinned", [0] * BS)
    index.pin(b"pinned")
    finish(planner, "r1", HISTORY, REPLY)
    saves, done = planner.plan_tail_saves(set())
    assert saves == [] and done == ["r1"]


def test_no_store_no_tail_no_delay():
    planner, _, _ = make_planner(num_slots=0)
    _, delayed, _ = finish(planner, "r1", HISTORY, REPLY)
    assert not delayed


def test_tail_slots_of_one_step_never_collide_with_its_loads_or_block_saves():
    planner, index, _ = make_planner(num_slots=3)
    for i in range(3):
        index.allocate(bytes([i]), [i] * BS)
    finish(planner, "r1", HISTORY, REPLY)
    saves, _ = planner.plan_tail_saves({0, 1})
    assert [slot for _, slot in saves] == [2]
    finish(planner, "r2", HISTORY, [60, 61])
    assert planner.plan_tail_saves({0, 1, 2}) == ([], ["r2"])  # every slot protected


# --- load -------------------------------------------------------------------------------------
def _stored(planner):
    finish(planner, "r1", HISTORY, REPLY)
    saves, _ = planner.plan_tail_saves(set())
    return saves[0][1]


def test_next_prompt_loads_the_tail_after_the_device_hit():
    planner, _, _ = make_planner()
    slot = _stored(planner)
    req, matched = new_prompt(planner, "r2", HISTORY + REPLY + [7, 7, 7], device_hit=8)
    assert matched == 3  # 9, 10, 50; the last sampled token (51) is computed now
    loads: list[tuple[int, tuple[int, ...]]] = []
    planner.after_alloc(req, [200, 201, 202, 203], matched)
    loads.extend(planner.pending_loads)
    assert loads == [(slot, (202,))]
    assert planner.plans["r2"].split["host_hit_tokens"] == 3
    assert planner.plans["r2"].split["recomputed_tokens"] == 15 - 8 - 3


def test_full_blocks_then_tail_from_the_host_store_alone():
    planner, index, _ = make_planner()
    first = FakeRequest("r0", HISTORY, 10)
    for k in range(2):
        index.allocate(first.block_hashes[k], HISTORY[k * BS : (k + 1) * BS])
    slot = _stored(planner)
    req, matched = new_prompt(planner, "r2", HISTORY + REPLY + [7, 7])
    assert matched == 11
    loads: list[tuple[int, tuple[int, ...]]] = []
    planner.after_alloc(req, [200, 201, 202, 203], matched)
    loads.extend(planner.pending_loads)
    assert loads[-1] == (slot, (202,)) and len(loads) == 3


def test_divergence_inside_the_tail_loads_only_the_matching_prefix():
    """An edited reply: positions up to the first different token are exact (KV is causal)."""
    planner, _, _ = make_planner()
    _stored(planner)
    _, matched = new_prompt(planner, "r2", HISTORY[:8] + [9, 99, 98, 97], device_hit=8)
    assert matched == 1  # token 9 only
    _, matched = new_prompt(planner, "r3", HISTORY[:8] + [77, 78, 79], device_hit=8)
    assert matched == 0


def test_the_tail_never_covers_the_last_prompt_token():
    """A regeneration: the same prompt as the finished request, a prefix of its tail."""
    planner, _, _ = make_planner()
    _stored(planner)
    _, matched = new_prompt(planner, "r2", HISTORY, device_hit=8)
    assert matched == 1  # token 9; token 10 is the last prompt token


def test_no_tail_under_another_salt_or_another_history():
    planner, _, _ = make_planner()
    _stored(planner)
    _, matched = new_prompt(planner, "r2", HISTORY + REPLY + [7], device_hit=8, salt="other")
    assert matched == 0
    edited = [1, 2, 3, 4, 5, 6, 7, 0, 9, 10, 50, 51, 7]  # block 1 differs: another parent
    _, matched = new_prompt(planner, "r3", edited, device_hit=8)
    assert matched == 0


def test_longest_of_several_tails_under_one_parent_wins():
    planner, _, _ = make_planner()
    history = HISTORY[:9]
    finish(planner, "a", history, [50, 60])  # tail 9, 50
    finish(planner, "b", history, [50, 51, 70])  # tail 9, 50, 51
    planner.plan_tail_saves(set())
    _, matched = new_prompt(planner, "r", history + [50, 51, 1, 1], device_hit=8)
    assert matched == 3


def test_tails_per_parent_are_bounded():
    planner, index, _ = make_planner(num_slots=MAX_TAILS_PER_PARENT + 8)
    for i in range(MAX_TAILS_PER_PARENT + 3):
        finish(planner, f"r{i}", HISTORY, [1000 + i, 0])
    saves, done = planner.plan_tail_saves(set())
    assert len(saves) == MAX_TAILS_PER_PARENT and len(done) == MAX_TAILS_PER_PARENT + 3


def test_an_evicted_tail_is_no_longer_offered():
    planner, index, _ = make_planner(num_slots=1)
    _stored(planner)
    index.allocate(b"other", [0] * BS)  # evicts the tail (LRU, unpinned)
    _, matched = new_prompt(planner, "r2", HISTORY + REPLY + [7], device_hit=8)
    assert matched == 0


def test_unoffered_external_tokens_load_nothing():
    planner, _, _ = make_planner()
    req, matched = new_prompt(planner, "r2", HISTORY + [1, 2], device_hit=8)
    assert matched == 0
    loads: list[tuple[int, tuple[int, ...]]] = []
    planner.after_alloc(req, [200, 201, 202], 3)
    loads.extend(planner.pending_loads)
    assert loads == []


# --- sessions: pins and forks -----------------------------------------------------------------
def test_branch_pins_its_tail_and_moves_the_pin_to_the_next_one():
    planner, index, registry = make_planner()
    first, _, _ = finish(planner, "r1", HISTORY, REPLY, session="s")
    branch = registry.get_branch("s", "main")
    old_tail = branch.tail_key
    assert old_tail is not None and index.pin_count(old_tail) == 1
    planner.plan_tail_saves(set())
    assert index.slot_of(old_tail) in index._pinned_slots
    finish(planner, "r2", HISTORY + REPLY + [7, 7, 7], [8], session="s")  # tail 7, 7, 7
    assert branch.tail_key != old_tail
    assert index.pin_count(old_tail) == 0 and index.pin_count(branch.tail_key) == 1


def test_prefetch_requests_do_not_move_the_branch_tail():
    planner, _, registry = make_planner()
    finish(planner, "r1", HISTORY, REPLY, session="s")
    tail = registry.get_branch("s", "main").tail_key
    finish(planner, "pf", HISTORY + REPLY, [0], session="s", extra={PREFETCH_XARG: True})
    assert registry.get_branch("s", "main").tail_key == tail


@pytest.mark.parametrize(
    "offset,keeps,pinned", [(12, True, 3), (9, True, 3), (8, False, 2), (5, False, 1)]
)
def test_fork_keeps_the_parent_tail_only_past_its_start(offset, keeps, pinned):
    planner, index, registry = make_planner()
    finish(planner, "r1", HISTORY, REPLY, session="s")
    parent = registry.get_branch("s", "main")
    fork = registry.fork("s", "main", "alt", token_offset=offset)
    assert (fork.tail_key == parent.tail_key) is keeps
    assert (index.pin_count(parent.tail_key) == 2) is keeps
    assert registry.branch_info(fork)["pinned_blocks"] == pinned


def test_fork_tail_loads_only_what_the_fork_prompt_repeats():
    """A fork inside the tail: its next prompt shares the tail up to the fork point only."""
    planner, _, registry = make_planner()
    finish(planner, "r1", HISTORY, REPLY, session="s")
    planner.plan_tail_saves(set())
    registry.fork("s", "main", "alt", token_offset=10)  # up to token 10, inside the tail
    _, matched = new_prompt(planner, "r2", HISTORY + [33, 34], device_hit=8)
    assert matched == 2  # 9, 10


def test_deleting_the_branch_releases_its_tail_pin():
    planner, index, registry = make_planner()
    finish(planner, "r1", HISTORY, REPLY, session="s")
    tail = registry.get_branch("s", "main").tail_key
    registry.delete_session("s")
    assert index.pin_count(tail) == 0


def test_a_prompt_ending_inside_a_stored_full_block_loads_the_prefix_it_repeats():
    """A regeneration after a reply that crossed a block boundary: the prompt's partial block
    lies inside a block that was saved full; its prefix is exact (KV is causal)."""
    planner, index, _ = make_planner()
    seq = HISTORY + [50, 51, 52, 53]  # blocks [1-4] [5-8] [9 10 50 51] [52 53]
    req = FakeRequest("r1", seq, 10, num_computed_tokens=13)
    planner.on_new_request(req)
    saves = planner.plan_saves({"r1": 0}, lambda rid: [[100, 101, 102, 103]], set())
    assert len(saves) == 3
    regen, matched = new_prompt(planner, "r2", HISTORY)  # the same prompt again
    assert matched == 9  # two full blocks and token 9; token 10 is computed
    planner.after_alloc(regen, [200, 201, 202], matched)
    assert planner.pending_loads[-1] == (index.slot_of(req.block_hashes[2]), (202,))
    # an edited reply: only the repeated prefix of the full block loads
    _, matched = new_prompt(planner, "r3", HISTORY + [50, 99, 98], device_hit=8)
    assert matched == 3
    # never a whole block through this path
    _, matched = new_prompt(planner, "r4", HISTORY + [50, 51, 77], device_hit=8)
    assert matched == 4
