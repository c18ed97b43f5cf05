"""Sliding-window (and chunked-local) groups keep their part of a stored position only where a
resume reads it (``core/part_pool.py``): the rule of which positions a resume reads, checked
against vLLM's own KV cache manager; the pool of parts; the planner's saves, hits, loads and
releases; the host pool's second set of slots."""

from __future__ import annotations

import pytest
import torch

from server.connector.core.block_index import HostBlockIndex
from server.connector.core.kv_groups import (
    CHUNKED_LOCAL,
    SLIDING_WINDOW,
    GroupWindow,
    WindowRule,
)
from server.connector.core.metadata import SKIPPED, device_blocks
from server.connector.core.part_pool import PART_SHARE, PartPool, split_store
from server.connector.core.planner import Planner
from server.connector.core.sessions import SessionRegistry
from server.connector.engine.host_pool import HostKVPool
from tests.unit.server.connector.fakes import BS, FakeRequest
from tests.unit.server.connector.vllm_manager import BS as VLLM_BS
from tests.unit.server.connector.vllm_manager import positions_after_external_hit


# --- which positions a resume reads: vLLM's own manager decides ------------------------------
@pytest.mark.parametrize(
    "window",
    [
        GroupWindow(SLIDING_WINDOW, VLLM_BS + 1),
        GroupWindow(SLIDING_WINDOW, 2 * VLLM_BS),
        GroupWindow(SLIDING_WINDOW, 2 * VLLM_BS + 5),
        GroupWindow(SLIDING_WINDOW, 5 * VLLM_BS - 3),
        GroupWindow(CHUNKED_LOCAL, 3 * VLLM_BS),
        GroupWindow(CHUNKED_LOCAL, 5 * VLLM_BS),
    ],
    ids=lambda w: f"{w.kind}-{w.tokens}",
)
def test_first_block_is_where_vllm_gives_the_windowed_group_blocks(window):
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        SlidingWindowSpec,
    )

    shape = {"block_size": VLLM_BS, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
    spec = (
        SlidingWindowSpec(**shape, sliding_window=window.tokens)
        if window.kind == SLIDING_WINDOW
        else ChunkedLocalAttentionSpec(**shape, attention_chunk_size=window.tokens)
    )
    positions = positions_after_external_hit(
        [("full", FullAttentionSpec(**shape)), ("win", spec)], external_blocks=8
    )
    windowed = [p[1] != SKIPPED for p in positions[:8]]
    rule = WindowRule(frozenset({1}), (window,), VLLM_BS)
    first = rule.first_block(8 * VLLM_BS)
    assert windowed == [k >= first for k in range(8)]


# --- the store's bytes ------------------------------------------------------------------------
def test_split_store_gives_each_pool_at_most_its_share():
    assert split_store(1000, 10) == (100, [])  # no pools: as before
    assert split_store(1000, 10, [0, 0]) == (100, [0, 0])
    slots, (parts,) = split_store(6000, 1, [5])  # Gemma 3's shape: five window layers in six
    assert parts * 5 <= 6000 * PART_SHARE and slots + parts * 5 <= 6000
    assert slots == 4500 and parts == 300  # 4.5x the 1000 whole positions of one pool
    slots, (parts,) = split_store(1100, 10, [1])  # a small window share: one part per slot
    assert slots == parts == 100
    assert split_store(100, 0, [5]) == (80, [20])  # every layer windowed: slots cost no bytes
    # a hybrid state model (attention 384, states 262 a position): a quarter to states
    slots, (windows, states) = split_store(6460, 384, [0, 262])
    assert windows == 0 and states == 6 and slots == (6460 - 6 * 262) // 384


# --- the pool of parts ------------------------------------------------------------------------
def test_parts_evict_least_recent_unpinned_unprotected_and_reuse_released_next_step():
    parts = PartPool(2)
    never = lambda slot: False  # noqa: E731
    a = parts.attach(10, set(), never)
    b = parts.attach(11, set(), never)
    assert {a, b} == {0, 1} and parts.attach(10, set(), never) is None  # has one
    parts.touch(10)
    # full: 11 is least recent, but pinned; 10 is protected this step -> nothing
    assert parts.attach(12, {a}, lambda slot: slot == 11) is None
    assert parts.attach(12, set(), lambda slot: slot == 11) == a  # 10's part evicted
    assert parts.part_of(10) is None and parts.evictions == 1
    assert parts.release(12) and not parts.release(12)
    assert parts.attach(13, set(), lambda slot: True) is None  # released: not this step
    parts.new_step()
    assert parts.attach(13, set(), never) == a


def test_dropping_a_slot_drops_its_part():
    index = HostBlockIndex(1, window_slots=1)
    slot = index.allocate(b"h1", [1])
    assert slot is not None and index.attach_window(slot, set()) == 0
    index.allocate(b"h2", [2])  # evicts h1
    assert index.windows.part_of(slot) is None
    index.windows.new_step()
    assert index.attach_window(index.slot_of(b"h2"), set()) == 0


# --- the planner ------------------------------------------------------------------------------
#: A 2-block window (7 tokens back): a hit of n tokens reads positions (n - 7) // 4 on.
RULE = WindowRule(frozenset({1}), (GroupWindow(SLIDING_WINDOW, 2 * BS),), BS)


def window_planner(slots: int = 64, parts: int = 16) -> tuple[Planner, HostBlockIndex]:
    index = HostBlockIndex(slots, window_slots=parts)
    registry = SessionRegistry(
        index, block_size=BS, block_bytes=1, pin_budget_bytes=16, default_ttl_s=60.0
    )
    return Planner(index, registry, BS, num_groups=2, window=RULE), index


def tokens(n: int, seed: int = 0) -> list[int]:
    return [(seed * 1000 + i) % 30_000 for i in range(n)]


def tables(n_blocks: int, *, window_from: int = 0) -> list[list[int]]:
    """A request's block tables: full group ids 100.., windowed group 200.. with the null
    block (0) before ``window_from``."""
    full = [100 + k for k in range(n_blocks)]
    window = [0 if k < window_from else 200 + k for k in range(n_blocks)]
    return [full, window]


def fill(planner: Planner, req: FakeRequest, n_tokens: int) -> list:
    planner.on_new_request(req)
    table = tables(len(req.all_token_ids) // BS + 1)
    return planner.plan_saves({req.request_id: n_tokens}, lambda rid: table, set())


def test_a_prompt_saves_window_parts_only_before_its_end():
    planner, index = window_planner()
    req = FakeRequest("r", tokens(40), 40)
    saves = fill(planner, req, 40)
    # window_from = first_block(36) = (36 - 7) // 4 = 7: positions 7, 8, 9 carry a part
    with_part = [k for k, (block, slots) in enumerate(saves) if slots[1] != SKIPPED]
    assert with_part == [7, 8, 9]
    assert all(block[1] == SKIPPED for block, slots in saves if slots[1] == SKIPPED)
    assert saves[8][0] == (108, 208) and saves[8][1][0] == index.slot_of(req.block_hashes[8])
    assert len(index.windows) == 3


def test_the_next_turn_hits_the_whole_history_and_loads_the_window():
    planner, index = window_planner()
    fill(planner, FakeRequest("r1", tokens(40), 40), 40)
    nxt = FakeRequest("r2", tokens(48), 48)
    planner.on_new_request(nxt)
    assert planner.num_new_matched_tokens(nxt, 0) == 40
    # vLLM gives the windowed group blocks from first_block(40) = 8 on
    table = tables(12, window_from=RULE.first_block(40))
    planner.after_alloc(nxt, device_blocks(table), 40)
    loads = planner.pending_loads
    assert len(loads) == 10 and index.counters.window_misses == 0
    copied = [block[1] != SKIPPED and slots[1] != SKIPPED for slots, block in loads]
    assert copied == [False] * 8 + [True] * 2 and index.windows.loaded == 2
    assert loads[9][1] == (109, 209)


def test_a_hit_ends_where_the_window_has_its_parts():
    """A history diverging mid-way: the hit may not end where no part was kept; it ends
    earlier (here nowhere) and the turn recomputes: never a load without the window."""
    planner, index = window_planner()
    fill(planner, FakeRequest("r1", tokens(40), 40), 40)
    edited = tokens(40)
    edited[26] += 1  # block 6 differs
    req = FakeRequest("r2", edited, 40)
    planner.on_new_request(req)
    assert planner.num_new_matched_tokens(req, 0) == 0
    assert index.counters.window_cuts == 1
    # a history that ends one block earlier than stored still reads positions 7 (of 8)
    shorter = FakeRequest("r3", tokens(36) + [9, 9, 9, 9], 40)
    planner.on_new_request(shorter)
    assert planner.num_new_matched_tokens(shorter, 0) == 36


def test_a_load_without_the_part_vllm_asked_for_is_counted():
    planner, index = window_planner()
    fill(planner, FakeRequest("r1", tokens(40), 40), 40)
    nxt = FakeRequest("r2", tokens(48), 48)
    planner.on_new_request(nxt)
    assert planner.num_new_matched_tokens(nxt, 0) == 40
    table = tables(12, window_from=6)  # one position earlier than the rule: 6 has no part
    planner.after_alloc(nxt, device_blocks(table), 40)
    assert index.counters.window_misses == 1


def test_a_long_answer_releases_the_parts_no_resume_reads():
    planner, index = window_planner()
    req = FakeRequest("r", tokens(40), 12, session_id="s")  # 12-token prompt, answer to 40
    saves = fill(planner, req, 40)
    assert all(slots[1] != SKIPPED for _, slots in saves)  # window_from = 0: every position
    req.num_computed_tokens = 39
    planner.finish(req, None)
    kept = [index.windows.part_of(index.slot_of(h)) is not None for h in req.block_hashes[:9]]
    # the prompt's window (0-2) and the end's, first_block(36) = 7 on, stay; 3-6 go
    assert kept == [True] * 3 + [False] * 4 + [True] * 2
    assert index.windows.released == 4


def test_a_tail_carries_its_window_part():
    planner, index = window_planner()
    req = FakeRequest("r", tokens(42), 42, session_id="s")
    fill(planner, req, 42)
    req.num_computed_tokens = 42
    positions = [tuple(p) for p in zip(*tables(11), strict=True)]
    _, delayed = planner.finish(req, positions)
    assert delayed
    saves, done = planner.plan_tail_saves(set(), set())
    assert done == ["r"] and len(saves) == 1
    block, slots = saves[0]
    assert block == (110, 210) and slots[1] != SKIPPED


# --- the host pool ----------------------------------------------------------------------------
def test_the_windowed_groups_have_their_own_slots_in_the_host_pool():
    cache = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 2, 3)
    original = cache.clone()
    pool = HostKVPool(
        {"full.0": cache, "swa.0": cache},
        8,
        4,
        groups=[["full.0"], ["swa.0"]],
        pools=[(frozenset({1}), 1)],
    )
    assert pool.host_caches[(0, "full.0")].shape[0] == 4
    assert pool.host_caches[(1, "swa.0")].shape[0] == 1
    assert pool.block_bytes == 6 * 4 and pool.part_bytes == [6 * 4]
    pool.save([(1, SKIPPED), (3, 4)], [(0, SKIPPED), (1, 0)])
    cache.zero_()
    pool.load([(0, SKIPPED), (1, 0)], [(5, SKIPPED), (6, 7)])
    assert torch.equal(cache[5], original[1]) and torch.equal(cache[6], original[3])
    assert torch.equal(cache[7], original[4])  # the window part: window slot 0
    assert not cache[[b for b in range(8) if b not in (5, 6, 7)]].any()
