"""The attacker's suite against the router, the cluster's front door (issue 37): two real routers
over a real Redis in front of the keyed P/D pair (real P and D, two API keys), probed the way
the issue's attacker probed ``python -m server --cluster ... --api-key KA --api-key KB`` on
42b8442 — where each case below got a 500, a 503, a Redis filled by strangers, a prefill spent
on a request D refused, or a router that refused everyone.

Each case ends in a 4xx that names what is wrong (401, 400, 429) and leaves nothing behind: no
Redis key, no engine request on P or D; and the routers answer right afterwards (the plain vLLM
server's answer). The probes a router in front of aggregated replicas answers alike are shared
with test_replicas_edge (:mod:`tests.integration.edge_probes`). The NIXL side channel's and Redis
records' probes are in test_nixl_side_channel.py and tests/unit/server/index/.
"""

from __future__ import annotations

import socket
import time
from types import SimpleNamespace
from urllib.parse import urlsplit

import httpx
import pytest
import redis

from tests.integration import edge_probes as probe
from tests.integration.edge_probes import QUESTION, Unchanged
from tests.integration.helpers import chat, pd_activity, text_of
from tests.integration.trust_cluster import KEY_A, KEY_B, trust_router
from tests.redis_server import RedisServer

#: A tenant's share of in-flight requests at these routers (the default is 128).
TENANT_SHARE = 2
A_HEADERS = {"Authorization": f"Bearer {KEY_A}"}
B_HEADERS = {"Authorization": f"Bearer {KEY_B}"}


@pytest.fixture(scope="module")
def edge(keyed_pd):
    """Routers A and B over their own Redis, in front of the keyed pair's P and D."""
    prefill, decode, _ = keyed_pd
    store = RedisServer().start()
    routers = [
        trust_router(
            prefill,
            decode,
            "--index",
            store.url,
            "--router-tenant-inflight",
            str(TENANT_SHARE),
            name=f"edge-router{n}",
        )
        for n in range(2)
    ]
    try:
        for router in routers:
            router.launch()
        for router in routers:
            router.wait_ready()
        yield SimpleNamespace(p=prefill, d=decode, a=routers[0], b=routers[1], redis=store)
    finally:
        for router in routers:
            router.stop()
        store.stop()


def _keys(edge) -> int:
    with redis.Redis.from_url(edge.redis.url) as r:
        return int(r.dbsize())


def _nothing_ran(edge) -> Unchanged:
    """A context for probes that must leave P, D (engine requests, pulls, holds, claims) and
    Redis as they were."""
    return Unchanged(
        lambda: (pd_activity(edge.p), pd_activity(edge.d), _keys(edge)), "(P, D, Redis keys)"
    )


def test_requests_without_a_key_are_401_and_leave_nothing_behind(edge):
    with _nothing_ran(edge):
        probe.requests_without_a_key_are_401(edge.a.url, edge.a.model)


@pytest.mark.parametrize(
    ("name", "path", "fields", "headers", "param"), probe.HOSTILE, ids=probe.HOSTILE_IDS
)
def test_hostile_ids_headers_and_types_are_400s_that_run_nothing(
    edge, name, path, fields, headers, param
):
    with _nothing_ran(edge):
        probe.hostile_request_is_400(edge.a.url, edge.a.model, KEY_A, path, fields, headers, param)


def test_a_session_route_with_a_lone_surrogate_is_a_400(edge):
    with _nothing_ran(edge):
        probe.session_route_with_a_lone_surrogate_is_400(edge.b.url, KEY_B)


def test_deeply_nested_json_is_a_400(edge):
    with _nothing_ran(edge):
        probe.deeply_nested_json_is_400(edge.a.url, KEY_A)


def test_a_request_d_would_refuse_costs_p_no_prefill(edge):
    """min_tokens 5 > max_tokens 2 on a 1.5k-token prompt: on 42b8442 P prefilled all of it
    (and held it for D) before D's 400."""
    with _nothing_ran(edge):
        probe.min_over_max_is_400(edge.a.url, edge.a.model, KEY_A)


@pytest.mark.parametrize(
    ("name", "fields", "param"), probe.TRANSFER_PARAMS, ids=probe.TRANSFER_PARAMS_IDS
)
def test_client_transfer_params_are_refused_never_relayed(edge, name, fields, param):
    with _nothing_ran(edge):
        probe.client_transfer_params_are_400(edge.a.url, edge.a.model, KEY_B, fields, param)


def _open(url: str, n: int) -> list[socket.socket]:
    parts = urlsplit(url)
    return [socket.create_connection((parts.hostname, parts.port)) for _ in range(n)]


def test_idle_sockets_leave_clients_served(edge, plain_server):
    """2,100 idle connections (no byte sent) made router A answer 503 to a real chat."""
    idle = _open(edge.a.url, 2100)
    try:
        answer = chat(edge.a, QUESTION, max_tokens=8)
    finally:
        for sock in idle:
            sock.close()
    assert text_of(answer) == text_of(chat(plain_server, QUESTION, max_tokens=8))


def _inflight(router) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("kvbranch_router_inflight "))
    return float(line.split()[1])


def _hold_open(url: str, key: str) -> socket.socket:
    """A request of tenant ``key`` whose body never finishes arriving: in flight at the edge."""
    (sock,) = _open(url, 1)
    parts = urlsplit(url)
    sock.sendall(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Authorization: Bearer {key}\r\nContent-Type: application/json\r\n"
            "Content-Length: 1000\r\n\r\n{"
        ).encode()
    )
    return sock


def test_a_tenant_past_its_share_gets_429_and_the_other_tenant_is_served(edge, plain_server):
    held = [_hold_open(edge.b.url, KEY_A) for _ in range(TENANT_SHARE)]
    try:
        deadline = time.monotonic() + 60  # a hang guard: the edge counts them at once
        while _inflight(edge.b) < TENANT_SHARE:
            assert time.monotonic() < deadline, "the held requests never reached the edge"
            time.sleep(0.1)
        with _nothing_ran(edge), httpx.Client(base_url=edge.b.url, timeout=60) as c:
            r = c.post("/v1/chat/completions", json=probe.body(edge.b.model), headers=A_HEADERS)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1, r.text
        with httpx.Client(base_url=edge.b.url, timeout=180) as c:
            r = c.post("/v1/chat/completions", json=probe.body(edge.b.model), headers=B_HEADERS)
        assert r.status_code == 200, r.text
    finally:
        for sock in held:
            sock.close()
    reference = text_of(chat(plain_server, QUESTION, max_tokens=8))
    assert text_of(r.json()) == reference
    deadline = time.monotonic() + 60
    while _inflight(edge.b) > 0:
        assert time.monotonic() < deadline, "closed requests stayed in flight"
        time.sleep(0.1)
    assert text_of(chat(edge.b, QUESTION, max_tokens=8)) == reference  # A's share is back


def test_both_routers_answer_right_afterwards(edge, plain_server):
    reference = text_of(chat(plain_server, QUESTION, max_tokens=8))
    for router in (edge.a, edge.b):
        assert text_of(chat(router, QUESTION, max_tokens=8)) == reference
