"""The router's proof: only the holder of the cluster secret makes one, for exactly one request,
and checking one never raises (whatever a client puts in the header)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from server.common.cluster_auth import MAX_SKEW_S, sign, verify

SECRET = b"s" * 32
BODY = b'{"kv_transfer_params": {"do_remote_decode": true}}'


def test_a_proof_verifies_for_its_own_request_only():
    proof = sign(SECRET, "POST", "/v1/chat/completions", BODY)
    assert verify(SECRET, proof, "POST", "/v1/chat/completions", BODY)
    assert not verify(b"t" * 32, proof, "POST", "/v1/chat/completions", BODY)  # other secret
    assert not verify(SECRET, proof, "POST", "/v1/completions", BODY)  # other path
    assert not verify(SECRET, proof, "POST", "/v1/chat/completions", BODY + b" ")  # other body


def test_a_stale_or_future_proof_is_refused():
    old = sign(SECRET, "POST", "/p", BODY, now=1000.0)
    assert verify(SECRET, old, "POST", "/p", BODY, now=1000.0 + MAX_SKEW_S - 1)
    assert not verify(SECRET, old, "POST", "/p", BODY, now=1000.0 + MAX_SKEW_S + 1)
    assert not verify(SECRET, old, "POST", "/p", BODY, now=1000.0 - MAX_SKEW_S - 1)


@given(st.one_of(st.none(), st.text(max_size=300), st.integers()))
def test_any_header_value_is_checked_without_raising(value):
    assert verify(SECRET, value, "POST", "/p", BODY) in (False, True)


def test_non_ascii_and_malformed_proofs_are_refused():
    for value in ("", ".", "1.", "x.ab", "1." + "é" * 64, "9" * 40 + ".ab", "1.2.3"):
        assert not verify(SECRET, value, "POST", "/p", BODY)
