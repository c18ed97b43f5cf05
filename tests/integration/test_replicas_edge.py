"""The attacker's suite (:mod:`tests.integration.edge_probes`, test_router_edge's probes) against
the router in aggregated mode: ``python -m server --role router --index URL --replica URL ...``
in front of two aggregated replicas with two API keys — the shared cluster of
:mod:`tests.integration.replica_fixture` (this module sorts right after test_replica_router
and test_replicas, so the three share it). It sorts last on purpose: run first, its one
answered turn moved a logprob of test_replica_router's first test across the third decimal
those tests round to (same tokens); last, it costs one replica restart (test_replicas' last
test kills a peer).

Each probe ends in a 4xx that names what is wrong and leaves nothing behind: no request reaches
either replica (their HTTP request counters on ``/metrics`` for the generating and session
routes, and the engine requests, pulls and holds they counted), and no Redis key appears. Then
the router answers as plain vLLM does.
"""

from __future__ import annotations

import httpx
import pytest

from tests.integration import edge_probes as probe
from tests.integration.helpers import chat, pd_activity, text_of
from tests.integration.replica_fixture import KEY_A, KEY_B, ReplicaCluster

#: The routes whose HTTP requests a refused request must not add to on a replica (vLLM's
#: ``http_requests_total``, by handler): the generating routes and kvbranch's session routes.
GUARDED = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


def http_requests(server) -> float:
    """The replica's HTTP requests so far on the routes a client's turn or session call takes
    (the router's probes and these readings go to other routes)."""
    with httpx.Client(base_url=server.url, headers=server.headers(), timeout=30) as c:
        text = c.get("/metrics").text
    total = 0.0
    for row in text.splitlines():
        if not row.startswith("http_requests_total{"):
            continue
        handler = row.split('handler="', 1)[1].split('"', 1)[0]
        if handler in GUARDED or handler.startswith("/v1/kvbranch/sessions"):
            total += float(row.split()[-1])
    return total


def _cluster_state(c: ReplicaCluster) -> tuple:
    """What a refused request must leave as it was: each replica's guarded HTTP requests and
    the engine requests, pulls and holds it counted, and the set of Redis keys (a key that
    expired meanwhile is no write; one that appeared is)."""
    replicas = tuple((http_requests(s), pd_activity(s)) for s in c.replicas)
    with c.redis_client() as r:
        keys = {k.decode() for k in r.scan_iter(count=1000)}
    return replicas, keys


class _NothingRan(probe.Unchanged):
    def __init__(self, c: ReplicaCluster) -> None:
        super().__init__(lambda: _cluster_state(c), "(replicas, Redis keys)")

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            (replicas, keys), (replicas_before, keys_before) = self.read(), self.before
            assert replicas == replicas_before, f"replicas: {replicas_before} -> {replicas}"
            assert keys <= keys_before, f"Redis keys written: {sorted(keys - keys_before)}"


def _router(c: ReplicaCluster) -> tuple[str, str]:
    return c.router.url, c.router.model


def test_requests_without_a_key_are_401_and_leave_nothing_behind(replicas):
    with _NothingRan(replicas):
        probe.requests_without_a_key_are_401(*_router(replicas))


@pytest.mark.parametrize(
    ("name", "path", "fields", "headers", "param"), probe.HOSTILE, ids=probe.HOSTILE_IDS
)
def test_hostile_ids_headers_and_types_are_400s_that_run_nothing(
    replicas, name, path, fields, headers, param
):
    url, model = _router(replicas)
    with _NothingRan(replicas):
        probe.hostile_request_is_400(url, model, KEY_A, path, fields, headers, param)


#: A replica's own port refuses every probe the router refuses, with the router's answer: its
#: guard applies the router's body checks, and its header gate (vLLM's ``--middleware``,
#: outside vLLM's own key check) the router's header checks — a key that is not ASCII too.
REPLICA_DOOR = probe.HOSTILE


@pytest.mark.parametrize(
    ("name", "path", "fields", "headers", "param"),
    REPLICA_DOOR,
    ids=[h[0] for h in REPLICA_DOOR],
)
def test_a_replicas_own_port_refuses_them_alike(replicas, name, path, fields, headers, param):
    """Behind a plain balancer (a Kubernetes Service) each replica is a door of its own."""
    server = replicas.replicas[0]
    probe.hostile_request_is_400(server.url, server.model, KEY_A, path, fields, headers, param)


def test_a_session_route_with_a_lone_surrogate_is_a_400(replicas):
    with _NothingRan(replicas):
        probe.session_route_with_a_lone_surrogate_is_400(replicas.router.url, KEY_B)


def test_deeply_nested_json_is_a_400(replicas):
    with _NothingRan(replicas):
        probe.deeply_nested_json_is_400(replicas.router.url, KEY_A)


def test_min_tokens_over_max_tokens_is_a_400_no_replica_sees(replicas):
    with _NothingRan(replicas):
        probe.min_over_max_is_400(*_router(replicas), KEY_A)


@pytest.mark.parametrize(
    ("name", "fields", "param"), probe.TRANSFER_PARAMS, ids=probe.TRANSFER_PARAMS_IDS
)
def test_client_transfer_params_are_refused_never_relayed(replicas, name, fields, param):
    url, model = _router(replicas)
    with _NothingRan(replicas):
        probe.client_transfer_params_are_400(url, model, KEY_B, fields, param)


def test_the_router_answers_right_afterwards(replicas, plain_server):
    """As plain vLLM answers; and the readings the probes above rely on see a relayed turn: one
    more guarded HTTP request and one more engine request, on one of the replicas."""
    reference = text_of(chat(plain_server, probe.QUESTION, max_tokens=8))
    before = [(http_requests(s), pd_activity(s)["requests"]) for s in replicas.replicas]
    assert text_of(chat(replicas.router, probe.QUESTION, max_tokens=8)) == reference
    after = [(http_requests(s), pd_activity(s)["requests"]) for s in replicas.replicas]
    moved = sorted((a[0] - b[0], a[1] - b[1]) for a, b in zip(after, before, strict=True))
    assert moved == [(0, 0), (1, 1)], (before, after)
