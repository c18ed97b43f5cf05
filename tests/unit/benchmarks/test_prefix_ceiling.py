"""The prefix-cache ceiling on hand-made token lists (pure logic: no tokenizer, no server): hits in
whole blocks rounded down, from any earlier step of any earlier conversation, never the whole
prompt, nothing from a later conversation; the totals; which conversations a count ran, split
by cache salt; and a recorded count's reuse."""

from __future__ import annotations

import pytest

from benchmarks.history import prefix_ceiling as pc
from benchmarks.traces import Conversation, Step


def _reuse(result: pc.Ceiling) -> list[tuple[str, int, int, int]]:
    return [(s.conv, s.step, s.tokens, s.reusable) for s in result.steps]


def test_a_shared_prefix_counts_in_whole_blocks_rounded_down() -> None:
    a = list(range(10))
    b = list(range(7)) + [90, 91, 92]  # 7 tokens shared: one block of 4, not two
    got = pc.ceiling([("a", [a]), ("b", [b])], block=4)
    assert _reuse(got) == [("a", 0, 10, 0), ("b", 0, 10, 4)]


def test_a_cold_step_reuses_any_earlier_step_of_another_conversation() -> None:
    a0 = [1, 2, 3, 4, 5]
    a1 = a0 + [6, 7, 8, 9]  # a's resumed step holds more than its cold one
    b0 = [1, 2, 3, 4, 5, 6, 7, 8, 100, 101]
    c0 = [1, 2, 3, 4, 50, 51, 52, 53, 54]
    got = pc.ceiling([("a", [a0, a1]), ("b", [b0]), ("c", [c0])], block=2)
    assert _reuse(got) == [
        ("a", 0, 5, 0),
        ("a", 1, 9, 4),  # a0's two full blocks
        ("b", 0, 10, 8),  # a1's first four blocks: another conversation's resumed step
        ("c", 0, 9, 4),
    ]
    assert (got.totals.cold_tokens, got.totals.cold_reused) == (24, 12)
    assert (got.totals.resumed_tokens, got.totals.resumed_reused) == (9, 4)


def test_nothing_shared_reuses_nothing_and_a_later_conversation_never_helps() -> None:
    got = pc.ceiling([("a", [[1, 2, 3, 4]]), ("b", [[5, 6, 7, 8]]), ("c", [[1, 2, 3, 4]])], 2)
    assert [s.reusable for s in got.steps] == [0, 0, 2]  # c: a's, and never the last token


def test_a_prompt_seen_whole_still_computes_its_last_token() -> None:
    same = [7] * 8
    got = pc.ceiling([("a", [same, same]), ("b", [same + [9]])], block=4)
    assert [s.reusable for s in got.steps] == [0, 4, 8]
    assert pc.ceiling([("a", [[1]])], block=1).steps[0].reusable == 0
    with pytest.raises(ValueError):
        pc.ceiling([("a", [[1]])], block=0)


def test_conversations_are_rendered_step_by_step() -> None:
    convs = [
        Conversation("a", (Step({"prompt": [1, 2, 3]}, 1), Step({"prompt": [1, 2, 3, 4, 5]}, 1))),
        Conversation("b", (Step({"prompt": [1, 2, 3, 4, 9]}, 1),)),
    ]
    got = pc.conversations_ceiling(convs, lambda s: s.body["prompt"], block=2)
    assert _reuse(got) == [("a", 0, 3, 0), ("a", 1, 5, 2), ("b", 0, 5, 4)]
    assert (got + got).totals.cold_tokens == 2 * got.totals.cold_tokens


def test_a_count_runs_its_conversations_in_item_order_one_list_per_salt() -> None:
    convs = [Conversation(f"c{i}", (Step({"prompt": [i]}, 1),)) for i in range(3)]
    groups = pc.ran_at(convs, agents=2, per_agent=2)  # items 0..3: c0 c1 c2, then c0 again
    assert [[c.id for c in g] for g in groups] == [["c0", "c1", "c2"], ["c0"]]


def test_a_recorded_count_reuses_its_prompt_minus_recomputed_tokens() -> None:
    turns = [
        {"step": 0, "prompt_tokens": 100, "recomputed_tokens": 100},
        {"step": 0, "prompt_tokens": 100, "recomputed_tokens": 40},
        {"step": 1, "prompt_tokens": 120, "recomputed_tokens": 20},
    ]
    assert pc.measured(turns) == pc.Totals(200, 60, 120, 100)
