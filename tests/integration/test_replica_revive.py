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
"""

from __future__ import annotations

import json
import secrets
import time

import httpx

from server.common.cluster_auth import ROUTER_PROOF_HEADER, sign
from server.common.tenants import tenant_id
from server.plugin.revive_rules import REVIVE_PATH
from tests.integration.helpers import chat_body, client, empty_caches, pd_activity
from tests.integration.replica_fixture import (
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


def _empty_device(server: ServerProcess, wait_s: float) -> None:
    """Drop vLLM's device prefix cache only: kvbranch's host store keeps what it has. Refused
    while a hold keeps blocks in use: retried until the holds have ended."""
    deadline = time.monotonic() + wait_s
    with client(server) as c:
        while True:
            r = c.post("/reset_prefix_cache")
            if r.json().get("success"):
                return
            if time.monotonic() > deadline:
                break
            time.sleep(0.5)
    raise AssertionError(f"{server.name}'s device prefix cache could not be reset")


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
    messages = conversation(seed=51)
    tokens, _, _ = turn(a, messages, session)
    assert tokens == plain(plain_server, messages)
    replicas.wait_holder(session)
    _drop_offer(replicas, session)
    _empty_device(a, RESET_WAIT_S)  # after A's own hold on the blocks has ended

    served_before = _counter(a, "kvbranch_peer_revives_total", "outcome", "served")
    revived_before = _revived_tokens(a)
    a_hits = stats(a)["hits_tokens"]
    revived_turns_before = _counter(b, "kvbranch_peer_turns_total", "source", "revived")
    remote_before = remote_hits(b)

    messages = then(messages, tokens, "The tool returned 42 records. Next?")
    mine, split, _ = turn(b, messages, session)
    assert mine == plain(plain_server, messages), "turn 2 differs from plain vLLM"

    assert _counter(a, "kvbranch_peer_revives_total", "outcome", "served") == served_before + 1
    revived = _revived_tokens(a) - revived_before
    a_after = stats(a)["hits_tokens"]
    # A loaded the whole revived prefix from its host store and computed one token itself.
    assert revived >= 1000, f"A revived {revived} tokens"
    assert a_after["host"] - a_hits["host"] == revived
    assert a_after["recomputed"] - a_hits["recomputed"] == 1
    assert a_after["device"] == a_hits["device"], "A's device cache was not empty"
    # B pulled what A revived (and the one token A computed when B's prompt has it too).
    pulled = remote_hits(b) - remote_before
    assert _counter(b, "kvbranch_peer_turns_total", "source", "revived") == (
        revived_turns_before + 1
    )
    print(f"A revived {revived} tokens from its host store; B pulled {pulled}")
    assert revived <= pulled <= revived + 1, f"B pulled {pulled} of {revived} revived tokens"
    assert split.get("remote_hit_tokens") == pulled


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
    turn(a, conversation(seed=52), session)
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
    messages = conversation(seed=53)
    tokens, _, _ = turn(a, messages, session)
    assert tokens == plain(plain_server, messages)
    replicas.wait_holder(session)
    _empty_device(a, RESET_WAIT_S)  # A's hold on turn 1 ended; its host store keeps it

    served_before = _counter(a, "kvbranch_peer_revives_total", "outcome", "served")
    revived_before = _revived_tokens(a)
    a_hits = stats(a)["hits_tokens"]
    run_turns_before = _counter(b, "kvbranch_peer_turns_total", "source", "revived_run")
    remote_before = remote_hits(b)

    fork = then(messages, tokens, "Pick another tool than that one. Which?")
    mine, split = _fork_turn(b, fork, session, "fork-" + secrets.token_hex(3))
    assert mine == plain(plain_server, fork), "the fork's first turn differs from plain vLLM"

    assert _counter(b, "kvbranch_peer_turns_total", "source", "revived_run") == (
        run_turns_before + 1
    ), "B did not pull by a block-run revive"
    assert _counter(a, "kvbranch_peer_revives_total", "outcome", "served") == served_before + 1
    revived = _revived_tokens(a) - revived_before
    a_after = stats(a)["hits_tokens"]
    assert revived >= 1000, f"A revived {revived} tokens"
    assert a_after["host"] - a_hits["host"] == revived
    assert a_after["recomputed"] - a_hits["recomputed"] == 1
    assert a_after["device"] == a_hits["device"], "A's device cache was not empty"
    pulled = remote_hits(b) - remote_before
    print(f"A revived {revived} tokens of the fork's prompt from its host store; B pulled {pulled}")
    assert revived <= pulled <= revived + 1, f"B pulled {pulled} of {revived} revived tokens"
    assert split.get("remote_hit_tokens") == pulled


def test_a_block_run_revive_of_other_token_ids_or_another_tenants_salt_runs_nothing(replicas):
    a, _ = replicas.replicas
    session = "run-door-" + secrets.token_hex(4)
    messages = conversation(seed=54)
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
