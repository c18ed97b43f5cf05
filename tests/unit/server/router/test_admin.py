"""Session routes fanned out to every instance: one id everywhere, a partial failure is a 502
naming the instance, a retry converges; reads fall over to a prefill that answers."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from sdk.contract import HEALTH_PATH, SESSIONS_PATH, STATS_PATH, session_path
from server.common.tenants import scope_of
from server.router.app import Router
from tests.unit.server.router.fakes import (
    D,
    Fakes,
    P,
    call,
    err,
    json_reply,
    make_router,
    peek,
    put,
    refused,
)


# --- session fan-out -----------------------------------------------------------------------
def test_a_create_reaches_every_instance_with_one_id():
    fakes = Fakes()
    r = call(make_router(fakes), "POST", SESSIONS_PATH, json={})
    assert r.status_code == 201
    ids = {json.loads(c)["session_id"] for _, _, _, c in fakes.seen}
    assert len(ids) == 1 and {b for b, *_ in fakes.seen} == {P, D}


@pytest.mark.parametrize(
    "decode",
    [refused, lambda r: err(500, "engine died"), lambda r: err(409, "too many sessions (8)")],
)
def test_a_partial_failure_is_a_502_naming_the_instance(decode):
    fakes = Fakes()
    fakes.answer[D] = decode
    r = call(make_router(fakes), "POST", SESSIONS_PATH, json={})
    assert r.status_code == 502, r.text
    data = r.json()
    by_role = {i["role"]: i for i in data["instances"]}
    assert by_role["prefill"]["ok"] and by_role["prefill"]["status"] == 201
    assert not by_role["decode"]["ok"] and by_role["decode"]["url"] == D
    assert by_role["decode"]["status"] in (None, 500, 409) and by_role["decode"]["error"]
    assert D in data["error"]["message"]
    # the id the router chose comes back, so the client's retry converges on it
    sent = {json.loads(c)["session_id"] for _, _, _, c in fakes.seen}
    assert data["session_id"] in sent


def test_a_retried_create_converges_where_one_instance_already_has_it():
    fakes = Fakes()
    fakes.answer[P] = lambda r: err(409, "session 's1' already exists")
    r = call(make_router(fakes), "POST", SESSIONS_PATH, json={"session_id": "s1"})
    assert r.status_code == 201 and r.json() == {"from": "d"}
    fakes.answer[D] = fakes.answer[P]  # everywhere already: the plain 409 one instance gives
    r = call(make_router(fakes), "POST", SESSIONS_PATH, json={"session_id": "s1"})
    assert r.status_code == 409


def test_a_retried_fork_converges_too():
    fakes = Fakes()
    fakes.answer[D] = lambda r: err(409, "branch 'b' already exists in session 's1'")
    r = call(
        make_router(fakes),
        "POST",
        "/v1/kvbranch/sessions/s1/branches",
        json={"parent": "main", "branch_id": "b"},
    )
    assert r.status_code == 201 and r.json() == {"from": "p"}


def test_a_retried_delete_converges_and_drops_the_index_entries():
    fakes = Fakes()
    fakes.answer[P] = lambda r: err(404, "no session 's1'")
    fakes.answer[D] = lambda r: json_reply(200, {"deleted": True})
    router = make_router(fakes)
    key = (scope_of(None), "s1", "main")
    put(router, key, D, "x", {"remote_num_tokens": 3})
    r = call(router, "DELETE", session_path("s1"))
    assert r.status_code == 200 and r.json() == {"deleted": True}
    assert peek(router, key) is None
    fakes.answer[D] = fakes.answer[P]
    assert call(router, "DELETE", session_path("s1")).status_code == 404


def test_the_clients_own_error_passes_through_as_is():
    fakes = Fakes()
    fakes.answer[P] = fakes.answer[D] = lambda r: err(400, "pin_ttl_s must be positive")
    r = call(make_router(fakes), "POST", SESSIONS_PATH, json={"pin_ttl_s": -1})
    assert r.status_code == 400 and "pin_ttl_s" in r.json()["error"]["message"]


def test_a_read_falls_over_to_a_prefill_that_answers():
    fakes = Fakes()
    router = Router([P, "http://p2.test:3"], [D], hold_ttl_s=60)
    fakes.answer["http://p2.test:3"] = lambda r: json_reply(200, {"session_id": "s1"})

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.host == "p.test" and request.url.path != HEALTH_PATH:
            raise httpx.ConnectError("refused", request=request)
        return fakes(request)

    router.client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    r = call(router, "GET", session_path("s1"))
    assert r.status_code == 200 and r.json() == {"session_id": "s1"}


def test_health_is_a_prefill_health_plus_the_routers_view():
    r = call(make_router(Fakes()), "GET", HEALTH_PATH)
    data = r.json()
    assert r.status_code == 200 and data["status"] == "ok" and data["role"] == "router"
    assert data["instance_id"] == P  # the prefill instance's own health body
    assert {i["url"]: i["alive"] for i in data["instances"]} == {P: True, D: True}


def test_a_health_flood_costs_the_instances_no_request_of_its_own():
    """The router's /health shows the body its probe read: P gets no health request beyond
    the probes D gets too (each call used to send P one more, on the turns' pool)."""
    asked: list[str] = []
    fakes = Fakes()

    def counting(request: httpx.Request) -> httpx.Response:
        if request.url.path == HEALTH_PATH:
            asked.append(request.url.host)
        return fakes(request)

    router = make_router(counting)
    for _ in range(30):
        r = call(router, "GET", HEALTH_PATH)
        assert r.status_code == 200 and r.json()["instance_id"] == P
    assert asked.count("p.test") == asked.count("d.test") < 30


def test_health_without_a_decode_is_degraded_and_without_any_instance_503():
    def no_decode(request: httpx.Request) -> httpx.Response:
        if request.url.host == "d.test":
            raise httpx.ConnectError("refused", request=request)
        return Fakes()(request)

    r = call(make_router(no_decode), "GET", HEALTH_PATH)
    assert r.status_code == 200 and r.json()["status"] == "degraded"
    r = call(make_router(refused), "GET", HEALTH_PATH)
    assert r.status_code == 503 and r.json()["status"] == "degraded"


def test_stats_add_the_cluster_index_of_the_callers_tenant_only():
    fakes = Fakes()
    fakes.answer[P] = lambda r: json_reply(200, {"requests": 3})
    router = make_router(fakes)
    put(router, (scope_of("Bearer k1"), "s1", "main"), D, "x", {"remote_num_tokens": 7})
    put(router, (scope_of("Bearer k2"), "s2", "main"), D, "x", {"remote_num_tokens": 8})
    r = call(router, "GET", STATS_PATH, headers={"authorization": "Bearer k1"})
    data = r.json()
    assert r.status_code == 200 and data["requests"] == 3
    (entry,) = data["cluster"]["index"]
    assert entry["session_id"] == "s1" and entry["tokens"] == 7 and entry["decode"] == D
    assert data["cluster"]["index_counters"]["entries"] == 2
    assert [i["role"] for i in data["cluster"]["instances"]] == ["prefill", "decode"]


# --- a delete while an instance is unreachable ---------------------------------------------
def test_a_delete_with_an_instance_down_succeeds_for_the_others_and_names_it():
    fakes = Fakes()
    fakes.answer[P] = lambda r: json_reply(200, {"deleted": "s1", "released_blocks": 4})
    fakes.answer[D] = refused
    router = make_router(fakes)
    key = (scope_of("Bearer k"), "s1", "main")
    put(router, key, D, "x", {"remote_num_tokens": 3})
    r = call(router, "DELETE", session_path("s1"), headers={"authorization": "Bearer k"})
    assert r.status_code == 200, r.text
    assert r.json() == {
        "deleted": "s1",
        "released_blocks": 4,
        "unreachable": [{"url": D, "role": "decode"}],
    }
    # the index forgets the session: no turn and no peer is sent to D's copy of it
    assert peek(router, key) is None
    assert router.admin.pending.missed(D) == [session_path("s1")]


@pytest.mark.parametrize("prefill", [refused, lambda r: err(404, "no session 's1'")])
def test_a_delete_no_reachable_instance_had_is_accepted_not_a_5xx(prefill):
    fakes = Fakes()
    fakes.answer[P], fakes.answer[D] = prefill, refused
    router = make_router(fakes)
    key = (scope_of(None), "s1", "main")
    put(router, key, D, "x", {"remote_num_tokens": 3})
    r = call(router, "DELETE", session_path("s1"))
    assert r.status_code == 202, r.text
    assert r.json()["deleted"] == "s1" and D in {i["url"] for i in r.json()["unreachable"]}
    assert peek(router, key) is None


def test_a_branch_delete_with_an_instance_down_is_kept_for_it_too():
    fakes = Fakes()
    fakes.answer[P] = lambda r: json_reply(200, {"deleted": "b", "released_blocks": 0})
    fakes.answer[D] = refused
    router = make_router(fakes)
    path = "/v1/kvbranch/sessions/s1/branches/b"
    r = call(router, "DELETE", path)
    assert r.status_code == 200 and r.json()["unreachable"] == [{"url": D, "role": "decode"}]
    assert router.admin.pending.missed(D) == [path]


def test_a_delete_an_instance_that_answered_refused_is_still_a_502():
    # reachable but failing: the delete did not apply there and nothing will send it again
    fakes = Fakes()
    fakes.answer[P] = lambda r: json_reply(200, {"deleted": "s1", "released_blocks": 0})
    fakes.answer[D] = lambda r: err(500, "engine died")
    router = make_router(fakes)
    r = call(router, "DELETE", session_path("s1"))
    assert r.status_code == 502 and D in r.json()["error"]["message"]
    assert len(router.admin.pending) == 0


def test_an_instance_back_gets_the_delete_it_missed_before_it_counts_as_up():
    fakes = Fakes()
    fakes.answer[P] = lambda r: json_reply(200, {"deleted": "s1", "released_blocks": 0})
    fakes.answer[D] = refused
    router = make_router(fakes)
    r = call(router, "DELETE", session_path("s1"), headers={"authorization": "Bearer k"})
    assert r.status_code == 200
    decode = router.pool.decodes[0]
    assert not decode.alive  # the fan-out found it down
    keys: list[str | None] = []

    def back(request: httpx.Request) -> httpx.Response:
        keys.append(request.headers.get("authorization"))
        return json_reply(200, {"deleted": "s1", "released_blocks": 2})

    fakes.answer[D] = back
    fakes.seen.clear()
    assert asyncio.run(router.pool.probe(decode, 0.0))
    # the client's own request again, with its key (its tenant's session), and nothing else
    sent = [(b, m, p) for b, m, p, _ in fakes.seen]
    assert sent == [(D, "DELETE", session_path("s1"))] and keys == ["Bearer k"]
    assert len(router.admin.pending) == 0 and decode.alive


def test_an_instance_the_missed_delete_cannot_reach_stays_down():
    fakes = Fakes()
    fakes.answer[P] = lambda r: json_reply(200, {"deleted": "s1", "released_blocks": 0})
    fakes.answer[D] = refused
    router = make_router(fakes)
    call(router, "DELETE", session_path("s1"))
    decode = router.pool.decodes[0]
    assert not asyncio.run(router.pool.probe(decode, 0.0))  # health answers, the delete not
    assert router.admin.pending.missed(D) == [session_path("s1")] and not decode.alive


def test_the_client_cannot_choose_which_instances_a_delete_skips():
    # a body or query naming instances changes nothing: the fan-out is the index's or the pool's
    fakes = Fakes()
    fakes.answer[P] = fakes.answer[D] = lambda r: json_reply(
        200, {"deleted": "s1", "released_blocks": 0}
    )
    router = make_router(fakes)
    r = call(
        router,
        "DELETE",
        session_path("s1") + "?skip=" + D,
        content=json.dumps({"instances": [P], "unreachable": [D]}),
    )
    assert r.status_code == 200 and "unreachable" not in r.json()
    assert {b for b, m, *_ in fakes.seen if m == "DELETE"} == {P, D}


def test_a_fork_with_an_instance_down_succeeds_for_the_others_and_names_it():
    # the missed instance makes the branch at its first turn there: nothing to send it later
    fakes = Fakes()
    fakes.answer[P] = lambda r: json_reply(201, {"branch_id": "b", "parent": "main"})
    fakes.answer[D] = refused
    router = make_router(fakes)
    path = "/v1/kvbranch/sessions/s1/branches"
    r = call(router, "POST", path, json={"parent": "main", "branch_id": "b"})
    assert r.status_code == 201, r.text
    assert r.json() == {
        "branch_id": "b",
        "parent": "main",
        "unreachable": [{"url": D, "role": "decode"}],
    }
    assert len(router.admin.pending) == 0


@pytest.mark.parametrize(
    ("prefill", "status"),
    [
        (refused, 502),  # made nowhere
        (lambda r: err(500, "engine died"), 502),  # an instance that answered did not make it
        (lambda r: err(404, "no branch 'main' in session 's1'"), 502),
    ],
)
def test_a_fork_no_reachable_instance_made_is_still_a_502(prefill, status):
    fakes = Fakes()
    fakes.answer[P], fakes.answer[D] = prefill, refused
    r = call(
        make_router(fakes),
        "POST",
        "/v1/kvbranch/sessions/s1/branches",
        json={"parent": "main", "branch_id": "b"},
    )
    assert r.status_code == status, r.text


def test_a_session_create_with_an_instance_down_is_still_a_502():
    # every instance makes a new session with the router's id: one that missed it would
    # refuse the session's routes (only turns make it lazily)
    fakes = Fakes()
    fakes.answer[D] = refused
    assert call(make_router(fakes), "POST", SESSIONS_PATH, json={}).status_code == 502
