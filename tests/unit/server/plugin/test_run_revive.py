"""Block-run revives: a turn whose history has no hold and no home that revives it is pulled from
the member whose host store holds the longest run of its prompt's blocks (server/plugin/
run_lookup.py asks, server/plugin/revive.py answers). The holder's host store and engine, and
the asking replica's rendering and hashing, are fakes here; the index is the real embedded
backend, the peers' routes an httpx mock transport (the real thing runs in
tests/integration/test_replica_revive.py)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import secrets
from types import SimpleNamespace

import httpx
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sdk.contract import CLAIM_FIELD, HOLD_CLAIM_PATH
from server.common.cluster_auth import ROUTER_PROOF_HEADER, verify
from server.connector.control.models import RunCoverage, RunCoverageResult
from server.connector.core.block_index import HostBlockIndex
from server.connector.pd.host_coverage import run_coverage
from server.connector.pd.transfer_auth import IDENTITY_FIELD
from server.index import InstanceRecord, MemoryIndexStore, record_seal
from server.plugin.peer_pull import LOCAL_PARAMS, PeerPulls
from server.plugin.revive import Reviver
from server.plugin.revive import router as revive_router
from server.plugin.revive_rules import REVIVE_PATH, Refusal, parse_target, salt_refusal
from server.plugin.run_lookup import RunLookup, low64

BS = 16
OWNER = "a1b2c3"
TOKENS = list(range(1000, 1000 + 6 * BS + 3))
FRESH = {"remote_block_ids": [[7, 8, 9]], IDENTITY_FIELD: "id-salt", "kvbranch_mac": "fresh"}


def fake_hashes(tokens: list[int], salt: str | None) -> list[bytes]:
    """Chained and salted like vLLM's (a stand-in: the real one is vllm_compat's)."""
    out, parent = [], hashlib.sha256((salt or "").encode()).digest()
    for k in range(len(tokens) // BS):
        parent = hashlib.sha256(parent + str(tokens[k * BS : (k + 1) * BS]).encode()).digest()
        out.append(parent)
    return out


# --- the holder's check: its own host store, token ids compared ---------------------------------


def _store_of(tokens: list[int], salt: str | None, blocks: int) -> HostBlockIndex:
    index = HostBlockIndex(64)
    for k, h in enumerate(fake_hashes(tokens, salt)[:blocks]):
        index.allocate(h, tokens[k * BS : (k + 1) * BS])
    return index


def cover(index: HostBlockIndex, tokens: list[int], salt: str | None) -> dict:
    req = RunCoverage(token_ids=tokens, cache_salt=salt)
    return run_coverage(req, index, {}, fake_hashes, BS)


def test_run_coverage_counts_stored_blocks_whose_token_ids_are_the_asked_ones():
    index = _store_of(TOKENS, "salt-a", blocks=4)
    got = cover(index, TOKENS, "salt-a")
    assert got["blocks"] == 4 and len(got["hashes"]) == 6
    assert got["hashes"][0] == fake_hashes(TOKENS, "salt-a")[0].hex()
    # another salt (another tenant) hashes otherwise: nothing of it is found
    assert cover(index, TOKENS, "salt-b")["blocks"] == 0


def test_run_coverage_stops_at_a_block_whose_stored_token_ids_differ():
    """A block whose hash is stored but whose slot holds other token ids (what an edited
    request with a forged hash would name) ends the run there."""
    index = HostBlockIndex(64)
    hashes = fake_hashes(TOKENS, None)
    for k, h in enumerate(hashes[:4]):
        stored = TOKENS[k * BS : (k + 1) * BS]
        index.allocate(h, [t + 1 for t in stored] if k == 2 else stored)
    assert cover(index, TOKENS, None)["blocks"] == 2


# --- the holder's door ---------------------------------------------------------------------------


class Engine:
    """The run cover and the prefill, recording what they were asked."""

    def __init__(self, blocks: int = 6, handle=FRESH) -> None:
        self.blocks, self.handle = blocks, handle
        self.asked: list[RunCoverage] = []
        self.prefills: list[tuple[list[int], str | None, str | None]] = []
        #: The data-parallel engine each cover was asked of, and each prefill ran on.
        self.engines: list[int] = []
        self.prefill_engines: list[int] = []

    async def coverage(self, req, engine=0):  # the branch revive's: never asked here
        raise AssertionError("a block-run revive asked for a branch's cover")

    async def run_cover(self, req: RunCoverage, engine: int = 0) -> RunCoverageResult:
        self.asked.append(req)
        self.engines.append(engine)
        hashes = [h.hex() for h in fake_hashes(req.token_ids, req.cache_salt)]
        return RunCoverageResult(hashes=hashes, blocks=self.blocks, identity="id-salt")

    async def prefill(self, tokens, own, key, owner):
        self.prefills.append((list(tokens), own.cache_salt, owner))
        self.prefill_engines.append(own.engine)
        return self.handle


def holder_pulls(r: Reviver, engines: int = 1) -> PeerPulls:
    """The holder's peer pulls with ``r`` as its reviver (``engines`` data-parallel members)."""
    pulls = PeerPulls(
        MemoryIndexStore(hold_ttl_s=60),
        instance_id="holder",
        url="http://holder:8000",
        secret=SECRET,
        engines=engines,
    )
    pulls.reviver = r
    return pulls


def reviver(engine: Engine) -> Reviver:
    return Reviver(
        engine.coverage, engine.prefill, block_size=BS, min_tokens=32, run_coverage=engine.run_cover
    )


def run(r: Reviver, salt: str | None, owner: str | None = OWNER, tokens=TOKENS):
    target = parse_target({"session_id": "s1", "token_ids": tokens, "cache_salt": salt})
    assert not isinstance(target, Refusal)
    return asyncio.run(r.revive_run(("t", "s1", "main"), owner, target))


def test_a_covered_run_is_prefilled_with_the_callers_salt_and_its_handle_answered():
    engine = Engine(blocks=4)
    r = reviver(engine)
    salt = OWNER + ".0123456789abcdef"
    assert run(r, salt) == FRESH
    (ask,) = engine.asked
    assert ask.token_ids == TOKENS and ask.cache_salt == salt
    assert engine.prefills == [(TOKENS[: 4 * BS + 1], salt, OWNER)]
    assert r.counters()["outcomes"] == {"served": 1} and r.slots.running() == ()


@pytest.mark.parametrize(
    ("salt", "owner"),
    [("other-tenant", OWNER), (None, OWNER), (OWNER + "x", OWNER), ("x." + OWNER, OWNER)],
)
def test_a_salt_not_the_callers_tenants_is_refused_before_anything_is_asked(salt, owner):
    engine = Engine()
    refused = run(reviver(engine), salt, owner)
    assert isinstance(refused, Refusal) and (refused.status, refused.reason) == (403, "tenant")
    assert engine.asked == [] and engine.prefills == []


def test_without_tenants_any_salt_may_be_named():
    assert salt_refusal("whatever", None) is None and salt_refusal(None, None) is None


def test_too_little_covered_runs_nothing():
    for blocks in (0, 1):
        engine = Engine(blocks=blocks)
        refused = run(reviver(engine), OWNER)
        assert isinstance(refused, Refusal) and refused.status == 409
        assert len(engine.asked) == 1 and engine.prefills == []


def test_a_handle_of_another_identity_is_no_hold():
    engine = Engine(handle=dict(FRESH, **{IDENTITY_FIELD: "another"}))
    refused = run(reviver(engine), OWNER)
    assert isinstance(refused, Refusal) and refused.reason == "no_hold"


@pytest.mark.parametrize(
    "body",
    [
        {"session_id": "s1", "token_ids": []},
        {"session_id": "s1", "token_ids": [1, -2]},
        {"session_id": "s1", "token_ids": [1, 2**31]},
        {"session_id": "s1", "token_ids": [1, True]},
        {"session_id": "s1", "token_ids": [1.5]},
        {"session_id": "s1", "token_ids": "1 2 3"},
        {"session_id": "s1", "token_ids": [1] * 65_537},
        {"session_id": "s1", "token_ids": [1], "cache_salt": 5},
        {"session_id": "s1", "token_ids": [1], "cache_salt": "x" * 129},
        {"session_id": "s1", "cache_salt": "x"},
        {"session_id": "s1", "member": "holder-dp1"},
        {"session_id": "s1", "token_ids": [1], "member": 5},
        {"session_id": "s1", "token_ids": [1], "member": "../holder"},
        {"session_id": "s1", "token_ids": [1], "member": "x" * 4096},
    ],
)
def test_the_route_refuses_a_bad_run_with_400_before_anything_is_asked(body):
    engine = Engine()
    app = FastAPI()
    app.include_router(revive_router)
    app.state.kvbranch = SimpleNamespace(peer_pulls=holder_pulls(reviver(engine)))
    r = TestClient(app).post(REVIVE_PATH, json=body)
    assert r.status_code == 400, r.text
    assert engine.asked == [] and engine.prefills == []


def test_the_route_binds_a_run_to_the_callers_tenant(monkeypatch):
    """The salt must be the calling key's tenant's: tenant B naming tenant A's salt gets a 403
    and A's blocks are never looked up for it."""
    from server.common.env import ENV_API_KEYS
    from server.plugin.tenancy import owner_of

    monkeypatch.setenv(ENV_API_KEYS, "ka,kb")
    engine = Engine()
    app = FastAPI()
    app.include_router(revive_router)
    app.state.kvbranch = SimpleNamespace(peer_pulls=holder_pulls(reviver(engine)))
    http = TestClient(app)
    owner_a = owner_of("Bearer ka")
    assert owner_a is not None and owner_a != owner_of("Bearer kb")
    body = {"session_id": "s1", "token_ids": TOKENS, "cache_salt": owner_a}
    mine = http.post(REVIVE_PATH, json=body, headers={"authorization": "Bearer ka"})
    assert mine.status_code == 200 and mine.json() == {"handle": FRESH}
    theirs = http.post(REVIVE_PATH, json=body, headers={"authorization": "Bearer kb"})
    assert theirs.status_code == 403, theirs.text
    assert len(engine.asked) == 1 and len(engine.prefills) == 1
    assert engine.prefills[0][2] == owner_a


# --- the asking side -------------------------------------------------------------------------


SECRET = secrets.token_bytes(32)
KEY = ("tenant", "s1", "fork-1")
PEER, OTHER = "peer-a", "peer-c"
PROMPT = list(range(500, 500 + 10 * BS + 5))
SALT = "tenant-salt"
PORTS = {PEER: 5601, OTHER: 5602}


def record(iid: str, port: int, host_gen: int = 0, load: int = 0) -> InstanceRecord:
    rec = InstanceRecord(
        iid,
        f"http://{iid}:8000",
        "both",
        block_size=BS,
        nixl=f"10.0.0.7:{port}",
        host_generation=host_gen,
        load=load,
    )
    return record_seal.seal(rec, SECRET)


class Holder:
    """A member's revive and claim routes."""

    def __init__(self, revive_status: int = 200) -> None:
        self.revive_status = revive_status
        self.calls: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request)
        if request.url.path == REVIVE_PATH:
            body = json.loads(request.content)
            if "token_ids" not in body:
                return httpx.Response(404, json={"error": {"message": "no record"}})
            if self.revive_status != 200:
                return httpx.Response(self.revive_status, json={"error": {"message": "no"}})
            fresh = {
                "remote_block_ids": [[1, 2]],
                "remote_host": "10.0.0.7",
                "remote_port": PORTS[request.url.host],
                "remote_num_tokens": len(body["token_ids"]),
                "kvbranch_mac": "fresh",
            }
            return httpx.Response(200, json={"handle": fresh})
        claim = {"handle": "fresh", "until": 1e12, "until_perf": 1e9, "mac": "c"}
        return httpx.Response(200, json={CLAIM_FIELD: claim})


async def _index(home: str | None, host_runs: dict[str, int], tier: str = "host"):
    store = MemoryIndexStore(hold_ttl_s=60)
    for iid, port in PORTS.items():
        await store.heartbeat(record(iid, port), 30)
    chain = [low64(h.hex()) for h in fake_hashes(PROMPT, SALT)]
    for iid, blocks in host_runs.items():
        await store.publish_blocks(iid, 0, tier, chain[:blocks], [])  # type: ignore[arg-type]
    if home is not None:
        await store.set_home(KEY[0], KEY[1], home)
    return store


def asker(store, holder: Holder, own_blocks: int = 0) -> PeerPulls:
    client = httpx.AsyncClient(transport=httpx.MockTransport(holder))
    puller = PeerPulls(store, instance_id="me", url="http://me:8000", secret=SECRET, client=client)

    async def render(payload, path):
        return list(PROMPT)

    async def own_cover(req: RunCoverage, engine: int = 0) -> RunCoverageResult:
        hashes = [h.hex() for h in fake_hashes(req.token_ids, req.cache_salt)]
        return RunCoverageResult(hashes=hashes, blocks=own_blocks, identity="i")

    puller.runs = RunLookup(
        store, render, own_cover, instance_id="me", block_size=BS, min_tokens=32
    )
    return puller


def begin(puller: PeerPulls) -> tuple[dict, str]:
    payload: dict = {"cache_salt": SALT, "messages": []}
    turn = asyncio.run(puller.begin(payload, KEY, "Bearer k"))
    return payload["kv_transfer_params"], turn.source


def test_a_fork_with_no_record_on_its_home_pulls_the_longest_host_run_by_block_run_revive():
    store = asyncio.run(_index(home=PEER, host_runs={PEER: 7, OTHER: 3}))
    holder = Holder()
    puller = asker(store, holder)
    params, source = begin(puller)
    assert source == "revived_run" and params["kvbranch_mac"] == "fresh"
    assert params[CLAIM_FIELD]["handle"] == "fresh"
    branch_revive, run_revive, claim = holder.calls
    assert json.loads(branch_revive.content) == {"session_id": "s1", "branch_id": "fork-1"}
    assert str(run_revive.url) == f"http://{PEER}:8000{REVIVE_PATH}"
    assert json.loads(run_revive.content) == {
        "session_id": "s1",
        "branch_id": "fork-1",
        "token_ids": PROMPT[: 7 * BS + 1],
        "cache_salt": SALT,
        "member": PEER,
    }
    assert verify(
        SECRET, run_revive.headers[ROUTER_PROOF_HEADER], "POST", REVIVE_PATH, run_revive.content
    )
    assert run_revive.headers["authorization"] == "Bearer k"
    assert claim.url.path == HOLD_CLAIM_PATH
    assert puller.counts.pulls_revived_run == 1 and puller.counts.pulls_revived == 0


def test_no_home_at_all_asks_the_longest_run_directly():
    store = asyncio.run(_index(home=None, host_runs={OTHER: 5}))
    holder = Holder()
    params, source = begin(asker(store, holder))
    assert source == "revived_run"
    assert [c.url.host for c in holder.calls] == [OTHER, OTHER]


@pytest.mark.parametrize(
    ("host_runs", "own_blocks", "tier", "why"),
    [
        ({PEER: 1}, 0, "host", "a run shorter than the pull floor"),
        ({PEER: 4}, 4, "host", "this replica's own host store holds as much"),
        ({PEER: 7}, 0, "device", "device entries only: a revive loads from the host store"),
        ({"me": 7}, 0, "host", "only this replica holds the run"),
    ],
)
def test_no_block_run_revive_when(host_runs, own_blocks, tier, why):
    store = asyncio.run(_index(home=None, host_runs=host_runs, tier=tier))
    holder = Holder()
    params, source = begin(asker(store, holder, own_blocks))
    assert (params, source) == (LOCAL_PARAMS, "local"), why
    assert holder.calls == [], why


def test_a_refused_block_run_revive_recomputes():
    store = asyncio.run(_index(home=None, host_runs={PEER: 7}))
    holder = Holder(revive_status=409)
    puller = asker(store, holder)
    assert begin(puller) == (LOCAL_PARAMS, "local")
    assert [c.url.path for c in holder.calls] == [REVIVE_PATH]
    assert puller.counts.run_revives_refused == 1


def test_a_host_reset_on_the_holder_hides_its_run():
    """Entries stamped before the holder's host-store reset (its sealed record's host
    generation moved on) are not a run."""
    store = asyncio.run(_index(home=None, host_runs={PEER: 7}))
    asyncio.run(store.heartbeat(record(PEER, 5601, host_gen=1), 30))
    holder = Holder()
    assert begin(asker(store, holder)) == (LOCAL_PARAMS, "local")
    assert holder.calls == []


@pytest.mark.parametrize(
    ("own_blocks", "peer_load", "asked", "why"),
    [
        (5, 0, True, "two blocks beyond this replica's own store pay a pull"),
        (6, 0, False, "one block beyond its own store is cheaper to recompute"),
        (0, 3, False, "the member's queue costs more than 7 blocks' prefill"),
    ],
)
def test_a_block_run_revive_is_asked_only_when_its_pull_beats_recomputing(
    own_blocks, peer_load, asked, why
):
    store = asyncio.run(_index(home=None, host_runs={PEER: 7}))
    asyncio.run(store.heartbeat(record(PEER, PORTS[PEER], load=peer_load), 30))
    holder = Holder()
    puller = asker(store, holder, own_blocks)
    _, source = begin(puller)
    assert (source == "revived_run") is asked, why
    assert bool(holder.calls) is asked, why
    assert puller.counters()["pull_cost"]["decisions"]["run"] == {
        "pull": int(asked),
        "recompute": int(not asked),
        "explore": 0,
    }, why


def test_a_run_revive_loads_from_the_engine_its_member_names():
    """A data-parallel holder is one member per engine: the run the index listed under its
    engine 1's member is covered and prefilled on engine 1; a member id that is none of its
    engines is a 404 before anything is asked."""
    engine = Engine()
    app = FastAPI()
    app.include_router(revive_router)
    app.state.kvbranch = SimpleNamespace(peer_pulls=holder_pulls(reviver(engine), engines=2))
    http = TestClient(app)
    body = {"session_id": "s1", "token_ids": TOKENS, "cache_salt": None, "member": "holder-dp1"}
    r = http.post(REVIVE_PATH, json=body)
    assert r.status_code == 200, r.text
    assert (engine.engines, engine.prefill_engines) == ([1], [1])
    for member in ("holder", "holder-dp2", "other-dp1"):
        r = http.post(REVIVE_PATH, json=dict(body, member=member))
        assert r.status_code == 404, (member, r.text)
    assert engine.engines == [1]
