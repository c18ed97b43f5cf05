"""Pure logic of P/D transfer handles: which of D's tokens P may read (token prefix, identity,
chained block hash), the block list trimmed to exactly those tokens, seals, claims, replays and
holds that yield to new work. The real engines run them in tests/integration/test_pd_trust.py."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from server.connector.pd import transfer_auth as auth
from server.connector.pd.hold_registry import Hold, HoldRegistry
from server.connector.pd.transfer_auth import claim_valid, expired, is_sealed, make_claim, seal
from server.connector.pd.transfer_params import identity_of, pullable_tokens, trim_block_ids
from tests.unit.server.connector.fakes import BS, chained_hashes

SECRET = b"s" * 32


@dataclass
class FakeRequest:
    """The engine request's fields the checks read (duck-typed like vLLM's ``Request``)."""

    prompt_token_ids: list[int]
    block_hashes: list[bytes] = field(default_factory=list)
    cache_salt: str | None = None
    lora_request: object = None
    mm_features: list = field(default_factory=list)
    prompt_embeds: object = None


def _handle(held: list[int], salt: str | None = None, n_blocks: int | None = None) -> dict:
    req = FakeRequest(held, chained_hashes(held, salt), cache_salt=salt)
    blocks = n_blocks if n_blocks is not None else -(-len(held) // BS)
    return {
        "remote_num_tokens": len(held),
        auth.TOKENS_FIELD: held,
        auth.HASHES_FIELD: [h.hex() for h in req.block_hashes],
        auth.IDENTITY_FIELD: identity_of(req),
        "remote_block_ids": [list(range(100, 100 + blocks))],
    }


def _prompt(tokens: list[int], salt: str | None = None) -> FakeRequest:
    return FakeRequest(tokens, chained_hashes(tokens, salt), cache_salt=salt)


def test_a_diverging_history_pulls_only_the_common_prefix():
    held = list(range(1, 15))  # 14 tokens: blocks 100..103
    prompt = list(range(1, 10)) + [99, 98, 97, 96]  # differs from token 9 on
    assert pullable_tokens(_handle(held), _prompt(prompt), BS) == 9


def test_the_block_list_is_cut_to_the_verified_prefix_not_end_aligned():
    # NIXL pairs P's unfilled blocks with the LAST blocks of the list it is given: the list must
    # end at the block holding the last verified token.
    assert trim_block_ids([[100, 101, 102, 103]], 9, BS) == [[100, 101, 102]]
    assert trim_block_ids([[100, 101, 102, 103]], 8, BS) == [[100, 101]]
    assert trim_block_ids([[100, 101, 102, 103]], 16, BS) == [[100, 101, 102, 103]]


@pytest.mark.parametrize(
    "ids", [[[1, 2], [3, 4]], [1, 2, 3], "1,2", [["1", 2]], [[-1, 2]], [[True, 2]], None, [[1]]]
)
def test_block_lists_of_another_shape_pull_nothing(ids):
    # two lists for one group, flat, strings, negative ids, too short for the tokens
    assert trim_block_ids(ids, 8, BS) is None


FULL, WINDOW, STATE = "full_attention", "sliding_window", "mamba"


def test_a_window_group_is_pulled_only_when_the_prefix_ends_in_ds_last_block():
    # D holds 14 tokens (blocks at positions 0..3); its window group arrives clipped to the
    # window before its end (positions 2..3 here, with vLLM's null block 0 before them).
    ids = [[100, 101, 102, 103], [0, 202, 203]]
    kinds = (FULL, WINDOW)
    assert trim_block_ids(ids, 14, BS, kinds, held_tokens=14) == [
        [100, 101, 102, 103],
        [0, 202, 203],
    ]
    assert trim_block_ids(ids, 13, BS, kinds, held_tokens=14) == [
        [100, 101, 102, 103],
        [0, 202, 203],
    ]
    # a prefix ending in an earlier block needs window blocks D has freed: nothing
    assert trim_block_ids(ids, 12, BS, kinds, held_tokens=14) is None
    assert trim_block_ids(ids, 9, BS, kinds, held_tokens=14) is None


def test_a_state_group_is_pulled_only_for_exactly_what_d_computed():
    ids = [[100, 101, 102, 103], [300]]
    kinds = (FULL, STATE)
    assert trim_block_ids(ids, 14, BS, kinds, held_tokens=14) == [[100, 101, 102, 103], [300]]
    assert trim_block_ids(ids, 13, BS, kinds, held_tokens=14) is None


@pytest.mark.parametrize(
    ("ids", "kinds"),
    [
        ([[100, 101, 102, 103]], (FULL, WINDOW)),  # fewer lists than groups
        ([[100, 101, 102, 103], [202, 203]], (FULL,)),  # more lists than groups
        ([[100, 101, 102, 103], []], (FULL, WINDOW)),  # an empty window
        ([[100, 101, 102, 103], [202, 203]], (FULL, "CrossAttentionSpec")),  # an unknown kind
        ([[100, 101, 102, 103], [202, "x"]], (FULL, WINDOW)),
    ],
)
def test_several_groups_of_another_shape_pull_nothing(ids, kinds):
    assert trim_block_ids(ids, 14, BS, kinds, held_tokens=14) is None


def test_a_regeneration_shorter_than_what_d_holds_pulls_its_prefix():
    held = list(range(1, 21))
    assert pullable_tokens(_handle(held), _prompt(held[:11]), BS) == 10  # never the last token


def test_another_cache_salt_pulls_nothing_even_with_equal_tokens():
    held = list(range(1, 15))
    assert pullable_tokens(_handle(held, salt="tenant-a"), _prompt(held + [5], "tenant-b"), BS) == 0
    assert (
        pullable_tokens(_handle(held, salt="tenant-a"), _prompt(held + [5], "tenant-a"), BS) == 14
    )


def test_a_block_hash_that_disagrees_pulls_nothing():
    held = list(range(1, 15))
    handle = _handle(held)
    # D's chained hash of the last verified full block (block 3) says it encodes something
    # else (another salt, adapter or image upstream in the chain): the tokens alone agree.
    handle[auth.HASHES_FIELD][2] = "00" * 32
    assert pullable_tokens(handle, _prompt(held + [5]), BS) == 0
    # too few hashes for the verified blocks
    handle[auth.HASHES_FIELD] = handle[auth.HASHES_FIELD][:1]
    assert pullable_tokens(handle, _prompt(held + [5]), BS) == 0


def test_multimodal_or_embedding_requests_pull_nothing():
    held = list(range(1, 15))
    req = _prompt(held + [5])
    req.mm_features = [object()]
    handle = _handle(held)
    handle[auth.IDENTITY_FIELD] = identity_of(req)
    assert pullable_tokens(handle, req, BS) == 0


@pytest.mark.parametrize("num", [None, "12", -3, 0, True, 1.5])
def test_bad_token_counts_pull_nothing(num):
    held = list(range(1, 15))
    handle = _handle(held)
    handle["remote_num_tokens"] = num
    assert pullable_tokens(handle, _prompt(held + [5]), BS) == 0


def test_seal_covers_every_field_that_names_memory():
    handle = _handle(list(range(1, 15)))
    handle[auth.EXPIRES_FIELD] = time.time() + 30
    seal(handle, SECRET)
    assert is_sealed(handle, SECRET)
    assert not is_sealed(handle, b"other secret")
    for key, value in (
        ("remote_block_ids", [[0, 1, 2, 3]]),
        ("remote_host", "10.0.0.9"),
        ("remote_num_tokens", 999),
        (auth.TOKENS_FIELD, [7] * 14),
        (auth.EXPIRES_FIELD, time.time() + 9999),
    ):
        forged = dict(handle, **{key: value})
        assert not is_sealed(forged, SECRET), key
    # the router flips these between legs; they stay outside the seal
    assert is_sealed(dict(handle, do_remote_decode=True, do_remote_prefill=False), SECRET)


@pytest.mark.parametrize(
    "params",
    [
        None,
        [],
        "x",
        {},
        {auth.MAC_FIELD: 5},
        {auth.MAC_FIELD: "ab"},
        {auth.MAC_FIELD: "ab", "remote_block_ids": {1, 2}},
    ],
)
def test_seal_check_never_raises(params):
    assert is_sealed(params, SECRET) is False


def test_expiry_is_checked_on_the_wall_clock():
    assert expired({auth.EXPIRES_FIELD: time.time() - 1})
    assert not expired({auth.EXPIRES_FIELD: time.time() + 10})
    assert expired({})
    assert expired({auth.EXPIRES_FIELD: "soon"}) and expired({auth.EXPIRES_FIELD: True})


def test_claims_are_bound_to_their_handle_and_deadline():
    deadline = {auth.EXPIRES_FIELD: time.time() + 60}
    handle = seal(dict(_handle(list(range(1, 15))), **deadline), SECRET)
    handle[auth.CLAIM_FIELD] = make_claim(handle, time.time() + 30, SECRET)
    assert claim_valid(handle, SECRET, margin_s=6)
    assert not claim_valid(handle, SECRET, margin_s=31)  # too close to its end
    other = seal(dict(handle, remote_request_id="other"), SECRET)
    assert not claim_valid(other, SECRET, margin_s=6)  # claim of another handle
    forged = dict(handle[auth.CLAIM_FIELD], until=time.time() + 999)
    stretched = dict(handle, **{auth.CLAIM_FIELD: forged})
    assert not claim_valid(stretched, SECRET, margin_s=6)  # forged deadline
    assert not claim_valid({auth.MAC_FIELD: "x", auth.CLAIM_FIELD: "y"}, SECRET, margin_s=0)


def test_a_handle_is_used_once():
    seen = auth.ConsumedHandles(capacity=4)
    assert seen.consume("h1", time.time() + 30)
    assert not seen.consume("h1", time.time() + 30)
    for i in range(10):  # bounded
        seen.consume(f"x{i}", time.time() + 30)
    assert len(seen._seen) <= 4


def test_holds_release_oldest_unclaimed_first_and_claims_block_release():
    reg = HoldRegistry(claim_ttl_s=30)
    for i, blocks in enumerate((3, 2, 4)):
        reg.add(Hold(f"r{i}", f"h{i}", blocks))
    assert reg.claim("r0", "h0", time.time() + 100) is not None
    assert reg.claim("r0", "h0", time.time() + 100) is None  # once
    assert reg.claim("r1", "wrong", time.time() + 100) is None  # another handle
    assert reg.release_oldest(3) == ["r1", "r2"]  # r0 is claimed: kept
    assert reg.claim("r1", "h1", time.time() + 100) is None  # released: no claim
    assert reg.held_blocks() == 3 and reg.released_for_pressure == 2
    reg.done("r1")
    assert len(reg) == 2
    assert reg.placed == 3  # a count of holds placed: ending one does not lower it


def test_a_claim_never_outlives_the_hold():
    reg = HoldRegistry(claim_ttl_s=30)
    reg.add(Hold("r", "h", 1))
    end = time.time() + 5
    assert reg.claim("r", "h", end) == pytest.approx(end)


# --- which requests NIXL's worker is told to track (the lease of a hold) ---------------------
class FakeNixlScheduler:
    """The fields of upstream's NIXL scheduler that the lease announcements write."""

    def __init__(self, bidirectional: bool = True) -> None:
        self.is_bidirectional_kv_xfer_enabled = bidirectional
        self._reqs_in_batch: set[str] = set()
        self._reqs_not_processed: set[str] = set()
        self._reqs_need_send: dict[str, float] = {}

        self._reqs_need_recv: dict[str, object] = {}

    def on_new_request(self, request) -> None:
        return

    def update_state_after_alloc(self, request, blocks, num_external_tokens) -> None:
        return  # upstream announces only requests that read a peer's blocks


@dataclass
class FinishedRequest:
    request_id: str
    kv_transfer_params: dict | None
    session_id: str | None = None


def _verified(sched: FakeNixlScheduler):
    from server.connector.pd.verified_nixl import VerifiedNixlConnector

    connector = object.__new__(VerifiedNixlConnector)  # no engine: the decisions only
    connector.connector_scheduler = sched
    connector.holds = HoldRegistry(30.0)
    connector._init_tracking()
    return connector


def test_a_turn_d_will_hold_is_announced_to_the_worker():
    sched = FakeNixlScheduler()
    connector = _verified(sched)
    cases = {
        "alone": FinishedRequest("alone", {"do_remote_prefill": False}, "s1"),  # decode-only
        "no-session": FinishedRequest("no-session", {"do_remote_prefill": False}),
        "p-leg": FinishedRequest("p-leg", {"do_remote_decode": True}, "s1"),
        "no-params": FinishedRequest("no-params", None, "s1"),
    }
    for request in cases.values():
        connector.update_state_after_alloc(request, None, 0)
    assert sched._reqs_in_batch == {"alone"}
    # not bidirectional: D holds nothing, so nothing to announce
    plain = FakeNixlScheduler(bidirectional=False)
    _verified(plain).update_state_after_alloc(cases["alone"], None, 0)
    assert not plain._reqs_in_batch


def test_a_request_finishing_without_a_hold_leaves_the_worker_tracking():
    sched = FakeNixlScheduler()
    connector = _verified(sched)
    connector._forget_unheld(FinishedRequest("a", {"do_remote_prefill": False}), delay=False)
    connector._forget_unheld(FinishedRequest("b", {"do_remote_prefill": False}, "s"), delay=True)
    connector._forget_unheld(FinishedRequest("c", None), delay=False)
    assert sched._reqs_not_processed == {"a"}


def test_a_released_hold_is_announced_again_with_a_past_deadline():
    sched = FakeNixlScheduler()
    connector = _verified(sched)
    connector.holds.add(Hold("old", "mac-old", 5))
    connector.holds.add(Hold("new", "mac-new", 5))
    assert connector.release_holds(3) == 1
    assert sched._reqs_in_batch == {"old"}
    assert sched._reqs_need_send["old"] < time.perf_counter()
    assert "new" not in sched._reqs_need_send
