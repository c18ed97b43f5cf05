"""Aggregated replicas pull a session's history from the replica that holds it: two real
instances (``--role single --index redis://…``, each on its own core, NIXL over UCX on
loopback) and a real Redis, the cluster :mod:`tests.integration.replica_fixture` sets up (its
router takes no part here) — each turn is sent straight to a replica, as a Kubernetes Service or
round robin would send it.

Every answer is compared with plain vLLM's (greedy, token for token, logprobs). The replica a
turn lands on has its device cache *and* host store emptied first, so the pull from the other
replica is the only source of the history: wrong KV would show as a different answer.
"""

from __future__ import annotations

import json
import secrets
import time

from tests.integration.cluster_fixture import sigkill
from tests.integration.helpers import chat_body, client, empty_caches, system_prompt
from tests.integration.replica_fixture import (
    HOLD_TTL_S,
    KEY_A,
    KEY_B,
    MAX_TOKENS,
    SECRET,
    ReplicaCluster,
    Tokens,
    conversation,
    metric,
    plain,
    remote_hits,
    stats,
    then,
    turn,
)
from tests.integration.test_nixl_side_channel import check_side_channel
from tests.server_process import ServerProcess

#: Long enough for the holds of earlier tests (the router's module's too) to end.
RESET_WAIT_S = HOLD_TTL_S + 40


def _pair(replicas: ReplicaCluster) -> tuple[ServerProcess, ServerProcess]:
    """(where a conversation starts, where its next turn goes), the second emptied already:
    the one holding fewer turns of earlier tests, once those holds ended."""
    a, b = replicas.replicas
    if stats(a)["pd"]["holds"] < stats(b)["pd"]["holds"]:
        a, b = b, a
    empty_caches(b, RESET_WAIT_S)
    return a, b


def _peer_turns(server, source: str) -> float:
    value = metric(server, "kvbranch_peer_turns_total", "source", source)
    assert value is not None, f'no kvbranch_peer_turns_total{{source="{source}"}} on /metrics'
    return value


def _sync_reads(server) -> tuple[int, int]:
    """Synchronous pulls, and those the workers reported not landed."""
    pd = stats(server)["pd"]
    return int(pd["sync_reads"]), int(pd["sync_reads_not_landed"])


def _peer_index_errors(server, op: str) -> float:
    return metric(server, "kvbranch_peer_index_errors_total", "op", op) or 0.0


def test_each_turn_pulls_its_history_from_the_other_replica(replicas, plain_server):
    a, b = _pair(replicas)
    session = "agg-" + secrets.token_hex(4)
    messages = conversation(seed=41)
    tokens, _, _ = turn(a, messages, session)
    assert tokens == plain(plain_server, messages)
    for step, (here, user) in enumerate(
        [(b, "The tool returned 42 records. Next?"), (a, "Price 17. Summarize."), (b, "Risk?")]
    ):
        messages = then(messages, tokens, user)
        empty_caches(here, RESET_WAIT_S)
        remote_before, sync_before = remote_hits(here), _sync_reads(here)
        tokens, split, _ = turn(here, messages, session)
        assert tokens == plain(plain_server, messages), f"turn {step + 2} differs"
        pulled = remote_hits(here) - remote_before
        assert pulled >= 400, f"turn {step + 2} pulled {pulled} tokens from the peer"
        assert split.get("remote_hit_tokens", pulled) >= 400
        # Loaded before the forward that computed the rest (server/connector/pd/sync_reads.py),
        # and the workers reported it landed.
        assert _sync_reads(here) == (sync_before[0] + 1, sync_before[1])


def test_a_history_that_diverges_pulls_only_the_common_prefix(replicas, plain_server):
    a, b = _pair(replicas)
    session = "div-" + secrets.token_hex(4)
    messages = conversation(seed=42)
    tokens, _, _ = turn(a, messages, session)
    edited = then(messages, tokens, "Answer again.")
    edited[1] = dict(edited[1], content="Which tool should run LAST? Answer briefly.")
    remote_before = remote_hits(b)
    mine, _, _ = turn(b, edited, session)
    assert mine == plain(plain_server, edited)
    pulled = remote_hits(b) - remote_before
    assert 0 < pulled < len(system_prompt(words=400, seed=42)), pulled


def test_another_tenant_with_the_same_session_id_pulls_nothing(replicas, plain_server):
    """Tenant B names tenant A's session: the index keys holds by tenant, so B's turn finds no
    hold (and a handle would fail the identity check anyway: its cache salt is A's)."""
    a, b = _pair(replicas)
    session = "tenant-" + secrets.token_hex(4)
    messages = conversation(seed=47)
    tokens, _, _ = turn(a, messages, session)
    messages = then(messages, tokens, "Next?")
    remote_before = remote_hits(b)
    claims_before = _peer_turns(b, "peer")
    theirs, _, _ = turn(b, messages, session, key=KEY_B)
    assert theirs == plain(plain_server, messages)
    assert _peer_turns(b, "peer") == claims_before, "tenant B's turn claimed tenant A's hold"
    assert remote_hits(b) == remote_before, "tenant B pulled A's KV"
    # A's own next turn still finds A's hold and pulls it.
    mine, _, _ = turn(b, messages, session)
    assert mine == plain(plain_server, messages)
    assert remote_hits(b) - remote_before >= 400


def _streamed(server: ServerProcess, messages: list[dict], session: str) -> Tokens:
    """One greedy streamed turn at a replica (the cost model measures streamed turns only:
    their first event is their first token), its tokens and logprobs read from the events."""
    body = chat_body(
        server, messages, session=session, max_tokens=MAX_TOKENS, logprobs=True, stream=True
    )
    out = Tokens()
    with client(server, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices") or []:
                    content = (choice.get("logprobs") or {}).get("content") or []
                    out.extend((t["token"], t["logprob"]) for t in content)
    return out


def _pull_cost(server: ServerProcess) -> dict[str, float]:
    """The replica's pull cost rows on ``/metrics`` (``kvbranch_peer_pull_*``), by whole name."""
    with client(server) as c:
        text = c.get("/metrics").text
    rows = (row.rsplit(" ", 1) for row in text.splitlines() if row.startswith("kvbranch_peer_pull"))
    return {name: float(value) for name, value in rows}


def test_streamed_turns_measure_the_prefill_and_the_link_the_pull_decision_uses(
    replicas, plain_server
):
    a, b = _pair(replicas)
    session = "cost-" + secrets.token_hex(4)
    messages = conversation(seed=48)
    prefill = 'kvbranch_peer_pull_samples_total{what="prefill"}'
    hold = 'kvbranch_peer_pull_samples_total{what="hold"}'
    pulled = 'kvbranch_peer_pull_decisions_total{decision="pull",path="hold"}'
    link = 'kvbranch_peer_pull_link_tokens_per_second{kind="hold"}'
    a_before = _pull_cost(a)
    tokens = _streamed(a, messages, session)
    assert tokens == plain(plain_server, messages)
    assert _pull_cost(a)[prefill] == a_before[prefill] + 1, "a cold turn measured no prefill"
    messages = then(messages, tokens, "The tool returned 42 records. Next?")
    b_before, remote_before = _pull_cost(b), remote_hits(b)
    assert _streamed(b, messages, session) == plain(plain_server, messages)
    assert remote_hits(b) - remote_before >= 400
    b_after = _pull_cost(b)
    assert b_after[pulled] == b_before[pulled] + 1, "the hold's pull was not decided"
    assert b_after[hold] == b_before[hold] + 1, "the pull's link was not measured"
    assert b_after[link] != b_before[link], (b_before[link], b_after[link])


def test_a_client_cannot_name_a_peer_or_skip_the_checks(replicas):
    a, _ = replicas.replicas
    body = chat_body(a, conversation(seed=43), session="evil", max_tokens=2)
    body["kv_transfer_params"] = {
        "do_remote_decode": True,
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [[0, 1, 2]],
    }
    with client(a) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 403, r.text
    assert "kv_transfer_params" in r.text


def test_a_tampered_hold_in_the_index_costs_a_recompute_not_an_answer(replicas, plain_server):
    """Whoever writes Redis may edit a hold; the replica that takes it pulls nothing it cannot
    verify: here the hold's block ids are moved by one, under a valid AES-GCM envelope, so the
    issuer's seal over them fails and the turn recomputes with plain vLLM's answer."""
    a, b = _pair(replicas)
    session = "tamper-" + secrets.token_hex(4)
    messages = conversation(seed=44)
    tokens, _, _ = turn(a, messages, session)
    assert replicas.hold(session) is not None, "replica A filed no hold for the turn it served"

    def shift(hold) -> None:
        ids = hold.params["remote_block_ids"]
        hold.params["remote_block_ids"] = [[i + 1 for i in ids[0]]]

    replicas.edit_hold(session, shift)
    messages = then(messages, tokens, "Next?")
    remote_before = remote_hits(b)
    refused_before = _peer_turns(b, "claim_refused")
    mine, _, _ = turn(b, messages, session)
    assert mine == plain(plain_server, messages)
    assert remote_hits(b) == remote_before
    # The issuer refused to claim a handle whose seal fails: B never contacted its NIXL side.
    assert _peer_turns(b, "claim_refused") == refused_before + 1


def test_a_replicas_nixl_side_channel_serves_only_the_cluster(replicas):
    """The pull's other door: a non-member on a replica's NIXL port gets nothing."""
    for server in replicas.replicas:
        port = server.args[server.args.index("--nixl-port") + 1]
        check_side_channel(f"tcp://127.0.0.1:{port}", SECRET)


def _branch(server: ServerProcess, session: str, key: str = KEY_A) -> dict:
    """The replica's view of the session's main branch ({} when it has none)."""
    with client(server, headers={"Authorization": f"Bearer {key}"}) as c:
        r = c.get(f"/v1/kvbranch/sessions/{session}/branches/main")
    return r.json() if r.status_code == 200 else {}


def _pins_followed(server: ServerProcess) -> float:
    with client(server) as c:
        rows = c.get("/metrics").text.splitlines()
    name = "kvbranch_peer_pins_followed_total "
    return next((float(r.split()[-1]) for r in rows if r.startswith(name)), 0.0)


def test_a_pin_follows_its_branch_to_the_replica_a_plain_front_sent_its_turn_to(replicas):
    """Pinned on A for longer than a session turn's own lease (300 s), the branch's next turn
    goes straight to B (a plain front tells no one): once B has answered it, B pins the branch
    for what was left of A's lease. Another tenant naming the same session id takes no pin
    over (its branch has the turn's own lease only)."""
    a, b = replicas.replicas
    session = "pin-" + secrets.token_hex(4)
    messages = conversation(seed=53)
    tokens, _, _ = turn(a, messages, session)
    with client(a, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        r = c.post(f"/v1/kvbranch/sessions/{session}/branches/main/pin", json={"ttl_s": 1800})
    assert r.status_code == 200 and r.json()["pinned"], r.text
    before = _pins_followed(b)
    turn(b, then(messages, tokens, "Next?"), session)
    deadline = time.monotonic() + 15
    while _pins_followed(b) == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pins_followed(b) == before + 1
    info = _branch(b, session)
    assert info.get("pinned") and 1700 < info["pin_expires_in_s"] <= 1800, info
    turn(a, then(messages, tokens, "Next?"), session, key=KEY_B)
    assert (_branch(a, session, key=KEY_B).get("pin_expires_in_s") or 0) <= 300


def test_each_replica_logs_in_vllms_format_that_its_peer_pulls_are_on(replicas):
    """kvbranch's info lines reach the log through vLLM's handler (server/common/logs.py)."""
    for server in replicas.replicas:
        lines = server.log_tail(20000, ("kvbranch peer pulls on",))
        assert "INFO" in lines and "[peer_pull.py:" in lines, lines or server.log_tail(40)


# --- last: these stop Redis and a replica (the next test's ``replicas`` mends the cluster) ---
def test_the_index_down_costs_a_recompute_never_the_turn(replicas, plain_server):
    a, b = _pair(replicas)
    messages = conversation(seed=45)
    session = "down-" + secrets.token_hex(4)
    tokens, _, _ = turn(a, messages, session)
    replicas.redis.stop()
    try:
        messages = then(messages, tokens, "Next?")
        mine, _, _ = turn(b, messages, session)
        assert mine == plain(plain_server, messages)
    finally:
        replicas.redis.start()
    assert _peer_index_errors(b, "begin_turn") >= 1


def test_a_peer_killed_between_turns_costs_a_recompute(replicas, plain_server):
    # ``replicas`` waited until both are back in the index Redis restarted empty: B will try A
    a, b = _pair(replicas)
    messages = conversation(seed=46)
    session = "kill-" + secrets.token_hex(4)
    tokens, _, _ = turn(a, messages, session)
    sigkill(a)  # a crash: its record stays listed until its heartbeat's TTL ends
    messages = then(messages, tokens, "Next?")
    refused_before = _peer_turns(b, "claim_refused")
    mine, _, _ = turn(b, messages, session)
    assert mine == plain(plain_server, messages)
    assert _peer_turns(b, "claim_refused") == refused_before + 1
