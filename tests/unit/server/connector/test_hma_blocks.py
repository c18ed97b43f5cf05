"""Several KV cache groups (vLLM's hybrid KV cache manager on): a host slot is one block
position of every group; a group's null block (a sliding window left it behind) is skipped on
load and makes the position unsavable."""

from __future__ import annotations

import torch

from server.connector.core.metadata import SKIPPED, device_block, device_blocks, whole
from server.connector.engine.host_pool import HostKVPool, group_caches
from tests.unit.server.connector.test_planner import make_planner, make_request
from tests.unit.server.connector.vllm_manager import BS, positions_after_external_hit

NUM_BLOCKS, NUM_SLOTS = 8, 4


def shared_cache() -> torch.Tensor:
    """One tensor shared by a full-attention layer and a sliding-window layer (layer i of each
    group), as vLLM allocates them under the hybrid manager: [blocks, 2, 3]."""
    return torch.arange(NUM_BLOCKS * 6, dtype=torch.float32).reshape(NUM_BLOCKS, 2, 3)


def test_block_tables_become_positions_with_nulls_skipped():
    full, sliding = [5, 6, 7], [0, 0, 3]  # the window left the first two behind
    assert device_blocks([full, sliding], null_block=0) == [(5, SKIPPED), (6, SKIPPED), (7, 3)]
    assert device_blocks([[4, 9]]) == [(4,), (9,)]
    assert device_blocks([[1, 2, 3], [4]]) == [(1, 4)]  # the shortest table bounds it
    assert device_block(7) == (7,) and device_block([1, 2]) == (1, 2)
    assert whole((7, 3)) and not whole((5, SKIPPED))


def test_a_shared_tensor_is_copied_once_per_group():
    cache = shared_cache()
    caches = group_caches({"full.0": cache, "swa.0": cache}, [["full.0"], ["swa.0"]])
    assert list(caches) == [(0, "full.0"), (1, "swa.0")]
    # without groups (one group): a shared storage is copied once
    assert list(group_caches({"a": cache, "b": cache}, None)) == [(0, "a")]


def test_a_slot_holds_each_groups_own_block_and_loads_skip_nulls():
    cache = shared_cache()
    original = cache.clone()
    pool = HostKVPool(
        {"full.0": cache, "swa.0": cache}, NUM_BLOCKS, NUM_SLOTS, groups=[["full.0"], ["swa.0"]]
    )
    assert pool.num_groups == 2
    assert pool.block_bytes == 2 * 6 * 4  # one block of each group's layer
    pool.save([(1, 2), (3, 4)], [0, 1])  # position k: full block, sliding block
    cache.zero_()
    pool.load([0, 1], [(5, SKIPPED), (6, 7)])
    assert torch.equal(cache[5], original[1])  # full group, slot 0
    assert torch.equal(cache[6], original[3])  # full group, slot 1
    assert torch.equal(cache[7], original[4])  # sliding group, slot 1
    untouched = [b for b in range(NUM_BLOCKS) if b not in (5, 6, 7)]
    assert not cache[untouched].any()  # slot 0's sliding block (2) went nowhere: skipped


def test_saves_skip_positions_a_group_no_longer_holds():
    planner, index, _ = make_planner()
    planner.null_block = 0
    req = make_request("r", 16)  # 4 full blocks
    planner.on_new_request(req)
    # the sliding group dropped positions 0 and 1 (device hits behind the window)
    tables = {"r": [[10, 11, 12, 13], [0, 0, 22, 23]]}
    saves = planner.plan_saves({"r": 16}, lambda rid: tables[rid], set())
    assert [block for block, _ in saves] == [(12, 22), (13, 23)]
    assert req.block_hashes[0] not in index and req.block_hashes[2] in index


def test_a_tail_in_a_position_a_group_lost_is_not_kept():
    planner, _, _ = make_planner()
    req = make_request("r", 10, session_id="s")  # 2 full blocks + a 2-token tail
    planner.on_new_request(req)
    req.num_computed_tokens = 10
    _, delayed = planner.finish(req, [(1, 4), (2, 5), (3, SKIPPED)])
    assert not delayed and planner.pending_tail_saves == []
    # the same request with its tail block held by both groups keeps it
    again = make_request("r2", 10, session_id="s")
    planner.on_new_request(again)
    again.num_computed_tokens = 10
    _, delayed = planner.finish(again, [(1, 4), (2, 5), (3, 6)])
    assert delayed and planner.pending_tail_saves[0][1] == (3, 6)


def test_vllms_own_manager_pads_a_sliding_group_with_the_null_block():
    """What the loads rely on, on vLLM's real KV cache manager (full + 2-block window groups):
    for a request whose first 8 blocks come from the connector, the sliding group gets blocks
    only for the window before the hit's end (positions 6 and 7) and the null block before it,
    so a load copies that group's KV into those two positions and skips the rest."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    bs = BS
    shape = {"block_size": bs, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
    positions = positions_after_external_hit(
        [
            ("full", FullAttentionSpec(**shape)),
            ("swa", SlidingWindowSpec(**shape, sliding_window=2 * bs)),
        ]
    )
    loaded = positions[:8]
    assert all(full != SKIPPED for full, _ in loaded)
    assert [swa == SKIPPED for _, swa in loaded] == [True] * 6 + [False] * 2
    assert all(whole(p) for p in positions[8:])  # the blocks computed now: every group
