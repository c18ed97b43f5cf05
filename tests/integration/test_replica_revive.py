"""Aggregated replicas pull a session's history from a peer's *host store* once the peer's hold
on its device blocks has ended: the peer revives the branch (loads the prefix from its host
store into device blocks with a one-token prefill and holds them), then the replica claims and
pulls it as any hold (server/plugin/revive.py, docs/cluster.md "Holds"). On the shared replica
cluster (:mod:`tests.integration.replica_fixture`), each turn sent straight to a replica.

Replica A answers turn 1; its hold's offer is taken out of the index (as its end would) and,
once A's hold on the blocks ended, A's *device* cache is emptied (``/reset_prefix_cache``
without ``reset_external``: its host store keeps the history); replica B's caches are emptied
entirely. Turn 2 on B can then get the history only from A's host store: it must pull it, and
answer as plain vLLM does (tokens exact, logprobs within the module's tolerance). The revive
route's door: unsigned, another tenant's, or for a history A's host store no longer has, it
answers 4xx before A's engine sees any request.

A fork's first turn (a new branch id: A has no record of it) on B, once A's hold ended and A's
device cache was reset, is pulled by a *block-run* revive: B finds in the index that A's host
store holds the longest run of its prompt's blocks (a device reset leaves A's host-tier entries
visible: the generation is per tier) and asks A to revive those token ids. A block-run revive
whose token ids A's store does not have gets 409, one naming tenant A's salt under tenant B's
key 403, each before A's engine sees any request.

The conversations' seeds here are no other module's on the shared cluster: a block-run lookup
finds any session's stored prompt, so another module's first turn of the same conversation
could pull what these tests left in a host store.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass

import httpx

from server.common.cluster_auth import ROUTER_PROOF_HEADER, sign
from server.common.tenants import tenant_id
from server.index.redis_store import RedisKeys
from server.plugin.revive_rules import REVIVE_PATH
from tests.integration.helpers import (
    chat_body,
    client,
    empty_caches,
    pd_activity,
    reset_device_cache,
)
from tests.integration.replica_fixture import (
    CLUSTER,
    HOLD_TTL_S,
    KEY_A,
    KEY_B,
    MAX_TOKENS,
    SECRET,
    ReplicaCluster,
    conversation,
    metric,
    plain,
    remote_hits,
    stats,
    then,
    tokens_of,
    turn,
)
from tests.server_process import ServerProcess

#: Long enough for the holds of earlier tests (the other modules' too) to end.
RESET_WAIT_S = HOLD_TTL_S + 40


@dataclass(frozen=True)
class _Readings:
    """A's and B's counters before a turn B should pull by a revive of ``source``."""

    source: str
    served: float
    revived: float
    a_hits: dict
    b_turns: float
    b_remote: int


def _readings(a: ServerProcess, b: ServerProcess, source: str) -> _Readings:
    return _Readings(
        source,
        _counter(a, "kvbranch_peer_revives_total", "outcome", "served"),
        _revived_tokens(a),
        stats(a)["hits_tokens"],
        _counter(b, "kvbranch_peer_turns_total", "source", source),
        remote_hits(b),
    )


def _check_revived(a: ServerProcess, b: ServerProcess, before: _Readings, split: dict) -> None:
    """B pulled the turn's history by one revive of ``before.source``: A loaded the whole
    revived prefix from its host store and computed one token itself, and B pulled what A
    revived (and the one token A computed when B's prompt has it too)."""
    assert _counter(b, "kvbranch_peer_turns_total", "source", before.source) == (
        before.b_turns + 1
    ), f"B did not pull by a {before.source} revive"
    assert _counter(a, "kvbranch_peer_revives_total", "outcome", "served") == before.served + 1
    revived = _revived_tokens(a) - before.revived
    a_after = stats(a)["hits_tokens"]
    assert revived >= 1000, f"A revived {revived} tokens"
    assert a_after["host"] - before.a_hits["host"] == revived
    assert a_after["recomputed"] - before.a_hits["recomputed"] == 1
    assert a_after["device"] == before.a_hits["device"], "A's device cache was not empty"
    pulled = remote_hits(b) - before.b_remote
    print(f"A revived {revived} tokens ({before.source}) from its host store; B pulled {pulled}")
    assert revived <= pulled <= revived + 1, f"B pulled {pulled} of {revived} revived tokens"
    assert split.get("remote_hit_tokens") == pulled


def _counter(server: ServerProcess, name: str, label: str, value: str) -> float:
    return metric(server, name, label, value) or 0.0


def _revive(server: ServerProcess, session: str, key: str, signed: bool) -> httpx.Response:
    body = json.dumps({"session_id": session, "branch_id": "main"}).encode()
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    if signed:
        headers[ROUTER_PROOF_HEADER] = sign(SECRET.encode(), "POST", REVIVE_PATH, body)
    with httpx.Client(base_url=server.url, timeout=60) as c:
        return c.post(REVIVE_PATH, content=body, headers=headers)


def _drop_offer(replicas: ReplicaCluster, session: str) -> None:
    """Take the hold's offer out of the index, as the end of its TTL does (the session's home,
    where its last turn was served, stays)."""
    assert replicas.hold(session) is not None, "replica A filed no hold for turn 1"
    with replicas.redis_client() as r:
        assert r.delete(replicas.hold_key(session)) == 1


def test_a_turn_pulls_the_history_from_the_peers_host_store_after_its_hold_ended(
    replicas, plain_server
):
    a, b = replicas.replicas
    empty_caches(b, RESET_WAIT_S)
    session = "revive-" + secrets.token_hex(4)
    messages = conversation(seed=71)
    tokens, _, _ = turn(a, messages, session)
    assert tokens == plain(plain_server, messages)
    replicas.wait_holder(session)
    _drop_offer(replicas, session)
    reset_device_cache(a, RESET_WAIT_S)  # after A's own hold on the blocks has ended

    before = _readings(a, b, "revived")

    messages = then(messages, tokens, "The tool returned 42 records. Next?")
    mine, split, _ = turn(b, messages, session)
    assert mine == plain(plain_server, messages), "turn 2 differs from plain vLLM"
    _check_revived(a, b, before, split)


def _revived_tokens(server: ServerProcess) -> float:
    with client(server) as c:
        text = c.get("/metrics").text
    for row in text.splitlines():
        if row.startswith("kvbranch_peer_revived_tokens_total "):
            return float(row.split()[-1])
    raise AssertionError("no kvbranch_peer_revived_tokens_total on /metrics")


def test_a_revive_unsigned_for_another_tenant_or_not_in_the_store_runs_nothing(replicas):
    a, _ = replicas.replicas
    session = "revive-door-" + secrets.token_hex(4)
    turn(a, conversation(seed=72), session)
    replicas.wait_holder(session)
    activity = pd_activity(a)

    unsigned = _revive(a, session, KEY_A, signed=False)
    assert unsigned.status_code == 403, unsigned.text
    assert pd_activity(a) == activity

    unknown = _counter(a, "kvbranch_peer_revives_total", "outcome", "unknown")
    theirs = _revive(a, session, KEY_B, signed=True)  # tenant B names tenant A's session
    assert theirs.status_code == 404, theirs.text
    assert _counter(a, "kvbranch_peer_revives_total", "outcome", "unknown") == unknown + 1
    assert pd_activity(a) == activity

    # A's host store (and device cache) emptied: nothing to load, so nothing is computed.
    empty_caches(a, RESET_WAIT_S)
    activity = pd_activity(a)
    gone = _revive(a, session, KEY_A, signed=True)
    assert gone.status_code == 409, gone.text
    assert "host store" in gone.text
    assert pd_activity(a) == activity


# --- block-run revives: a turn A has no record of --------------------------------------------


def _fork_turn(server: ServerProcess, messages: list[dict], session: str, branch: str):
    body = chat_body(
        server, messages, session=session, branch=branch, max_tokens=MAX_TOKENS, logprobs=True
    )
    with client(server, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert "kv_transfer_params" not in answer, "a replica's handle reached the client"
    return tokens_of(answer), answer.get("kvbranch") or {}


def _prompt_ids(server: ServerProcess, messages: list[dict]) -> list[int]:
    """The chat prompt's token ids as ``server``'s vLLM renders them (its /tokenize route)."""
    body = {"model": server.model, "messages": messages, "add_generation_prompt": True}
    with client(server, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        r = c.post("/tokenize", json=body)
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def _generations(replicas: ReplicaCluster, server: ServerProcess) -> dict[str, int]:
    """The block generations of ``server``'s record in the index, per tier."""
    name = RedisKeys(CLUSTER).instance(replicas.instance_id(server))
    with replicas.redis_client() as r:
        fields = r.hgetall(name)
    return {k: int(fields.get(k.encode(), b"0")) for k in ("generation", "host_generation")}


def _probe_step(server: ServerProcess) -> None:
    """One short greedy turn of an unrelated prompt: an engine step on ``server``."""
    probe = [{"role": "system", "content": "Reset probe."}, {"role": "user", "content": "Hi"}]
    body = chat_body(server, probe, max_tokens=1)
    with client(server, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        assert c.post("/v1/chat/completions", json=body).status_code == 200


def _wait_until(probe, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not probe():
        assert time.monotonic() < deadline, "A's heartbeat never carried its device reset"
        time.sleep(0.2)


def _revive_run(
    server: ServerProcess, session: str, key: str, tokens: list[int], salt: str
) -> httpx.Response:
    body = json.dumps(
        {"session_id": session, "branch_id": "run", "token_ids": tokens, "cache_salt": salt}
    ).encode()
    headers = {
        "content-type": "application/json",
        "authorization": f"Bearer {key}",
        ROUTER_PROOF_HEADER: sign(SECRET.encode(), "POST", REVIVE_PATH, body),
    }
    with httpx.Client(base_url=server.url, timeout=60) as c:
        return c.post(REVIVE_PATH, content=body, headers=headers)


def test_a_forks_first_turn_pulls_the_longest_host_run_by_block_run_revive(replicas, plain_server):
    a, b = replicas.replicas
    empty_caches(b, RESET_WAIT_S)
    session = "run-" + secrets.token_hex(4)
    messages = conversation(seed=73)
    tokens, _, _ = turn(a, messages, session)
    assert tokens == plain(plain_server, messages)
    replicas.wait_holder(session)
    generations = _generations(replicas, a)
    reset_device_cache(a, RESET_WAIT_S)  # A's hold on turn 1 ended; its host store keeps it
    # vLLM publishes the reset's event with its next step's events: one short, unrelated turn
    # on A, then A's next heartbeat carries the reset. Its device tier's entries are hidden
    # from then on, its host tier's are not (they would be, were the generation the instance's).
    _probe_step(a)
    _wait_until(lambda: _generations(replicas, a)["generation"] > generations["generation"])
    assert _generations(replicas, a)["host_generation"] == generations["host_generation"]

    before = _readings(a, b, "revived_run")

    fork = then(messages, tokens, "Pick another tool than that one. Which?")
    mine, split = _fork_turn(b, fork, session, "fork-" + secrets.token_hex(3))
    assert mine == plain(plain_server, fork), "the fork's first turn differs from plain vLLM"
    _check_revived(a, b, before, split)


def test_a_block_run_revive_of_other_token_ids_or_another_tenants_salt_runs_nothing(replicas):
    a, _ = replicas.replicas
    session = "run-door-" + secrets.token_hex(4)
    messages = conversation(seed=74)
    turn(a, messages, session)
    replicas.wait_holder(session)
    ids = _prompt_ids(a, messages)
    salt_a = tenant_id(KEY_A)  # tenant A's requests' cache salt (no client salt)
    activity = pd_activity(a)

    refused = _counter(a, "kvbranch_peer_revives_total", "outcome", "not_covered")
    edited = [ids[0], (ids[1] + 1) % 1000, *ids[2:]]  # one token of the first block changed
    other = _revive_run(a, session, KEY_A, edited, salt_a)
    assert other.status_code == 409, other.text
    assert "host store" in other.text
    assert _counter(a, "kvbranch_peer_revives_total", "outcome", "not_covered") == refused + 1
    assert pd_activity(a) == activity

    theirs = _revive_run(a, session, KEY_B, ids, salt_a)  # tenant B names tenant A's salt
    assert theirs.status_code == 403, theirs.text
    own_salt = _revive_run(a, session, KEY_B, ids, tenant_id(KEY_B))  # B's own: A's not found
    assert own_salt.status_code == 409, own_salt.text
    assert pd_activity(a) == activity
