"""Issue 22 item 3a: a fork shares its parent's tokens and block hashes (``SharedSeq``), so a
fork costs O(1) memory until it diverges, and a turn costs only its new tokens."""

from __future__ import annotations

import tracemalloc

import pytest

from server.connector.core.block_index import HostBlockIndex
from server.connector.core.branches import MAX_SEGMENTS, SharedSeq
from server.connector.core.sessions import DEFAULT_BRANCH, SessionRegistry

BS, N = 16, 8192


def make_registry() -> SessionRegistry:
    return SessionRegistry(
        HostBlockIndex(1024),
        block_size=BS,
        block_bytes=1,
        pin_budget_bytes=1 << 40,
        default_ttl_s=60.0,
        clock=lambda: 0.0,
        max_branches_per_session=10_000,
    )


def conversation() -> tuple[list[int], list[bytes]]:
    return [1000 + i for i in range(N)], [b"h%031d" % k for k in range(N // BS)]


def bytes_per(action, count: int) -> float:
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for i in range(count):
            action(i)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    return sum(s.size_diff for s in after.compare_to(before, "filename")) / count


def test_a_fork_of_an_8k_token_branch_costs_about_a_kilobyte_not_the_token_list():
    reg = make_registry()
    tokens, hashes = conversation()
    reg.observe_request("s", DEFAULT_BRANCH, tokens, hashes, None)
    per_fork = bytes_per(lambda i: reg.fork("s", DEFAULT_BRANCH, f"b{i}"), 64)
    # A copied list of 8192 tokens alone is 64 KiB (before: ~75 KB per auto-pinned fork).
    assert per_fork < 4096, per_fork
    fork = reg.get_branch("s", "b0")
    assert fork.token_ids == tokens and fork.block_hashes == hashes
    assert fork.pinned and list(fork.pinned_hashes) == hashes


def test_a_turn_on_a_fork_costs_its_new_tokens_only():
    reg = make_registry()
    tokens, hashes = conversation()
    reg.observe_request("s", DEFAULT_BRANCH, tokens, hashes, None)
    for i in range(32):
        reg.fork("s", DEFAULT_BRANCH, f"b{i}")

    def turn(i: int) -> None:
        reg.observe_request("s", f"b{i}", tokens + [7, i], hashes + [b"x%031d" % i], None)

    assert bytes_per(turn, 32) < 4096
    assert reg.get_branch("s", "b3").token_ids == tokens + [7, 3]
    assert reg.get_branch("s", DEFAULT_BRANCH).token_ids == tokens


def test_a_fork_inside_the_parent_and_its_divergent_turn():
    reg = make_registry()
    tokens, hashes = conversation()
    reg.observe_request("s", DEFAULT_BRANCH, tokens, hashes, None)
    fork = reg.fork("s", DEFAULT_BRANCH, "f", token_offset=100)
    assert fork.token_ids == tokens[:100] and fork.block_hashes == hashes[: 100 // BS]
    edited = tokens[:50] + [5] * 30
    reg.observe_request("s", "f", edited, hashes[:3], None)
    assert reg.get_branch("s", "f").token_ids == edited
    assert reg.get_branch("s", DEFAULT_BRANCH).token_ids == tokens
    by_prefix = reg.fork("s", "f", "g", token_prefix=tokens[:50] + [5, 5, 9])
    assert by_prefix.fork_offset_tokens == 52


def test_shared_seq_behaves_like_a_tuple():
    base = SharedSeq(range(10))
    assert list(base) == list(range(10)) and len(base) == 10 and base == list(range(10))
    cut = base.prefix(4)
    assert cut == [0, 1, 2, 3] and cut[3] == 3 and cut[-1] == 3
    with pytest.raises(IndexError):
        cut[4]
    assert base[:4] == cut and base[2:5] == [2, 3, 4] and base[::3] == [0, 3, 6, 9]
    longer = cut.extend([40, 41])
    assert longer == [0, 1, 2, 3, 40, 41] and longer.prefix(5) == [0, 1, 2, 3, 40]
    assert longer.prefix(3) == [0, 1, 2] and longer.prefix(0) == []
    assert base.common_prefix([0, 1, 2, 9]) == 3 and longer.common_prefix(longer) == 6
    again = longer.rebased([0, 1, 2, 3, 40, 41, 42])
    assert again == [0, 1, 2, 3, 40, 41, 42] and again.prefix(6) is longer
    assert base == tuple(range(10)) and base != list(range(9)) and base != "x"


def test_shared_seq_chains_are_flattened_past_max_segments():
    seq: SharedSeq[int] = SharedSeq([0])
    expected = [0]
    for i in range(1, 3 * MAX_SEGMENTS):
        seq = seq.extend([i])
        expected.append(i)
    assert seq == expected and seq._depth <= MAX_SEGMENTS
    assert [seq[i] for i in range(len(seq))] == expected
