"""The host store's cover of a turn's prefix, asked before a revive runs anything
(server/connector/pd/host_coverage.py): leading stored blocks only, and the identity a revive
request would have on this engine."""

from __future__ import annotations

from types import SimpleNamespace

from server.connector.control.models import HostCoverage
from server.connector.pd.host_coverage import host_coverage, leading_stored, revive_identity
from server.connector.pd.transfer_params import identity_of

COMPAT = {"model": "m", "dtype": "bfloat16", "kv_dtype": "auto", "block_size": 16}
STORED = {bytes([i]) * 32 for i in (1, 2, 3, 5)}


def hx(i: int) -> str:
    return (bytes([i]) * 32).hex()


def test_the_cover_ends_at_the_first_block_the_store_lacks():
    assert leading_stored([hx(1), hx(2), hx(3)], STORED.__contains__) == 3
    assert leading_stored([hx(1), hx(2), hx(4), hx(5)], STORED.__contains__) == 2
    assert leading_stored([hx(4), hx(1)], STORED.__contains__) == 0
    assert leading_stored([hx(1), "not hex", hx(2)], STORED.__contains__) == 1
    assert leading_stored([], STORED.__contains__) == 0


def test_a_revive_has_the_identity_of_a_plain_request_with_the_turns_salt():
    plain = SimpleNamespace(cache_salt="tenant-a", lora_request=None, mm_features=None)
    assert revive_identity("tenant-a", COMPAT) == identity_of(plain, COMPAT)
    assert revive_identity("tenant-b", COMPAT) != identity_of(plain, COMPAT)
    adapter = SimpleNamespace(
        cache_salt="tenant-a", lora_request=SimpleNamespace(lora_name="x"), mm_features=None
    )
    assert revive_identity("tenant-a", COMPAT) != identity_of(adapter, COMPAT)
    assert revive_identity("tenant-a", dict(COMPAT, block_size=32)) != identity_of(plain, COMPAT)


def test_the_op_answers_from_the_index_alone():
    plain = SimpleNamespace(cache_salt=None, lora_request=None, mm_features=None)
    ask = HostCoverage(hashes=[hx(1), hx(2), hx(9)], identity=identity_of(plain, COMPAT))
    assert host_coverage(ask, STORED, COMPAT) == {"blocks": 2, "identity_ok": True}
    other = HostCoverage(hashes=[hx(1)], identity="x", cache_salt="s")
    assert host_coverage(other, STORED, COMPAT) == {"blocks": 1, "identity_ok": False}
