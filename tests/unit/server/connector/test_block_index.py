"""HostBlockIndex: slot allocation, LRU eviction, pins, token-verified matching."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.connector.core.block_index import HostBlockIndex

BS = 4


def h(i: int) -> bytes:
    return f"hash-{i}".encode()


def toks(i: int) -> list[int]:
    return [i * 100 + j for j in range(BS)]


def fill(index: HostBlockIndex, ids) -> dict[int, int]:
    slots = {}
    for i in ids:
        slot = index.allocate(h(i), toks(i))
        assert slot is not None
        slots[i] = slot
    return slots


# --- construction / allocate / free -----------------------------------------------------------
def test_negative_slots_rejected():
    with pytest.raises(ValueError):
        HostBlockIndex(-1)


def test_zero_slots_never_allocates():
    index = HostBlockIndex(0)
    assert index.allocate(h(0), toks(0)) is None
    assert index.counters.save_skipped_full == 1
    assert h(0) not in index
    assert index.used_slots == 0


def test_allocate_uses_free_slots_in_order_and_records():
    index = HostBlockIndex(3)
    slots = [index.allocate(h(i), toks(i)) for i in range(3)]
    assert slots == [0, 1, 2]
    assert index.used_slots == 3
    for i, slot in enumerate(slots):
        assert h(i) in index
        assert index.slot_of(h(i)) == slot
    assert index.slot_of(h(99)) is None
    assert index.counters.saved_blocks == 3
    assert index.counters.evictions == 0


def test_allocate_existing_hash_returns_none_and_keeps_slot():
    index = HostBlockIndex(3)
    slot = index.allocate(h(0), toks(0))
    assert index.allocate(h(0), toks(0)) is None
    assert index.slot_of(h(0)) == slot
    assert index.used_slots == 1
    assert index.counters.saved_blocks == 1


def test_allocate_existing_hash_touches_it():
    index = HostBlockIndex(2)
    fill(index, [0, 1])
    assert index.allocate(h(0), toks(0)) is None  # touch: 0 becomes MRU
    index.allocate(h(2), toks(2))
    assert h(1) not in index
    assert h(0) in index and h(2) in index


# --- LRU eviction -----------------------------------------------------------------------------
def test_lru_evicts_oldest_first():
    index = HostBlockIndex(3)
    slots = fill(index, [0, 1, 2])
    new = index.allocate(h(3), toks(3))
    assert new == slots[0]  # reuses the evicted slot
    assert h(0) not in index
    assert all(h(i) in index for i in (1, 2, 3))
    assert index.counters.evictions == 1
    index.allocate(h(4), toks(4))
    assert h(1) not in index
    assert index.counters.evictions == 2
    assert index.used_slots == 3


def test_touch_moves_to_mru():
    index = HostBlockIndex(3)
    fill(index, [0, 1, 2])
    index.touch(h(0))
    index.allocate(h(3), toks(3))
    assert h(0) in index
    assert h(1) not in index
    index.touch(h(2))  # LRU order now 0, 3, 2
    index.allocate(h(4), toks(4))
    assert h(0) not in index
    assert h(2) in index and h(3) in index


def test_touch_order_exact():
    index = HostBlockIndex(3)
    fill(index, [0, 1, 2])  # LRU order 0,1,2
    index.touch(h(1))  # 0,2,1
    index.touch(h(0))  # 2,1,0
    evicted = []
    for new in (10, 11, 12):
        before = {i for i in (0, 1, 2) if h(i) in index}
        index.allocate(h(new), toks(new))
        after = {i for i in (0, 1, 2) if h(i) in index}
        evicted.extend(before - after)
    assert evicted == [2, 1, 0]


def test_touch_unknown_hash_is_noop():
    index = HostBlockIndex(2)
    index.touch(h(5))
    assert index.used_slots == 0


# --- pins -------------------------------------------------------------------------------------
def test_pinned_block_is_not_evicted():
    index = HostBlockIndex(3)
    fill(index, [0, 1, 2])
    index.pin(h(0))
    assert index.pinned_stored_slots == 1
    index.allocate(h(3), toks(3))
    index.allocate(h(4), toks(4))
    assert h(0) in index
    assert h(1) not in index and h(2) not in index
    assert h(3) in index and h(4) in index


def test_pin_before_store_protects_when_stored():
    index = HostBlockIndex(2)
    index.pin(h(0))
    assert index.pinned_hashes == 1
    assert index.pinned_stored_slots == 0
    index.allocate(h(0), toks(0))
    assert index.pinned_stored_slots == 1
    fill(index, [1, 2, 3])
    assert h(0) in index


def test_allocate_returns_none_when_all_pinned():
    index = HostBlockIndex(2)
    fill(index, [0, 1])
    index.pin(h(0))
    index.pin(h(1))
    assert index.allocate(h(2), toks(2)) is None
    assert h(2) not in index
    assert index.counters.save_skipped_full == 1
    assert index.counters.evictions == 0
    assert h(0) in index and h(1) in index


def test_pin_counts_are_refcounts():
    index = HostBlockIndex(2)
    fill(index, [0])
    index.pin(h(0))
    index.pin(h(0))
    assert index.pin_count(h(0)) == 2
    assert index.pinned_hashes == 1
    assert index.unpin(h(0)) is False
    assert index.pin_count(h(0)) == 1
    assert index.pinned_stored_slots == 1
    assert index.unpin(h(0)) is True
    assert index.pin_count(h(0)) == 0
    assert index.pinned_hashes == 0
    assert index.pinned_stored_slots == 0


def test_unpin_without_pin_is_false():
    index = HostBlockIndex(2)
    fill(index, [0])
    assert index.unpin(h(0)) is False
    assert index.unpin(h(7)) is False
    assert index.pin_count(h(0)) == 0


def test_unpin_degrades_to_mru_not_evict_next():
    index = HostBlockIndex(3)
    fill(index, [0, 1, 2])
    index.pin(h(0))
    index.unpin(h(0))  # back to LRU as most recently used: order 1, 2, 0
    index.allocate(h(3), toks(3))
    assert h(0) in index
    assert h(1) not in index
    index.allocate(h(4), toks(4))
    assert h(2) not in index
    assert h(0) in index
    index.allocate(h(5), toks(5))
    assert h(0) not in index


def test_unpin_of_unstored_hash_forgets_pin():
    index = HostBlockIndex(2)
    index.pin(h(9))
    assert index.unpin(h(9)) is True
    assert index.pinned_hashes == 0
    slot = index.allocate(h(9), toks(9))
    assert slot is not None
    fill(index, [1, 2])
    assert h(9) not in index  # evictable again


# --- protected slots --------------------------------------------------------------------------
def test_protected_slot_not_evicted():
    index = HostBlockIndex(3)
    slots = fill(index, [0, 1, 2])
    new = index.allocate(h(3), toks(3), protected={slots[0]})
    assert new == slots[1]
    assert h(0) in index
    assert h(1) not in index


def test_all_unpinned_protected_means_no_slot():
    index = HostBlockIndex(2)
    slots = fill(index, [0, 1])
    index.pin(h(1))
    assert index.allocate(h(2), toks(2), protected={slots[0]}) is None
    assert h(0) in index and h(1) in index
    assert index.counters.save_skipped_full == 1


def test_protected_does_not_matter_with_free_slots():
    index = HostBlockIndex(3)
    slots = fill(index, [0])
    new = index.allocate(h(1), toks(1), protected={slots[0], 1, 2})
    assert new is not None
    assert index.counters.evictions == 0


# --- match ------------------------------------------------------------------------------------
def _prompt(n_blocks: int) -> tuple[list[bytes], list[int]]:
    hashes = [h(i) for i in range(n_blocks)]
    tokens = [t for i in range(n_blocks) for t in toks(i)]
    return hashes, tokens


def test_match_consecutive_blocks():
    index = HostBlockIndex(8)
    slots = fill(index, [0, 1, 2, 3])
    hashes, tokens = _prompt(4)
    assert index.match(hashes, tokens, BS, 0, 10) == [slots[i] for i in range(4)]
    assert index.match(hashes, tokens, BS, 1, 2) == [slots[1], slots[2]]
    assert index.match(hashes, tokens, BS, 0, 0) == []
    assert index.match(hashes, tokens, BS, 4, 5) == []


def test_match_stops_at_missing_block():
    index = HostBlockIndex(8)
    slots = fill(index, [0, 1, 3])
    hashes, tokens = _prompt(4)
    assert index.match(hashes, tokens, BS, 0, 4) == [slots[0], slots[1]]
    assert index.match(hashes, tokens, BS, 2, 2) == []
    assert index.counters.token_mismatches == 0


def test_match_stops_at_token_mismatch():
    index = HostBlockIndex(8)
    slots = fill(index, [0, 1, 2])
    hashes, tokens = _prompt(3)
    tokens[BS + 2] = -1  # block 1 has a different token under the same hash
    assert index.match(hashes, tokens, BS, 0, 3) == [slots[0]]
    assert index.counters.token_mismatches == 1


def test_match_partial_last_block_is_mismatch():
    index = HostBlockIndex(8)
    slots = fill(index, [0, 1])
    hashes, tokens = _prompt(2)
    assert index.match(hashes, tokens[:-1], BS, 0, 2) == [slots[0]]


def test_match_has_no_lru_side_effect():
    index = HostBlockIndex(2)
    fill(index, [0, 1])
    hashes, tokens = _prompt(1)
    assert index.match(hashes, tokens, BS, 0, 1) == [index.slot_of(h(0))]
    index.allocate(h(2), toks(2))
    assert h(0) not in index  # match did not touch


# --- clear ------------------------------------------------------------------------------------
def test_clear_keeps_pinned_and_frees_the_rest():
    index = HostBlockIndex(4)
    fill(index, [0, 1, 2])
    index.pin(h(1))
    assert index.clear() == 2
    assert h(1) in index
    assert h(0) not in index and h(2) not in index
    assert index.used_slots == 1
    # freed slots are reusable without eviction
    fill(index, [5, 6, 7])
    assert index.counters.evictions == 0
    assert index.used_slots == 4
    assert len({index.slot_of(h(i)) for i in (1, 5, 6, 7)}) == 4


def test_slots_stay_consistent_under_churn():
    index = HostBlockIndex(5)
    for i in range(50):
        index.allocate(h(i), toks(i))
        if i % 7 == 0:
            index.pin(h(i))
        if i % 11 == 0:
            index.unpin(h(i - 7))
    stored = [i for i in range(50) if h(i) in index]
    slots = [index.slot_of(h(i)) for i in stored]
    assert len(stored) == index.used_slots <= 5
    assert len(set(slots)) == len(slots)
    assert all(0 <= s < 5 for s in slots)


# --- store stats (issue 13 item 10) -----------------------------------------------------------
def test_stats_pinned_bytes_and_pinned_blocks_count_the_same_blocks():
    """A pin taken before its block is stored (a branch's last block, a block the store had
    no room for) holds budget but no host memory: both numbers count stored pinned blocks."""
    from server.connector.control.ops import stats_of
    from server.connector.core.planner import Planner
    from server.connector.core.sessions import SessionRegistry

    index = HostBlockIndex(4)
    registry = SessionRegistry(
        index, block_size=BS, block_bytes=10, pin_budget_bytes=40, default_ttl_s=60.0
    )
    side = SimpleNamespace(
        planner=Planner(index, registry, BS),
        block_bytes=10,
        window_bytes=0,
        state_bytes=0,
        extra_stats={},
    )
    fill(index, [1])
    index.pin(h(1))
    index.pin(h(2))  # pinned, never stored
    store = stats_of(side, None)["store"]
    assert store["pinned_blocks"] == 1
    assert store["pinned_bytes"] == store["pinned_blocks"] * store["block_bytes"] == 10
    assert store["pin_budget_used_bytes"] == 20  # what the budget is charged: both pins
