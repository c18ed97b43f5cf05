"""The instance record's seal (server/index/record_seal.py), as pure logic: what verifies and
what does not. The same check against records written straight into a real Redis, read by the
router's pool, is test_record_forgery.py."""

from __future__ import annotations

import dataclasses

import pytest

from server.common import cluster_auth
from server.index import InstanceRecord, record_seal
from server.index.redis_store import _record

SECRET = b"s" * 32
NOW = 1_800_000_000.0


def record(**kw: object) -> InstanceRecord:
    base = InstanceRecord(
        instance_id="iid-1",
        url="http://10.0.0.5:8000",
        role="prefill",
        model="m",
        block_size=16,
        nixl="10.0.0.5:18000",
        generation=3,
        load=2,
        kv_usage=0.25,
        engines=1,
        started_at=1_700_000_000.125,
    )
    return dataclasses.replace(base, **kw)  # type: ignore[arg-type]


def test_a_sealed_record_verifies_and_an_unsealed_one_does_not() -> None:
    sealed = record_seal.seal(record(), SECRET, now=NOW)
    assert sealed.mac and record_seal.verify(sealed, SECRET, now=NOW)
    assert not record_seal.verify(record(), SECRET, now=NOW)  # no seal at all


@pytest.mark.parametrize(
    "change",
    [
        {"url": "http://attacker.example:8000"},
        {"role": "decode"},
        {"instance_id": "iid-2"},  # a real record copied under another identity
        {"generation": 4},
        {"host_generation": 5},
        {"model": "other"},
        {"block_size": 32},
        {"nixl": "10.6.6.6:18000"},
        {"load": 0},
        {"kv_usage": 0.5},
        {"engines": 2},
        {"started_at": 1.0},
    ],
)
def test_any_edited_field_fails(change: dict[str, object]) -> None:
    sealed = record_seal.seal(record(), SECRET, now=NOW)
    assert not record_seal.verify(dataclasses.replace(sealed, **change), SECRET, now=NOW)  # type: ignore[arg-type]


def test_another_secret_or_an_old_seal_fails() -> None:
    sealed = record_seal.seal(record(), SECRET, now=NOW)
    assert not record_seal.verify(sealed, b"another secret", now=NOW)
    late = NOW + cluster_auth.MAX_SKEW_S + 1
    assert not record_seal.verify(sealed, SECRET, now=late)  # a replay of a record long gone


def test_a_router_proof_is_no_record_seal_and_the_other_way_round() -> None:
    """The record key is derived from the cluster secret for this one use: a proof an attacker
    saw on the wire never seals a record, and a seal read from Redis never signs a request."""
    rec = record()
    body = record_seal._body(rec)
    proof = cluster_auth.sign(SECRET, record_seal._METHOD, record_seal._PATH, body, now=NOW)
    assert not record_seal.verify(dataclasses.replace(rec, mac=proof), SECRET, now=NOW)
    sealed = record_seal.seal(rec, SECRET, now=NOW)
    assert not cluster_auth.verify(
        SECRET, sealed.mac, record_seal._METHOD, record_seal._PATH, body, now=NOW
    )


@pytest.mark.parametrize(
    "mac", ["", "x" * 10_000, "123.abc", "é.é", "9" * 40 + ".00", None, 12, ["a"]]
)
def test_junk_seals_are_false_never_an_exception(mac: object) -> None:
    assert not record_seal.verify(dataclasses.replace(record(), mac=mac), SECRET, now=NOW)  # type: ignore[arg-type]


def test_junk_fields_are_false_never_an_exception() -> None:
    sealed = record_seal.seal(record(), SECRET, now=NOW)
    for change in ({"block_size": "x"}, {"kv_usage": "nan?"}, {"url": None}, {"load": 10**400}):
        assert not record_seal.verify(dataclasses.replace(sealed, **change), SECRET, now=NOW)  # type: ignore[arg-type]


def test_the_seal_survives_the_redis_backends_strings() -> None:
    """What the heartbeat script stores and ``members()`` parses back verifies unchanged."""
    sealed = record_seal.seal(
        record(kv_usage=0.1 + 0.2, started_at=1_700_000_000.1, host_generation=7), SECRET
    )
    fields = {
        b"url": sealed.url.encode(),
        b"role": sealed.role.encode(),
        b"model": sealed.model.encode(),
        b"block_size": str(sealed.block_size).encode(),
        b"nixl": sealed.nixl.encode(),
        b"generation": str(sealed.generation).encode(),
        b"host_generation": str(sealed.host_generation).encode(),
        b"load": str(sealed.load).encode(),
        b"kv_usage": repr(sealed.kv_usage).encode(),
        b"engines": str(sealed.engines).encode(),
        b"started_at": repr(sealed.started_at).encode(),
        b"mac": sealed.mac.encode(),
    }
    back = _record(sealed.instance_id, fields)
    assert back == sealed and record_seal.verify(back, SECRET)
