"""What a replica agrees to revive for a peer (server/plugin/revive_rules.py): the prefix its
host store covers plus one token, never less than a pull is worth, never more than the size
limit, never with another identity; and the peer's body."""

from __future__ import annotations

import pytest

from server.plugin.revive_rules import (
    Refusal,
    ReviveTarget,
    hashes_to_check,
    parse_target,
    revive_prompt,
)

BS = 16
TOKENS = list(range(100, 100 + 10 * BS + 5))  # 10 full blocks and 5 tokens


def prompt(covered: int, **kw):
    kw.setdefault("identity_ok", True)
    kw.setdefault("min_tokens", 32)
    return revive_prompt(TOKENS, covered, BS, **kw)


def test_the_covered_blocks_and_one_token_more_are_prefilled():
    # The engine loads every covered block from the host store and computes one token.
    assert prompt(4) == TOKENS[: 4 * BS + 1]
    assert prompt(10) == TOKENS[: 10 * BS + 1]


def test_a_cover_past_the_turns_tokens_stops_one_token_short_of_its_end():
    exact = list(range(4 * BS))  # whole blocks: the last one cannot be followed by a token
    assert revive_prompt(exact, 4, BS, identity_ok=True, min_tokens=1) == exact[: 3 * BS + 1]
    assert prompt(50) == TOKENS[: 10 * BS + 1]


def test_the_size_limit_cuts_the_prefix():
    assert prompt(10, max_tokens=3 * BS + 1) == TOKENS[: 3 * BS + 1]
    assert prompt(10, max_tokens=3 * BS) == TOKENS[: 2 * BS + 1]


@pytest.mark.parametrize(
    ("covered", "min_tokens"), [(0, 1), (1, 32), (-3, 1)], ids=["nothing", "too_few", "negative"]
)
def test_too_little_in_the_host_store_is_refused(covered, min_tokens):
    refused = prompt(covered, min_tokens=min_tokens)
    assert isinstance(refused, Refusal) and refused.status == 409
    assert refused.reason == "not_covered"


def test_another_identity_is_refused_whatever_is_covered():
    refused = prompt(10, identity_ok=False)
    assert isinstance(refused, Refusal) and (refused.status, refused.reason) == (409, "identity")


def test_only_as_many_hashes_as_a_revive_may_load_are_asked():
    hashes = [f"{i:02x}" for i in range(10)]
    assert hashes_to_check(hashes, BS, 3 * BS + 1) == hashes[:3]
    assert hashes_to_check(hashes, BS, 3 * BS) == hashes[:2]
    assert hashes_to_check(hashes, BS, 10**6) == hashes


def test_the_peer_names_a_session_and_a_branch():
    assert parse_target({"session_id": "s1"}) == ReviveTarget("s1", "main")
    assert parse_target({"session_id": "s1", "branch_id": "b2"}) == ReviveTarget("s1", "b2")


@pytest.mark.parametrize(
    "body",
    [
        None,
        [],
        {},
        {"session_id": "../x"},
        {"session_id": 5},
        {"session_id": "s1", "branch_id": ""},
        {"session_id": "s1", "tokens": [1, 2]},
    ],
)
def test_any_other_body_is_a_400(body):
    refused = parse_target(body)
    assert isinstance(refused, Refusal) and refused.status == 400
