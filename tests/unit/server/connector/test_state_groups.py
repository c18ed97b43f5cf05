"""Hybrid attention/SSM models (Qwen3-Next, Qwen3.5, Nemotron-H): the host store keeps, beside
every group's attention KV, the recurrent state after a block where vLLM's prefix cache keeps
one (``core/kv_groups.py``). Group 0 holds the states here, group 1 attention, as vLLM orders a
tiny Qwen3-Next's groups."""

from __future__ import annotations

from server.connector.core.block_index import HostBlockIndex
from server.connector.core.metadata import SKIPPED
from server.connector.core.planner import Planner
from tests.unit.server.connector.fakes import BS, make_planner
from tests.unit.server.connector.test_planner import make_request
from tests.unit.server.connector.vllm_manager import BS as VLLM_BS
from tests.unit.server.connector.vllm_manager import positions_after_external_hit

STATES = frozenset({0})


def state_planner() -> tuple[Planner, HostBlockIndex]:
    planner, index, _ = make_planner(16, state_groups=STATES, num_groups=2)
    return planner, index


def table(n_positions: int, states: dict[int, int]) -> list[list[int]]:
    """vLLM's block table of a request: attention blocks 100, 101, ...; state blocks only at
    ``states`` positions (align mode nulls the rest: block 0)."""
    return [
        [states.get(p, 0) for p in range(n_positions)],
        [100 + p for p in range(n_positions)],
    ]


def save(planner: Planner, req, n_tokens: int, states_at: dict[bytes, int], tables) -> list:
    """One step computing ``req`` up to ``n_tokens``; ``states_at``: the state block vLLM's
    prefix cache keeps under a block hash."""
    return planner.plan_saves(
        {req.request_id: n_tokens - req.num_computed_tokens},
        lambda rid: tables,
        set(),
        state_lookup=lambda h: {0: states_at[h]} if h in states_at else None,
    )


def test_a_block_is_saved_with_the_state_vllm_keeps_after_it():
    planner, index = state_planner()
    req = make_request("r", 12)  # 3 blocks
    planner.on_new_request(req)
    hashes = req.block_hashes
    saves = save(planner, req, 12, {hashes[1]: 7}, table(3, {1: 7, 2: 9}))
    # every position's attention block; the state only where vLLM keeps one (position 1), not
    # the running state's block (position 2: not under any hash)
    assert [block for block, _ in saves] == [(SKIPPED, 100), (7, 101), (SKIPPED, 102)]
    # slots name the state part (group 0) and the slot (group 1)
    assert [index.has_state(slots[1]) for _, slots in saves] == [False, True, False]
    assert [slots[0] != SKIPPED for _, slots in saves] == [False, True, False]
    assert index.counters.saved_states == 1


def test_a_state_kept_later_joins_its_stored_block():
    """vLLM may keep a block's state after the step that filled the block: the state goes into
    the slot already holding the block, alone."""
    planner, index = state_planner()
    req = make_request("r", 12)
    planner.on_new_request(req)
    first = save(planner, req, 8, {}, table(2, {}))
    assert len(first) == 2 and not any(index.has_state(slots[1]) for _, slots in first)
    other = make_request("r2", 12)  # the same prompt, computed again
    planner.on_new_request(other)
    again = save(planner, other, 12, {other.block_hashes[1]: 5}, table(3, {1: 5}))
    slot1 = first[1][1][1]
    part = index.states.part_of(slot1)
    assert part is not None and ((5, SKIPPED), (part, slot1)) in again
    # also while a load of this step reads the slot: the state has a part of its own
    planner2, index2 = state_planner()
    req3 = make_request("r3", 12)
    planner2.on_new_request(req3)
    (_, _), (_, (_, s1)) = save(planner2, req3, 8, {}, table(2, {}))
    req4 = make_request("r4", 12)
    planner2.on_new_request(req4)
    saves = planner2.plan_saves(
        {"r4": 12},
        lambda rid: table(3, {1: 5}),
        {s1},
        state_lookup=lambda h: {0: 5} if h == req4.block_hashes[1] else None,
    )
    assert saves[0] == ((5, SKIPPED), (index2.states.part_of(s1), s1))


def test_a_hit_ends_at_the_last_block_stored_with_its_state():
    planner, index = state_planner()
    req = make_request("r", 18)  # 4 blocks + 2 tokens
    planner.on_new_request(req)
    save(planner, req, 16, {req.block_hashes[1]: 7}, table(4, {1: 7}))
    assert index.used_slots == 4
    turn2 = make_request("t2", 22)  # the same 18 tokens and more
    planner.on_new_request(turn2)
    assert planner.num_new_matched_tokens(turn2, 0) == 2 * BS  # not 4 blocks, no tail
    # nothing stored with a state: nothing to resume from
    bare, _ = state_planner()
    r = make_request("r", 18)
    bare.on_new_request(r)
    save(bare, r, 16, {}, table(4, {}))
    t = make_request("t", 22)
    bare.on_new_request(t)
    assert bare.num_new_matched_tokens(t, 0) == 0


def test_a_resumed_state_goes_to_the_hit_end_and_the_running_block():
    """vLLM copies the state it continues from into the request's running state block before a
    step's connector loads run: the state is loaded into both."""
    planner, index = state_planner()
    req = make_request("r", 18)
    planner.on_new_request(req)
    saves = save(planner, req, 16, {req.block_hashes[1]: 7}, table(4, {1: 7}))
    slots = [slot for _, slot in saves]
    turn2 = make_request("t2", 22)
    planner.on_new_request(turn2)
    hit = planner.num_new_matched_tokens(turn2, 0)
    # what vLLM allocates for an 8-token hit and 14 tokens to compute: the state group holds
    # the hit's end (position 1) and the running state (position 5), null elsewhere
    planner.after_alloc(turn2, list(zip(*table(6, {1: 21, 5: 25}), strict=True)), hit)
    assert planner.pending_loads == [
        (slots[0], (SKIPPED, 100)),
        (slots[1], (21, 101)),
        (slots[1], (25, SKIPPED)),
    ]
    assert index.counters.loaded_states == 1


def test_no_tails_where_states_are_kept():
    """A state exists only at block boundaries, so a token-exact tail could not be resumed."""
    planner, _ = state_planner()
    req = make_request("r", 10, session_id="s")
    planner.on_new_request(req)
    req.num_computed_tokens = 10
    _, delayed = planner.finish(req, [(1, 4), (2, 5), (3, 6)])
    assert not delayed and planner.pending_tail_saves == []


def test_vllms_align_manager_gives_a_loaded_hit_its_end_and_running_state_blocks():
    """What the loads rely on, on vLLM's real KV cache manager (full attention + a Mamba group
    in ``align`` mode): for a request whose first 8 blocks come from the connector and 3 more
    blocks are computed now, the state group holds a block at the hit's last position and at
    the running position only, the null block elsewhere."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
    )

    from server.connector import vllm_compat

    mamba = MambaSpec(
        block_size=VLLM_BS,
        shapes=((4,), (8,)),
        dtypes=(torch.float32, torch.float32),
        mamba_cache_mode="align",
    )
    full = FullAttentionSpec(block_size=VLLM_BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    groups = [("m", mamba), ("full", full)]
    config = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec([name], spec) for name, spec in groups],
    )
    assert vllm_compat.states_at_boundaries(config)
    positions = positions_after_external_hit(groups)
    assert all(attention != SKIPPED for _, attention in positions)
    assert [p for p, (state, _) in enumerate(positions) if state != SKIPPED] == [7, 10]


def test_a_request_keeps_its_states_only_at_its_resume_points():
    """When a request ends, the states it kept stay only where a later turn resumes: its last
    one (the next turn) and the last one inside its prompt (a regenerated last step); the
    others' parts are released (their blocks stay, without a state to end a hit at)."""
    planner, index = state_planner()
    req = make_request("r", 36)  # 9 blocks: a 20-token prompt (5 blocks) and its answer
    req.num_prompt_tokens = 20
    planner.on_new_request(req)
    hashes = req.block_hashes
    kept = {1: 11, 3: 13, 5: 15, 7: 17}
    save(planner, req, 36, {hashes[k]: b for k, b in kept.items()}, table(9, kept))
    assert [index.has_state(index.slot_of(hashes[k])) for k in kept] == [True] * 4
    req.num_computed_tokens = 35
    planner.finish(req, None)
    # the prompt's hits end at most at block 4 (its last token is computed): state 3 stays
    assert [index.has_state(index.slot_of(hashes[k])) for k in kept] == [False, True, False, True]
    assert index.states.released == 2 and index.slot_of(hashes[1]) is not None


def test_a_hit_ends_earlier_when_its_state_part_was_evicted():
    planner, index, _ = make_planner(16, state_groups=STATES, num_groups=2)
    small = HostBlockIndex(16, state_slots=1)  # one state part for the whole store
    planner.index = small
    req = make_request("r", 12)
    planner.on_new_request(req)
    hashes = req.block_hashes
    save(planner, req, 12, {hashes[0]: 5, hashes[1]: 7}, table(3, {0: 5, 1: 7}))
    # the only part went to position 0's state; position 1's found none free (position 0's
    # is written this step): a hit ends at position 0, and at nothing once that part goes
    assert [small.has_state(small.slot_of(h)) for h in hashes[:2]] == [True, False]
    nxt = make_request("n", 16)
    planner.on_new_request(nxt)
    assert planner.num_new_matched_tokens(nxt, 0) == BS
    small.states.release(small.slot_of(hashes[0]))
    assert planner.num_new_matched_tokens(nxt, 0) == 0
