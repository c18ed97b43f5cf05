"""What an aggregated replica keeps of the turns it served, for peers' revives
(server/plugin/own_turns.py): the latest turn per branch, bounded in branches and token ids;
and the bound on revives running at once."""

from __future__ import annotations

from server.connector.pd.transfer_auth import HASHES_FIELD, IDENTITY_FIELD, TOKENS_FIELD
from server.plugin.own_turns import OwnTurn, OwnTurns, ReviveSlots

KEY = ("tenant", "s1", "main")


def params(tokens: int = 40) -> dict:
    return {TOKENS_FIELD: list(range(tokens)), HASHES_FIELD: ["aa", "bb"], IDENTITY_FIELD: "id"}


def own(turn: int, tokens: int = 40) -> OwnTurn:
    made = OwnTurn.of(turn, "salt", params(tokens))
    assert made is not None
    return made


def test_a_handle_without_its_tokens_hashes_or_identity_is_not_kept():
    for field in (TOKENS_FIELD, HASHES_FIELD, IDENTITY_FIELD):
        assert OwnTurn.of(1, None, {k: v for k, v in params().items() if k != field}) is None
    assert OwnTurn.of(1, None, dict(params(), **{TOKENS_FIELD: [1, "2"]})) is None
    assert OwnTurn.of(1, None, dict(params(), **{TOKENS_FIELD: [-1]})) is None
    kept = OwnTurn.of(1, 7, params())
    assert kept is not None and kept.cache_salt is None and list(kept.tokens) == list(range(40))


def test_the_latest_turn_of_a_branch_is_kept():
    turns = OwnTurns()
    turns.remember(KEY, own(2))
    turns.remember(KEY, own(1, tokens=10))  # a late answer of an older turn
    assert turns.get(KEY).turn == 2
    turns.remember(KEY, own(3, tokens=10))
    assert turns.get(KEY).turn == 3 and len(turns.get(KEY).tokens) == 10
    assert turns.get(("other", "s1", "main")) is None


def test_branches_and_token_ids_are_bounded_least_recently_served_first_out():
    turns = OwnTurns(max_turns=2, max_tokens=100)
    for i in range(3):
        turns.remember(("t", f"s{i}", "main"), own(1))
    assert turns.get(("t", "s0", "main")) is None and len(turns) == 2
    turns.remember(("t", "big", "main"), own(1, tokens=90))
    assert len(turns) == 1 and turns.get(("t", "big", "main")) is not None
    turns.remember(("t", "huge", "main"), own(1, tokens=101))  # alone over the bound
    assert turns.get(("t", "huge", "main")) is None and len(turns) == 1


def test_one_revive_per_branch_and_a_few_in_all():
    slots = ReviveSlots(at_once=2)
    assert slots.take(KEY) is None
    assert slots.take(KEY) == "busy_branch"
    assert slots.take(("t", "s2", "main")) is None
    assert slots.take(("t", "s3", "main")) == "busy"
    slots.give(KEY)
    assert slots.take(KEY) is None
