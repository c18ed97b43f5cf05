"""The holder's side of a revive (server/plugin/revive.py), with the host store's answer and the
engine's prefill as fakes (pure logic: the real ones run in
tests/integration/test_replica_revive.py): every refusal comes before any engine work, and a
served revive prefills the covered prefix plus one token and answers the fresh handle."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from fastapi import FastAPI
from fastapi.testclient import TestClient

from server.common.tenants import scope_of
from server.connector.control.models import HostCoverage, HostCoverageResult
from server.connector.pd.transfer_auth import HASHES_FIELD, IDENTITY_FIELD, TOKENS_FIELD
from server.plugin.own_turns import ReviveSlots
from server.plugin.revive import Reviver
from server.plugin.revive import router as revive_router
from server.plugin.revive_rules import REVIVE_PATH, Refusal

BS = 16
KEY = ("tenant", "s1", "main")
TOKENS = list(range(1000, 1000 + 6 * BS + 3))
FRESH = {"remote_block_ids": [[7, 8, 9]], IDENTITY_FIELD: "id", "kvbranch_mac": "fresh"}


class Engine:
    """The host store's cover and the prefill, recording what they were asked."""

    def __init__(self, blocks: int = 6, identity_ok: bool = True, handle=FRESH) -> None:
        self.blocks, self.identity_ok, self.handle = blocks, identity_ok, handle
        self.asked: list[HostCoverage] = []
        self.prefills: list[tuple[list[int], str | None]] = []

    async def coverage(self, req: HostCoverage, engine: int = 0) -> HostCoverageResult:
        self.asked.append(req)
        return HostCoverageResult(blocks=self.blocks, identity_ok=self.identity_ok)

    async def prefill(self, tokens, own, key, owner):
        self.prefills.append((list(tokens), owner))
        return self.handle


def reviver(engine: Engine, **kw) -> Reviver:
    r = Reviver(engine.coverage, engine.prefill, block_size=BS, min_tokens=32, **kw)
    params = {TOKENS_FIELD: TOKENS, HASHES_FIELD: [f"{i:064x}" for i in range(6)]}
    r.remember(KEY, 3, "salt-a", dict(params, **{IDENTITY_FIELD: "id"}))
    return r


def revive(r: Reviver, key=KEY):
    return asyncio.run(r.revive(key, "owner-a"))


def test_a_covered_branch_is_prefilled_from_the_store_and_its_fresh_handle_answered():
    engine = Engine(blocks=4)
    r = reviver(engine)
    assert revive(r) == FRESH
    (ask,) = engine.asked
    assert ask.identity == "id" and ask.cache_salt == "salt-a" and len(ask.hashes) == 6
    assert engine.prefills == [(TOKENS[: 4 * BS + 1], "owner-a")]
    assert r.counters()["outcomes"] == {"served": 1}
    assert r.counters()["revived_tokens"] == 4 * BS


def test_another_tenants_key_or_an_unknown_branch_finds_nothing_and_asks_nothing():
    engine = Engine()
    r = reviver(engine)
    for key in [("other-tenant", "s1", "main"), ("tenant", "s2", "main"), ("tenant", "s1", "b")]:
        refused = revive(r, key)
        assert isinstance(refused, Refusal) and refused.status == 404
    assert engine.asked == [] and engine.prefills == []


def test_too_little_in_the_store_or_another_identity_runs_nothing():
    for engine in (Engine(blocks=1), Engine(blocks=0), Engine(identity_ok=False)):
        refused = revive(reviver(engine))
        assert isinstance(refused, Refusal) and refused.status == 409
        assert len(engine.asked) == 1 and engine.prefills == []


def test_a_branch_being_revived_is_not_revived_twice_at_once():
    slots = ReviveSlots()
    slots.take(KEY)
    engine = Engine()
    refused = revive(reviver(engine, slots=slots))
    assert isinstance(refused, Refusal) and (refused.status, refused.reason) == (429, "busy_branch")
    assert engine.asked == [] and engine.prefills == []


def test_the_slot_is_given_back_whatever_happened():
    engine = Engine(handle={"remote_block_ids": []})
    r = reviver(engine)
    refused = revive(r)
    assert isinstance(refused, Refusal) and refused.status == 503  # no hold: nothing to pull
    assert r.slots.running() == ()
    engine.handle = dict(FRESH, **{IDENTITY_FIELD: "another"})
    assert isinstance(revive(r), Refusal) and r.slots.running() == ()
    engine.handle = FRESH
    assert revive(r) == FRESH


def test_a_failing_host_store_or_engine_is_a_503_never_an_exception():
    class Broken(Engine):
        async def coverage(self, req, engine=0):
            raise RuntimeError("control socket gone")

    refused = revive(reviver(Broken()))
    assert isinstance(refused, Refusal) and refused.status == 503

    class Failing(Engine):
        async def prefill(self, tokens, own, key, owner):
            raise RuntimeError("engine dead")

    r = reviver(Failing())
    refused = revive(r)
    assert isinstance(refused, Refusal) and refused.reason == "failed"
    assert r.slots.running() == ()


# --- the route: its body, its tenant, and an instance that is no replica ----------------------


def _route_client(reviver_or_none) -> TestClient:
    app = FastAPI()
    app.include_router(revive_router)
    app.state.kvbranch = SimpleNamespace(peer_pulls=SimpleNamespace(reviver=reviver_or_none))
    return TestClient(app)


def test_the_route_keys_the_branch_by_the_callers_tenant_and_answers_the_handle():
    engine = Engine()
    r = reviver(engine)
    params = {TOKENS_FIELD: TOKENS, HASHES_FIELD: ["00" * 32] * 6, IDENTITY_FIELD: "id"}
    r.remember((scope_of("Bearer ka"), "s1", "main"), 1, "salt-a", params)
    http = _route_client(r)
    ok = http.post(REVIVE_PATH, json={"session_id": "s1"}, headers={"authorization": "Bearer ka"})
    assert ok.status_code == 200 and ok.json() == {"handle": FRESH}
    other = http.post(
        REVIVE_PATH, json={"session_id": "s1"}, headers={"authorization": "Bearer kb"}
    )
    assert other.status_code == 404 and len(engine.prefills) == 1


def test_the_route_refuses_a_bad_body_and_answers_404_where_no_replica_revives():
    engine = Engine()
    http = _route_client(reviver(engine))
    for body in ({"session_id": "../x"}, {"session_id": "s1", "tokens": [1]}, [1]):
        assert http.post(REVIVE_PATH, json=body).status_code == 400
    assert engine.asked == []
    gone = _route_client(None).post(REVIVE_PATH, json={"session_id": "s1"})
    assert gone.status_code == 404 and "aggregated replica" in gone.json()["error"]["message"]
