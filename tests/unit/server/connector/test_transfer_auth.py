"""The seal and claim checks run inside vLLM's scheduler (an exception there kills the engine
core), on values a client chose: they answer False, whatever the input, never raise."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st

from server.connector.pd.transfer_auth import (
    CLAIM_FIELD,
    EXPIRES_FIELD,
    MAC_FIELD,
    claim_valid,
    expired,
    is_sealed,
    make_claim,
    seal,
)

SECRET = b"s" * 32

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


def _sealed() -> dict:
    handle = seal({"remote_request_id": "r", EXPIRES_FIELD: time.time() + 60}, SECRET)
    handle[CLAIM_FIELD] = make_claim(handle, time.time() + 30, SECRET)
    return handle


def test_non_ascii_and_odd_macs_are_not_sealed():
    # hmac.compare_digest raises TypeError on a non-ASCII str: issue 22's engine-core crash
    handle = _sealed()
    for mac in ("é" * 64, "\ud800" * 64, "ä", "0" * 10_000, "", "Ω" + handle[MAC_FIELD][1:]):
        assert is_sealed(dict(handle, **{MAC_FIELD: mac}), SECRET) is False
        claim = dict(handle[CLAIM_FIELD], mac=mac)
        assert claim_valid(dict(handle, **{CLAIM_FIELD: claim}), SECRET, 6) is False
    assert is_sealed(handle, SECRET) and claim_valid(handle, SECRET, 6)


def test_huge_circular_and_deep_values_are_not_sealed():
    handle = _sealed()
    circular: list = []
    circular.append(circular)
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    for value in (10**5000, circular, deep, {1, 2}, object()):
        assert is_sealed(dict(handle, remote_block_ids=value), SECRET) is False
        claim = dict(handle[CLAIM_FIELD], until_perf=value)
        assert claim_valid(dict(handle, **{CLAIM_FIELD: claim}), SECRET, 6) is False
    for until in (10**5000, float("nan"), float("inf"), -(10**400), True, "1e9"):
        claim = dict(handle[CLAIM_FIELD], until=until)
        assert claim_valid(dict(handle, **{CLAIM_FIELD: claim}), SECRET, 6) is False


def test_non_dict_params_and_claims_are_invalid():
    for params in (None, [], "x", 5, {CLAIM_FIELD: "c"}, {CLAIM_FIELD: [1]}):
        assert claim_valid(params, SECRET, 6) is False  # type: ignore[arg-type]
        assert is_sealed(params, SECRET) is False
    assert expired(None) and expired({EXPIRES_FIELD: float("nan")})  # type: ignore[arg-type]


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.text(max_size=30), json_values, max_size=8), json_values)
def test_the_checks_never_raise(params, claim):
    params[MAC_FIELD] = params.get("m", claim)
    assert is_sealed(params, SECRET) is False
    params[CLAIM_FIELD] = claim if not isinstance(claim, dict) else dict(claim, mac=claim)
    assert claim_valid(params, SECRET, 6) is False
    expired(params)
