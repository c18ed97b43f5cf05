"""An aggregated replica's session turn (server/plugin/peer_pull.py): which hold it claims, on
whom, and what its request carries. The index is the real embedded backend; the peer's claim
route is an httpx mock transport (pure logic: the real claim runs in
tests/integration/test_replicas.py)."""

from __future__ import annotations

import asyncio
import json
import secrets

import httpx
import pytest

from sdk.contract import CLAIM_FIELD, HOLD_CLAIM_PATH
from server.common.cluster_auth import ROUTER_PROOF_HEADER, verify
from server.index import Hold, InstanceRecord, MemoryIndexStore, record_seal
from server.plugin.peer_pull import LOCAL_PARAMS, PeerPulls, PeerTurn
from server.plugin.pull_cost import PullCostModel
from server.plugin.revive_rules import REVIVE_PATH

SECRET = secrets.token_bytes(32)
KEY = ("tenant", "s1", "main")
PEER = "peer-instance"
CHANNEL = ("10.0.0.7", 5601)


def handle(tokens: int = 600, host: str = CHANNEL[0], port: int = CHANNEL[1]) -> dict:
    return {
        "do_remote_decode": True,
        "remote_block_ids": [[3, 4, 5, 6, 7]],
        "remote_host": host,
        "remote_port": port,
        "remote_num_tokens": tokens,
        "kvbranch_mac": "m",
    }


def peer_record(nixl: str = f"{CHANNEL[0]}:{CHANNEL[1]}", secret: bytes = SECRET, load: int = 0):
    record = InstanceRecord(PEER, "http://10.0.0.7:8000", "both", nixl=nixl, load=load)
    return record_seal.seal(record, secret)


class Peer:
    """The peer's claim route: answers ``status`` and records what it was sent."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.calls: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "gone"}})
        claim = {"handle": "m", "until": 1e12, "until_perf": 1e9, "mac": "c"}
        return httpx.Response(200, json={CLAIM_FIELD: claim})


def pulls(store, peer: Peer) -> PeerPulls:
    client = httpx.AsyncClient(transport=httpx.MockTransport(peer))
    return PeerPulls(store, instance_id="me", url="http://me:8000", secret=SECRET, client=client)


async def _store(*records: InstanceRecord, hold: Hold | None = None) -> MemoryIndexStore:
    store = MemoryIndexStore(hold_ttl_s=60)
    for record in records:
        await store.heartbeat(record, 30)
    if hold is not None:
        assert await store.put_hold(KEY, hold)
    return store


def begin(store, peer: Peer, authorization: str | None = "Bearer k") -> tuple[dict, str]:
    payload: dict = {}
    turn = asyncio.run(pulls(store, peer).begin(payload, KEY, authorization))
    return payload["kv_transfer_params"], turn.source


def test_a_branch_another_replica_holds_is_claimed_there_and_pulled():
    store = asyncio.run(_store(peer_record(), hold=Hold("u", PEER, handle())))
    peer = Peer()
    params, source = begin(store, peer)
    assert source == "peer"
    assert params["do_remote_decode"] is True and params["do_remote_prefill"] is False
    assert params[CLAIM_FIELD]["mac"] == "c"
    assert params["remote_block_ids"] == [[3, 4, 5, 6, 7]]
    (call,) = peer.calls
    assert str(call.url) == "http://10.0.0.7:8000" + HOLD_CLAIM_PATH
    assert json.loads(call.content)["handle"]["remote_num_tokens"] == 600
    assert verify(SECRET, call.headers[ROUTER_PROOF_HEADER], "POST", HOLD_CLAIM_PATH, call.content)
    assert call.headers["authorization"] == "Bearer k"


def test_a_claimed_turn_carries_the_held_tokens_its_priority_counts_as_cached():
    store = asyncio.run(_store(peer_record(), hold=Hold("u", PEER, handle(tokens=600))))
    turn = asyncio.run(pulls(store, Peer()).begin({}, KEY, "Bearer k"))
    assert (turn.source, turn.held_tokens) == ("peer", 600)
    refused = asyncio.run(_store(peer_record(), hold=Hold("u", PEER, handle(tokens=600))))
    turn = asyncio.run(pulls(refused, Peer(status=410)).begin({}, KEY, "Bearer k"))
    assert turn.held_tokens == 0  # nothing pulled: the whole prompt is work here


def test_the_hold_is_taken_once_a_second_turn_finds_none():
    store = asyncio.run(_store(peer_record(), hold=Hold("u", PEER, handle())))
    begin(store, Peer())
    params, source = begin(store, Peer())
    assert (params, source) == (LOCAL_PARAMS, "local")


@pytest.mark.parametrize(
    ("records", "hold", "why"),
    [
        ([peer_record()], Hold("u", "me", handle()), "its own hold: its own caches have it"),
        ([], Hold("u", PEER, handle()), "the holder is not a live member"),
        ([peer_record(secret=b"x" * 32)], Hold("u", PEER, handle()), "the record's seal fails"),
        ([peer_record()], Hold("u", PEER, handle(host="10.9.9.9")), "another NIXL channel"),
        ([peer_record()], Hold("u", PEER, handle(tokens=16)), "too few tokens to pay a claim"),
    ],
)
def test_no_claim_and_no_peer_named_when(records, hold, why):
    store = asyncio.run(_store(*records, hold=hold))
    peer = Peer()
    params, source = begin(store, peer)
    assert (params, source) == (LOCAL_PARAMS, "local"), why
    assert peer.calls == [], why


def test_a_refused_claim_recomputes():
    store = asyncio.run(_store(peer_record(), hold=Hold("u", PEER, handle())))
    peer = Peer(status=410)
    puller = pulls(store, peer)
    payload: dict = {}
    turn = asyncio.run(puller.begin(payload, KEY, None))
    assert payload["kv_transfer_params"] == LOCAL_PARAMS and turn.source == "local"
    assert puller.counts.claims_refused == 1
    assert "authorization" not in peer.calls[0].headers


class DownIndex:
    async def begin_turn(self, key):
        raise ConnectionError("index down")

    async def put_hold(self, key, hold):
        raise ConnectionError("index down")


def test_an_unreachable_index_costs_the_pull_never_the_turn():
    puller = pulls(DownIndex(), Peer())
    payload: dict = {}
    turn = asyncio.run(puller.begin(payload, KEY, None))
    assert payload["kv_transfer_params"] == LOCAL_PARAMS
    asyncio.run(puller.file(turn, handle()))
    assert puller.counts.index_errors == {"begin_turn": 1, "put_hold": 1}


def test_a_finished_turn_files_this_replicas_hold_for_the_next_turn():
    store = asyncio.run(_store())
    puller = pulls(store, Peer())

    async def turn_and_file():
        turn = await puller.begin({}, KEY, None)
        await puller.file(turn, handle())
        await puller.file(turn, {"do_remote_decode": True})  # no blocks: nothing to file
        return await store.peek_hold(KEY), await store.session_instances("tenant", "s1")

    hold, placed = asyncio.run(turn_and_file())
    assert hold is not None and hold.instance_id == "me" and hold.decode_url == "http://me:8000"
    assert hold.params["remote_block_ids"] == [[3, 4, 5, 6, 7]]
    assert placed == {"me"}
    assert puller.counts.holds_filed == 1


# --- revives: the index offers no hold, or the holder let its blocks go -----------------------


class Holder(Peer):
    """The peer's claim and revive routes: a revive answers ``revive_status`` and a fresh
    handle; a claim of the old handle answers ``claim_status``."""

    def __init__(self, revive_status: int = 200, claim_status: int = 200, fresh=None) -> None:
        super().__init__()
        self.revive_status, self.claim_status = revive_status, claim_status
        self.fresh = fresh or dict(handle(tokens=512), kvbranch_mac="fresh")

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls.append(request)
        if request.url.path == REVIVE_PATH:
            if self.revive_status != 200:
                return httpx.Response(self.revive_status, json={"error": {"message": "no"}})
            return httpx.Response(200, json={"handle": self.fresh})
        claimed = json.loads(request.content)["handle"]
        if claimed["kvbranch_mac"] != "fresh" and self.claim_status != 200:
            return httpx.Response(self.claim_status, json={"error": {"message": "gone"}})
        claim = {"handle": claimed["kvbranch_mac"], "until": 1e12, "until_perf": 1e9, "mac": "c"}
        return httpx.Response(200, json={CLAIM_FIELD: claim})


async def _homed(home: str, *records: InstanceRecord, hold: Hold | None = None):
    store = await _store(*records, hold=hold)
    await store.set_home(KEY[0], KEY[1], home)
    return store


def paths(peer: Peer) -> list[str]:
    return [c.url.path for c in peer.calls]


def test_no_hold_but_a_home_elsewhere_revives_the_branch_there_claims_and_pulls():
    store = asyncio.run(_homed(PEER, peer_record()))
    holder = Holder()
    puller = pulls(store, holder)
    payload: dict = {}
    turn = asyncio.run(puller.begin(payload, KEY, "Bearer k"))
    assert turn.source == "revived"
    params = payload["kv_transfer_params"]
    assert params["kvbranch_mac"] == "fresh" and params[CLAIM_FIELD]["handle"] == "fresh"
    assert params["do_remote_decode"] is True
    revive_call, claim_call = holder.calls
    assert paths(holder) == [REVIVE_PATH, HOLD_CLAIM_PATH]
    assert str(revive_call.url) == "http://10.0.0.7:8000" + REVIVE_PATH
    assert json.loads(revive_call.content) == {"session_id": "s1", "branch_id": "main"}
    proof = revive_call.headers[ROUTER_PROOF_HEADER]
    assert verify(SECRET, proof, "POST", REVIVE_PATH, revive_call.content)
    assert revive_call.headers["authorization"] == "Bearer k"
    assert puller.counts.pulls_revived == 1 and puller.counts.revives_asked == 1


@pytest.mark.parametrize(
    ("home", "records", "holder", "why"),
    [
        ("me", [peer_record()], Holder(), "this replica is the home: its own store has it"),
        (PEER, [], Holder(), "the home is not a live member"),
        (PEER, [peer_record(secret=b"x" * 32)], Holder(), "the home's record seal fails"),
        (PEER, [peer_record()], Holder(revive_status=409), "the holder refused"),
        (
            PEER,
            [peer_record()],
            Holder(fresh=dict(handle(host="10.9.9.9"), kvbranch_mac="fresh")),
            "the fresh handle names another NIXL channel than the sealed record",
        ),
    ],
)
def test_no_revived_pull_when(home, records, holder, why):
    store = asyncio.run(_homed(home, *records))
    payload: dict = {}
    turn = asyncio.run(pulls(store, holder).begin(payload, KEY, None))
    assert (payload["kv_transfer_params"], turn.source) == (LOCAL_PARAMS, "local"), why
    assert HOLD_CLAIM_PATH not in paths(holder), why


def test_a_hold_whose_blocks_went_to_new_work_is_revived_from_its_holders_store():
    store = asyncio.run(_store(peer_record(), hold=Hold("u", PEER, handle())))
    holder = Holder(claim_status=410)
    payload: dict = {}
    turn = asyncio.run(pulls(store, holder).begin(payload, KEY, None))
    assert turn.source == "revived" and payload["kv_transfer_params"]["kvbranch_mac"] == "fresh"
    assert paths(holder) == [HOLD_CLAIM_PATH, REVIVE_PATH, HOLD_CLAIM_PATH]


def test_a_claim_refused_for_another_reason_is_not_revived():
    store = asyncio.run(_store(peer_record(), hold=Hold("u", PEER, handle())))
    holder = Holder(claim_status=400)  # a handle the holder did not seal: tampered
    payload: dict = {}
    turn = asyncio.run(pulls(store, holder).begin(payload, KEY, None))
    assert turn.source == "local" and paths(holder) == [HOLD_CLAIM_PATH]


def test_a_filed_turn_makes_this_replica_the_sessions_home_and_is_kept_for_revives():
    store = asyncio.run(_store())
    puller = pulls(store, Peer())
    kept = []

    class Keeper:
        def remember(self, key, turn, salt, params, engine=0):
            kept.append((key, turn, salt))

    puller.reviver = Keeper()  # type: ignore[assignment]

    async def turn_and_file():
        turn = await puller.begin({"cache_salt": "salt-a"}, KEY, None)
        await puller.file(turn, handle())
        return await store.peek_home(KEY[0], KEY[1])

    assert asyncio.run(turn_and_file()) == "me"
    assert kept == [(KEY, 1, "salt-a")]


def test_each_data_parallel_engine_is_its_own_member():
    """A replica with two engines: a turn on engine 1 files its hold and the session's home
    as engine 1's member; engine 1's own hold is its own caches' (no claim), while a hold of
    its engine 0 is a peer's like any other, claimed on the side channel that engine names."""
    store = asyncio.run(_store())
    peer = Peer()
    client = httpx.AsyncClient(transport=httpx.MockTransport(peer))
    puller = PeerPulls(
        store, instance_id="me", url="http://me:8000", secret=SECRET, client=client, engines=2
    )

    async def turn_and_file():
        turn = await puller.begin({}, KEY, None, engine=1)
        await puller.file(turn, handle())
        return turn, await store.peek_home(KEY[0], KEY[1])

    turn, home = asyncio.run(turn_and_file())
    assert (puller.member_of(turn.engine), home) == ("me-dp1", "me-dp1")
    again = asyncio.run(puller.begin({}, KEY, None, engine=1))
    assert again.source == "local" and puller.counts.own_holds == 1 and peer.calls == []

    sibling = record_seal.seal(
        InstanceRecord("me-dp0", "http://me:8000", "both", nixl="127.0.0.1:18000", engines=2),
        SECRET,
    )
    store = asyncio.run(
        _store(sibling, hold=Hold("http://me:8000", "me-dp0", handle(host="127.0.0.1", port=18000)))
    )
    puller.store, puller._members = store, (float("-inf"), [])
    pulled = asyncio.run(puller.begin({}, KEY, None, engine=1))
    assert pulled.source == "peer" and len(peer.calls) == 1


# --- pull or recompute: the cost model's inputs, as the wiring feeds them ---------------------


def test_a_measured_fast_prefill_recomputes_a_held_branch_without_claiming_it():
    store = asyncio.run(_store(peer_record(), hold=Hold("u", PEER, handle(tokens=600))))
    peer = Peer()
    puller = pulls(store, peer)
    puller.cost.prefill.value = 1e6  # 600 tokens in 0.6 ms: less than the claim alone
    payload: dict = {}
    turn = asyncio.run(puller.begin(payload, KEY, None))
    assert (payload["kv_transfer_params"], turn.source) == (LOCAL_PARAMS, "local")
    assert peer.calls == []
    assert puller.counts.too_small == 1
    assert puller.counters()["pull_cost"]["decisions"]["hold"] == {
        "pull": 0,
        "recompute": 1,
        "explore": 0,
    }


def test_a_busy_holder_is_claimed_but_not_asked_to_revive():
    """The claim's reads cost the peer little; a revive's prefill waits in its queue."""
    busy = peer_record(load=5)
    store = asyncio.run(_store(busy, hold=Hold("u", PEER, handle(tokens=600))))
    holder = Holder(claim_status=410)
    puller = pulls(store, holder)
    payload: dict = {}
    turn = asyncio.run(puller.begin(payload, KEY, None))
    assert (payload["kv_transfer_params"], turn.source) == (LOCAL_PARAMS, "local")
    assert paths(holder) == [HOLD_CLAIM_PATH]
    decisions = puller.counters()["pull_cost"]["decisions"]
    assert decisions["hold"]["pull"] == 1 and decisions["revive"]["recompute"] == 1


def _expired_hold_homed_on_peer(load: int) -> MemoryIndexStore:
    """The branch's last hold (20 blocks of 16 tokens) was taken, its home is the peer."""

    async def build() -> MemoryIndexStore:
        params = dict(handle(tokens=320), kvbranch_block_hashes=[f"{i:064x}" for i in range(20)])
        store = await _homed(PEER, peer_record(load=load), hold=Hold("u", PEER, params))
        await store.begin_turn(KEY)  # the turn that took it
        return store

    return asyncio.run(build())


@pytest.mark.parametrize(("load", "asked"), [(0, True), (5, False)])
def test_a_home_revive_is_asked_when_the_branchs_last_chain_pays_the_homes_queue(load, asked):
    holder = Holder()
    puller = pulls(_expired_hold_homed_on_peer(load), holder)
    puller.block_size = 16
    payload: dict = {}
    turn = asyncio.run(puller.begin(payload, KEY, None))
    assert (REVIVE_PATH in paths(holder)) is asked
    assert turn.source == ("revived" if asked else "local")
    assert puller.counters()["pull_cost"]["decisions"]["revive"] == {
        "pull": int(asked),
        "recompute": int(not asked),
        "explore": 0,
    }


def _finished(source: str, split: dict | None, ttft_s: float | None) -> PeerTurn:
    turn = PeerTurn(KEY, 1, source=source, started_at=100.0)
    turn.first_token_at = None if ttft_s is None else 100.0 + ttft_s
    return turn


SPLIT = {"remote_hit_tokens": 0, "recomputed_tokens": 1000}


@pytest.mark.parametrize(
    ("source", "split", "ttft_s", "measured"),
    [
        ("local", SPLIT, 0.5, "prefill"),
        ("peer", dict(SPLIT, remote_hit_tokens=900, recomputed_tokens=10), 0.2, "hold"),
        ("revived", dict(SPLIT, remote_hit_tokens=900), 2.0, "revive"),
        ("revived_run", dict(SPLIT, remote_hit_tokens=900), 2.0, "revive"),
        ("local", SPLIT, None, None),  # a JSON answer: no time to first token
        ("peer", SPLIT, 0.5, None),  # the pull was declined: neither speed is this turn's
        ("local", None, 0.5, None),  # no split
        ("local", {"recomputed_tokens": "x"}, 0.5, None),
    ],
)
def test_a_finished_turn_measures_the_speed_it_shows(source, split, ttft_s, measured):
    puller = pulls(asyncio.run(_store()), Peer())
    puller.observe(_finished(source, split, ttft_s), split)
    snap = puller.counters()["pull_cost"]
    counts = {"prefill": snap["prefill_samples"], **snap["link_samples"]}
    assert counts == {k: int(k == measured) for k in ("prefill", "hold", "revive")}
    if measured == "prefill":
        assert snap["prefill_tokens_per_s"] < PullCostModel().prefill.value  # 2,000/s measured


def test_the_decisions_and_estimates_are_on_metrics():
    from prometheus_client import CollectorRegistry, generate_latest

    from server.plugin.metrics import PeerPullCollector

    puller = pulls(asyncio.run(_store()), Peer())
    puller.cost.decide("hold", 600, 0)
    puller.cost.decide("run", 8, 0)
    puller.observe(_finished("local", SPLIT, 0.5), SPLIT)
    registry = CollectorRegistry()
    registry.register(PeerPullCollector(puller))
    text = generate_latest(registry).decode()
    for line in (
        'kvbranch_peer_pull_decisions_total{decision="pull",path="hold"} 1.0',
        'kvbranch_peer_pull_decisions_total{decision="recompute",path="run"} 1.0',
        'kvbranch_peer_pull_decisions_total{decision="pull",path="revive"} 0.0',
        'kvbranch_peer_pull_link_tokens_per_second{kind="hold"} 200000.0',
        'kvbranch_peer_pull_samples_total{what="prefill"} 1.0',
        'kvbranch_peer_pull_samples_total{what="revive"} 0.0',
    ):
        assert line in text, line
    prefill = puller.cost.prefill.value
    assert f"kvbranch_peer_pull_prefill_tokens_per_second {prefill}" in text


# --- a pin follows the branch to this replica --------------------------------------------------


class PinnedPeer(Peer):
    """The member the branch left: its branch read answers ``branch`` (the client's own key
    required); this replica's own pin route answers 200. Records every call."""

    def __init__(self, branch: dict) -> None:
        super().__init__()
        self.branch = branch

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == HOLD_CLAIM_PATH:
            return super().__call__(request)
        self.calls.append(request)
        assert request.headers["authorization"] == "Bearer k"
        if request.method == "GET":
            return httpx.Response(200, json=self.branch)
        return httpx.Response(200, json=dict(self.branch, pinned=True))


BRANCH = "/v1/kvbranch/sessions/s1/branches/main"


def _turn_answered(store, peer: Peer) -> PeerPulls:
    """A turn begun here and answered: its hold filed, and the pin follow run to its end."""
    puller = pulls(store, peer)

    async def turn_and_file():
        turn = await puller.begin({}, KEY, "Bearer k")
        await puller.file(turn, handle())
        await asyncio.gather(*puller._filing)

    asyncio.run(turn_and_file())
    return puller


def _pin_calls(peer: Peer) -> list[tuple[str, str, dict | None]]:
    return [
        (c.method, str(c.url), json.loads(c.content) if c.content else None)
        for c in peer.calls
        if c.url.path not in (HOLD_CLAIM_PATH, REVIVE_PATH)
    ]


@pytest.mark.parametrize("left_by", ["hold", "home"])
def test_a_branch_pinned_where_it_was_served_is_pinned_here_for_what_was_left(left_by):
    pinned = {"session_id": "s1", "branch_id": "main", "pinned": True, "pin_expires_in_s": 90.0}
    peer = PinnedPeer(pinned)
    if left_by == "hold":
        store = asyncio.run(_store(peer_record(), hold=Hold("u", PEER, handle())))
    else:
        store = asyncio.run(_homed(PEER, peer_record()))
    puller = _turn_answered(store, peer)
    assert _pin_calls(peer) == [
        ("GET", "http://10.0.0.7:8000" + BRANCH, None),
        ("POST", "http://me:8000" + BRANCH + "/pin", {"ttl_s": 90.0}),
    ]
    assert puller.counts.pins_followed == 1
    assert puller.counters()["pins_followed"] == 1


def test_a_branch_not_pinned_where_it_was_served_is_not_pinned_here():
    peer = PinnedPeer({"session_id": "s1", "branch_id": "main", "pinned": False})
    store = asyncio.run(_store(peer_record(), hold=Hold("u", PEER, handle())))
    puller = _turn_answered(store, peer)
    assert [m for m, _, _ in _pin_calls(peer)] == ["GET"]
    assert puller.counts.pins_followed == 0


@pytest.mark.parametrize(
    ("home", "records"),
    [
        ("me", ()),  # the branch was served here: its pin is here already
        (None, ()),  # a new session: no pin anywhere
        (PEER, ()),  # its home is no live member: nothing to read
        (PEER, (peer_record(secret=b"x" * 32),)),  # a record not sealed by the cluster
    ],
)
def test_no_pin_is_read_or_written_when(home, records):
    pinned = {"session_id": "s1", "branch_id": "main", "pinned": True, "pin_expires_in_s": 90.0}
    peer = PinnedPeer(pinned)
    store = asyncio.run(_homed(home, *records) if home else _store(*records))
    puller = _turn_answered(store, peer)
    assert _pin_calls(peer) == [] and puller.counts.pins_followed == 0
