"""A completion turn through the router in front of aggregated replicas (fake replicas over
httpx's MockTransport; real replicas behind the real router are in
tests/integration/test_replica_router.py): the turn goes to the replica the index says holds
the branch, or moves; the router reads the hold and never takes it, never claims, never begins a
turn, never sends transfer params; a replica it cannot connect to hands the turn to the next;
session routes and health follow the replicas; replicas learnt from the index's sealed records
put an index-only router in aggregated mode."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx

from sdk.contract import (
    HEALTH_PATH,
    HOLD_CLAIM_PATH,
    SESSION_HEADER,
    TRANSFER_PARAMS_FIELD,
)
from server.common.tenants import scope_of
from server.connector.pd.transfer_auth import load_cluster_secret
from server.index import Hold, InstanceRecord, Key, MemoryIndexStore, TurnStart, record_seal
from server.router.app import Router
from server.router.replicas import LOAD_MARGIN
from tests.unit.server.router.fakes import base_of, call, json_reply

R1, R2, R3 = "http://r1.test:1", "http://r2.test:1", "http://r3.test:1"
CHAT = "/v1/chat/completions"
ROUTE = "X-KVBranch-Route"
SESSION = "sess-agent-1"
TENANT = scope_of(None)  # no API key
KEY: Key = (TENANT, SESSION, "main")
BODY = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


class _Store(MemoryIndexStore):
    """The embedded index, counting what would take a hold or start a turn."""

    def __init__(self) -> None:
        super().__init__(hold_ttl_s=60)
        self.begun = 0

    async def begin_turn(self, key: Key) -> TurnStart:
        self.begun += 1
        return await super().begin_turn(key)


class _Body(httpx.AsyncByteStream):
    """A streamed body, in pieces cut mid-event as a real stream may be."""

    def __init__(self, data: bytes) -> None:
        self.pieces = [data[i : i + 7] for i in range(0, len(data), 7)]

    async def __aiter__(self):  # type: ignore[override]
        for piece in self.pieces:
            yield piece


class _Dropping(httpx.AsyncByteStream):
    """A stream whose connection drops after ``sent`` bytes (a replica killed mid-answer)."""

    def __init__(self, sent: bytes, request: httpx.Request) -> None:
        self.sent, self.request = sent, request

    async def __aiter__(self):  # type: ignore[override]
        if self.sent:
            yield self.sent
        raise httpx.RemoteProtocolError("peer closed connection", request=self.request)


class _Replicas:
    """Fake replicas: health names the instance id (its URL), a turn gets a JSON answer (with
    transfer params the router must take out) or an SSE stream; ``down`` refuse connections."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, dict[str, Any] | None]] = []
        self.down: set[str] = set()
        #: Replicas that take a turn and drop the connection before answering (killed).
        self.drop: set[str] = set()
        #: Replicas whose stream's headers come and then the connection drops, after this
        #: many bytes of the body (0: before its first chunk).
        self.drop_stream: dict[str, int] = {}
        self.status = 200

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = base_of(request)
        if base in self.down:
            raise httpx.ConnectError("refused", request=request)
        if request.url.path == HEALTH_PATH:
            return json_reply(200, {"instance_id": base, "status": "ok"})
        body = json.loads(request.content) if request.content else None
        self.seen.append((base, request.url.path, body))
        if request.url.path != CHAT:
            return json_reply(200, {"from": base})
        if base in self.drop:
            raise httpx.RemoteProtocolError("Server disconnected", request=request)
        if self.status != 200:
            return json_reply(self.status, {"error": {"message": "engine died"}})
        if body and body.get("stream"):
            events = [
                {"choices": [{"delta": {"content": "hi"}}]},
                {"choices": [], "usage": {"total_tokens": 3}, TRANSFER_PARAMS_FIELD: {"x": 1}},
            ]
            data = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events)
            body: httpx.AsyncByteStream = _Body(data + b"data: [DONE]\n\n")
            if base in self.drop_stream:
                body = _Dropping(data[: self.drop_stream[base]], request)
            return httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=body)
        answer = {"choices": [{"message": {"content": base}}], TRANSFER_PARAMS_FIELD: {"x": 1}}
        return json_reply(200, answer)

    def turns(self) -> list[str]:
        return [base for base, path, _ in self.seen if path == CHAT]


def _router(fakes: _Replicas, store: _Store, urls: tuple[str, ...] = (R1, R2, R3)) -> Router:
    router = Router([], [], hold_ttl_s=60, index=store, replica_urls=list(urls))
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(fakes))
    return router


def _sealed(url: str, role: str) -> InstanceRecord:
    """A heartbeat as an instance sends it: sealed with the cluster secret the pool verifies."""
    record = InstanceRecord(url, url, role, block_size=16)  # type: ignore[arg-type]
    return record_seal.seal(record, load_cluster_secret())


def _indexed_router(fakes: _Replicas, store: _Store, *replicas: str) -> Router:
    """A router given no URL: it knows the replicas from their heartbeats in the index."""
    router = Router([], [], hold_ttl_s=60, index=store)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(fakes))
    for url in replicas:
        asyncio.run(store.heartbeat(_sealed(url, "both"), ttl_s=60))
    return router


def _turn(router: Router, body: dict[str, Any] | None = None) -> httpx.Response:
    return call(router, "POST", CHAT, json=body or BODY, headers={SESSION_HEADER: SESSION})


def _file_hold(store: _Store, holder: str) -> None:
    """A replica's own filing after its turn: the hold names it."""
    asyncio.run(store.put_hold(KEY, Hold(holder, holder, {"remote_num_tokens": 300}, turn=1)))


def _untouched(fakes: _Replicas, store: _Store) -> None:
    """What a router in front of replicas never does: start a turn (take the hold), claim,
    or send transfer params."""
    assert store.begun == 0
    assert not [s for s in fakes.seen if s[1] == HOLD_CLAIM_PATH]
    assert not [s for s in fakes.seen if s[2] and TRANSFER_PARAMS_FIELD in s[2]]


def test_a_turn_goes_to_the_replica_holding_its_branch_and_the_hold_stays_for_it():
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store)
    _file_hold(store, R2)
    r = _turn(router)
    assert r.status_code == 200 and r.headers[ROUTE] == "replica"
    assert fakes.turns() == [R2]
    assert fakes.seen[-1][2] == BODY  # as the client sent it
    assert TRANSFER_PARAMS_FIELD not in r.json()  # the cluster's, not the client's
    assert asyncio.run(store.peek_hold(KEY)) is not None  # left for R2 to take
    _untouched(fakes, store)
    # Where the session went is recorded: its next turn and its session routes find it there.
    assert asyncio.run(store.peek_home(TENANT, SESSION)) == R2
    assert asyncio.run(store.session_instances(TENANT, SESSION)) == {R2}


def test_an_overloaded_holder_loses_the_turn_and_the_route_says_it_moved():
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store, (R1, R2))
    _file_hold(store, R2)
    holder = next(i for i in router.pool.replicas if i.url == R2)
    holder.inflight = LOAD_MARGIN + 1
    r = _turn(router)
    assert r.headers[ROUTE] == "replica-moved" and fakes.turns() == [R1]
    assert asyncio.run(store.peek_home(TENANT, SESSION)) == R1
    holder.inflight = LOAD_MARGIN  # within the margin: the holder keeps it
    _file_hold(store, R2)
    r = _turn(router)
    assert r.headers[ROUTE] == "replica" and fakes.turns()[-1] == R2
    _untouched(fakes, store)


def test_a_pin_follows_the_branch_to_the_replica_its_turn_moved_to():
    """The holder is overloaded, the turn moves to R1; once R1 has answered, the router reads
    the branch on R2 (the client's own key) and, pinned there, pins it on R1 for what was left
    of the lease. Not pinned on R2, or a turn that stayed: no pin is sent anywhere."""
    for pinned, stream in ((True, False), (True, True), (False, False)):
        fakes, store = _Replicas(), _Store()
        # an unpinned branch with a lease left: only ``pinned`` says whether it is one
        branch = {"session_id": SESSION, "branch_id": "main", "pinned": pinned}
        branch["pin_expires_in_s"] = 90.0

        def replicas(request: httpx.Request, fakes=fakes, branch=branch) -> httpx.Response:
            if request.method == "GET" and request.url.path.endswith("/branches/main"):
                assert request.headers["authorization"] == "Bearer k"  # the client's own key
                fakes.seen.append((base_of(request), request.url.path, None))
                return json_reply(200, branch)
            return fakes(request)

        router = Router([], [], hold_ttl_s=60, index=store, replica_urls=[R1, R2])
        router.client = httpx.AsyncClient(transport=httpx.MockTransport(replicas))
        holder = Hold(R2, R2, {"remote_num_tokens": 300}, turn=1)
        asyncio.run(store.put_hold((scope_of("Bearer k"), SESSION, "main"), holder))
        next(i for i in router.pool.replicas if i.url == R2).inflight = LOAD_MARGIN + 1
        r = call(
            router,
            "POST",
            CHAT,
            json=dict(BODY, stream=stream),
            headers={SESSION_HEADER: SESSION, "authorization": "Bearer k"},
        )
        assert r.status_code == 200 and r.headers[ROUTE] == "replica-moved"
        pins = [s for s in fakes.seen if s[1].endswith("/pin")]
        reads = [s for s in fakes.seen if s[1].endswith("/branches/main")]
        assert reads == [(R2, f"/v1/kvbranch/sessions/{SESSION}/branches/main", None)]
        assert pins == ([(R1, reads[0][1] + "/pin", {"ttl_s": 90.0})] if pinned else [])
        metrics = call(router, "GET", "/metrics").content
        assert (b"kvbranch_router_pins_followed_total 1.0" in metrics) == pinned
    # a turn that stays where its branch is: nothing read, nothing pinned
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store, (R1, R2))
    _file_hold(store, R2)
    _turn(router)
    assert not [s for s in fakes.seen if "/branches/" in s[1]]


def test_a_holder_that_cannot_be_reached_hands_the_turn_to_the_next_replica():
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store, (R1, R2))
    asyncio.run(router.pool.probe_all())  # both up as last probed
    _file_hold(store, R2)
    fakes.down.add(R2)  # it dies between its probe and the turn
    r = _turn(router)
    assert r.status_code == 200 and r.headers[ROUTE] == "replica-moved"
    assert fakes.turns() == [R1]  # nothing reached R2: the turn ran once
    holder = next(i for i in router.pool.replicas if i.url == R2)
    assert not holder.alive and holder.consecutive_failures == 1
    _untouched(fakes, store)


def test_no_replica_reachable_is_503():
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store, (R1, R2))
    fakes.down |= {R1, R2}
    r = _turn(router)
    assert r.status_code == 503 and "no replica" in r.json()["error"]["message"]


def test_a_replica_that_fails_mid_turn_is_503_and_the_turn_is_not_sent_again():
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store, (R1, R2))
    fakes.status = 500
    r = _turn(router)
    assert r.status_code == 503 and len(fakes.turns()) == 1
    failed = next(i for i in router.pool.replicas if i.url == fakes.turns()[0])
    assert failed.consecutive_failures == 1


def test_a_replica_killed_mid_turn_hands_the_turn_to_another_once():
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store, (R1, R2, R3))
    asyncio.run(router.pool.probe_all())
    _file_hold(store, R2)
    fakes.drop.add(R2)  # it takes the turn and dies before answering
    r = _turn(router)
    assert r.status_code == 200 and r.headers[ROUTE] == "replica-moved"
    assert fakes.turns()[0] == R2 and len(fakes.turns()) == 2
    assert r.json()["choices"][0]["message"]["content"] == fakes.turns()[1]
    holder = next(i for i in router.pool.replicas if i.url == R2)
    assert not holder.alive
    assert b"kvbranch_router_turns_resent_total 1.0" in call(router, "GET", "/metrics").content
    _untouched(fakes, store)


def test_a_turn_dropped_twice_is_503_and_not_sent_a_third_time():
    """A request that kills each replica it reaches takes down two, not the cluster."""
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store, (R1, R2, R3))
    fakes.drop |= {R1, R2, R3}
    r = _turn(router)
    assert r.status_code == 503 and "mid-turn" in r.json()["error"]["message"]
    assert len(fakes.turns()) == 2


def test_a_stream_dropped_before_its_first_chunk_is_sent_once_more():
    """vLLM sends a stream's headers at once: a replica killed while prefilling has answered
    200 and nothing else. The client, which has seen nothing, gets the other replica's stream."""
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store, (R1, R2))
    _file_hold(store, R2)
    fakes.drop_stream[R2] = 0
    r = _turn(router, {**BODY, "stream": True})
    assert r.status_code == 200 and r.headers[ROUTE] == "replica-moved"
    assert fakes.turns() == [R2, R1]
    assert b'"content": "hi"' in r.content and r.content.endswith(b"data: [DONE]\n\n")
    assert b"kvbranch_router_turns_resent_total 1.0" in call(router, "GET", "/metrics").content


def test_a_stream_dropped_after_its_first_chunk_ends_with_an_error_event_not_sent_again():
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store, (R1, R2))
    _file_hold(store, R2)
    fakes.drop_stream[R2] = 20  # part of the first event reached the client
    r = _turn(router, {**BODY, "stream": True})
    assert r.status_code == 200 and fakes.turns() == [R2]
    assert b"the answer is incomplete" in r.content and b"[DONE]" not in r.content


def test_without_a_hold_the_turn_goes_home_then_by_rendezvous():
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store)
    asyncio.run(store.set_home(TENANT, SESSION, R3))  # a turn in flight took the hold
    r = _turn(router)
    assert r.headers[ROUTE] == "replica" and fakes.turns() == [R3]
    # Another session, nothing known: rendezvous, the same replica turn after turn.
    other = {SESSION_HEADER: "sess-new"}
    first = call(router, "POST", CHAT, json=BODY, headers=other)
    second = call(router, "POST", CHAT, json=BODY, headers=other)
    assert first.headers[ROUTE] == second.headers[ROUTE] == "replica"
    assert fakes.turns()[1] == fakes.turns()[2]
    _untouched(fakes, store)


def test_a_stream_is_relayed_with_its_usage_and_without_transfer_params():
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store)
    _file_hold(store, R1)
    r = _turn(router, dict(BODY, stream=True))
    assert r.status_code == 200 and r.headers[ROUTE] == "replica"
    assert b"hi" in r.content and b'"total_tokens":3' in r.content
    assert TRANSFER_PARAMS_FIELD.encode() not in r.content
    assert r.content.rstrip().endswith(b"data: [DONE]")
    assert fakes.seen[-1][2] == dict(BODY, stream=True)  # no usage asked for by the router
    assert all(i.inflight == 0 for i in router.pool.replicas)
    _untouched(fakes, store)


def test_transfer_params_from_a_client_are_refused_before_any_replica_sees_them():
    """The field, ``null`` included, and smuggled in the extension args (where vLLM reads them
    too: a replica refused those with 403 after the router had relayed them)."""
    fakes, store = _Replicas(), _Store()
    router = _router(fakes, store)
    for extra, param in (
        ({"kv_transfer_params": {"remote_host": "10.0.0.9"}}, "kv_transfer_params"),
        ({"kv_transfer_params": None}, "kv_transfer_params"),
        ({"vllm_xargs": {"kv_transfer_params": "x"}}, "vllm_xargs.kv_transfer_params"),
    ):
        r = _turn(router, dict(BODY, **extra))
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert fakes.turns() == []


def test_session_routes_and_health_follow_the_replicas():
    fakes, store = _Replicas(), _Store()
    router = _indexed_router(fakes, store, R1, R2, R3)
    health = call(router, "GET", "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert {i["role"] for i in health.json()["instances"]} == {"both"}
    made = call(router, "POST", "/v1/kvbranch/sessions", json={"session_id": SESSION})
    assert made.status_code == 200
    created_on = [b for b, path, _ in fakes.seen if path == "/v1/kvbranch/sessions"]
    assert len(created_on) == 1  # on one replica: the one its turns will go to
    r = _turn(router)
    assert fakes.turns() == created_on and r.headers[ROUTE] == "replica"
    _untouched(fakes, store)


def test_a_router_that_knows_only_the_index_serves_the_replicas_it_lists():
    fakes, store = _Replicas(), _Store()
    router = _indexed_router(fakes, store, R1, R2)
    _file_hold(store, R2)
    r = _turn(router)
    assert r.headers[ROUTE] == "replica" and fakes.turns() == [R2]
    _untouched(fakes, store)


def test_a_p_or_d_in_the_index_keeps_the_router_in_pd_mode():
    fakes, store = _Replicas(), _Store()
    router = Router([], [], hold_ttl_s=60, index=store)
    router.client = httpx.AsyncClient(transport=httpx.MockTransport(fakes))
    asyncio.run(store.heartbeat(_sealed(R1, "both"), ttl_s=60))
    asyncio.run(store.heartbeat(_sealed(R2, "prefill"), ttl_s=60))
    _turn(router)
    assert store.begun == 1  # the P/D turn's own start, as it always was
