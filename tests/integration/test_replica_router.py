"""Our router in front of aggregated replicas, all real: a Redis, two replicas (``--role single
--index redis://…``, each on its own core, NIXL over UCX on loopback) and a router started with
``--replica`` seeds and the same index — the cluster :mod:`tests.integration.replica_fixture`
sets up, shared with test_replicas.

The router keeps a session on the replica whose hold the index names (the hold the replica
filed itself: the router only reads it), moves the session when that replica is overloaded — the
new replica pulls the history from the old one — or gone — the new one recomputes. Every answer
is compared with plain vLLM's, greedy, token for token with logprobs. The kill test runs last:
it SIGKILLs a replica mid-turn (the next test's ``replicas`` starts it again).
"""

from __future__ import annotations

import secrets
import threading
import time

from sdk.contract import session_path
from server.index.redis_store import RedisKeys, digest
from server.router.replicas import LOAD_MARGIN
from tests.integration.cluster_fixture import sigkill
from tests.integration.helpers import chat_body, client
from tests.integration.replica_fixture import (
    CLUSTER,
    KEY_A,
    ROUTE,
    TENANT_A,
    ReplicaCluster,
    conversation,
    plain,
    remote_hits,
    then,
    tokens_of,
    turn,
    wait_for,
)
from tests.server_process import ServerProcess


def test_a_session_stays_on_the_replica_that_holds_it(replicas, plain_server):
    session = "stay-" + secrets.token_hex(4)
    messages = conversation(seed=51)
    tokens, _, route = turn(replicas.router, messages, session)
    first = replicas.wait_holder(session)
    assert route == "replica" and tokens == plain(plain_server, messages)
    pulled = {s.url: remote_hits(s) for s in replicas.replicas}
    for user in ("The tool returned 42 records. Next?", "Price 17. Summarize."):
        messages = then(messages, tokens, user)
        tokens, _, route = turn(replicas.router, messages, session)
        assert route == "replica" and replicas.wait_holder(session) is first
        assert tokens == plain(plain_server, messages)
    # It never left the replica that had its history: nothing was pulled anywhere.
    assert {s.url: remote_hits(s) for s in replicas.replicas} == pulled


def test_the_hold_decides_over_a_stale_home(replicas, plain_server):
    session = "home-" + secrets.token_hex(4)
    messages = conversation(seed=52)
    tokens, _, _ = turn(replicas.router, messages, session)
    first = replicas.wait_holder(session)
    other = next(s for s in replicas.replicas if s is not first)
    replicas.set_home(session, other)  # as if another router had last sent it there
    messages = then(messages, tokens, "Next?")
    tokens, _, route = turn(replicas.router, messages, session)
    assert route == "replica" and replicas.wait_holder(session) is first
    assert tokens == plain(plain_server, messages)


def _busy(c: ReplicaCluster, server: ServerProcess, n: int) -> list[threading.Thread]:
    """``n`` long streamed answers on ``server``, through the router (sessions whose home is
    ``server``), each started before this returns: the router counts them in flight there."""
    started = threading.Barrier(n + 1)
    threads = []
    for i in range(n):
        session = f"busy-{i}-" + secrets.token_hex(4)
        c.set_home(session, server)
        short = [{"role": "user", "content": f"Count from {i} to a thousand."}]  # quick prefill
        body = chat_body(c.router, short, session=session, max_tokens=400)
        body.update(stream=True, ignore_eos=True)

        def run(body: dict = body) -> None:
            with (
                client(c.router) as http,
                http.stream("POST", "/v1/chat/completions", json=body) as r,
            ):
                assert r.headers[ROUTE] == "replica"
                started.wait()
                for _ in r.iter_bytes():
                    pass

        threads.append(threading.Thread(target=run, daemon=True))
        threads[-1].start()
    started.wait(timeout=300)
    return threads


def _pinned(server: ServerProcess, branch: str) -> bool:
    """Whether ``server`` (a replica) has the branch under the client's 600 s pin, read as
    tenant A: more than 400 s left, which the session's automatic pin of each used branch
    (the replicas' default ``--pin-ttl-s``, 300 s) never gives."""
    with client(server, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        r = c.get(branch)
    if r.status_code != 200:
        return False
    info = r.json()
    return info["pinned"] is True and (info["pin_expires_in_s"] or 0) > 400


def test_an_overloaded_holder_hands_the_session_over_and_the_history_is_pulled(
    replicas, plain_server
):
    session = "busy-holder-" + secrets.token_hex(4)
    messages = conversation(seed=53)
    tokens, _, _ = turn(replicas.router, messages, session)
    first = replicas.wait_holder(session)
    other = next(s for s in replicas.replicas if s is not first)
    # the client pins the branch (through the router: it lands where the session is)
    branch = f"/v1/kvbranch/sessions/{session}/branches/main"
    with client(replicas.router, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        assert c.post(branch + "/pin", json={"ttl_s": 600}).status_code == 200
    assert not _pinned(other, branch)
    threads = _busy(replicas, first, LOAD_MARGIN + 1)
    before = remote_hits(other)
    messages = then(messages, tokens, "The tool returned 42 records. Next?")
    tokens, _, route = turn(replicas.router, messages, session)
    assert route == "replica-moved"
    assert replicas.wait_holder(session) is other  # read first: holds expire
    assert remote_hits(other) - before >= 400  # a move costs a pull, not a recompute
    assert tokens == plain(plain_server, messages)
    # the pin followed the branch to the replica it moved to (after the answer, off its path)
    wait_for("the pin on the new replica", lambda: _pinned(other, branch), 30)
    for thread in threads:
        thread.join(timeout=600)


def _running(server: ServerProcess) -> float:
    """Requests the replica's engine is running now (vLLM's gauge)."""
    with client(server) as c:
        text = c.get("/metrics").text
    rows = [r for r in text.splitlines() if r.startswith("vllm:num_requests_running{")]
    return sum(float(r.split()[-1]) for r in rows)


def _long_turn(server: ServerProcess, messages: list[dict], session: str | None = None) -> dict:
    """A greedy turn of exactly :data:`LONG` tokens (long enough to be killed mid-way): its
    status, answer (None unless 200) and route."""
    body = chat_body(
        server, messages, session=session, max_tokens=LONG, min_tokens=LONG, logprobs=True
    )
    with client(server, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        r = c.post("/v1/chat/completions", json=body)
    answer = r.json() if r.status_code == 200 else None
    status = (r.status_code, r.text[:300])
    return {"status": status, "answer": answer, "route": r.headers.get(ROUTE)}


#: Tokens of the turn killed mid-way: seconds of decoding on one core.
LONG = 256


def test_a_holder_killed_mid_turn_loses_no_turn_and_moves_the_session(replicas, plain_server):
    session = "dead-" + secrets.token_hex(4)
    messages = conversation(seed=54)
    tokens, _, _ = turn(replicas.router, messages, session)
    first = replicas.wait_holder(session)
    other = next(s for s in replicas.replicas if s is not first)
    messages = then(messages, tokens, "Next? Explain each step.")
    # The holder takes the turn and is SIGKILLed while decoding it: the router, whose client
    # has seen nothing yet, sends the turn once more, to the other replica (which recomputes:
    # the holder is gone), and the client gets plain vLLM's answer.
    result: dict = {}
    sent = threading.Thread(
        target=lambda: result.update(_long_turn(replicas.router, messages, session))
    )
    sent.start()
    deadline = time.monotonic() + 120
    while _running(first) < 1:
        assert time.monotonic() < deadline, "the turn never ran on its holder"
        time.sleep(0.05)
    sigkill(first)
    sent.join(timeout=600)
    assert result and result["status"][0] == 200, result.get("status", "the turn got no answer")
    assert result["route"] == "replica-moved"
    assert replicas.wait_holder(session) is other
    tokens = tokens_of(result["answer"])
    reference = _long_turn(plain_server, messages)
    assert reference["answer"] is not None, reference["status"]
    assert tokens == tokens_of(reference["answer"])
    assert len(tokens) == LONG
    # Forked while the first replica is down: made where it can be, the missed replica named
    # (it makes the branch at a first turn there), and the branch's turn answers right.
    with client(replicas.router, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        r = c.post(session_path(session) + "/branches", json={"parent": "main", "branch_id": "alt"})
    assert r.status_code == 201, r.text
    assert r.json()["unreachable"] == [{"url": first.url, "role": "both"}]
    forked = then(messages, tokens, "Try the other tool instead.")
    fork_tokens, _, _ = turn(replicas.router, forked, session, branch="alt")
    assert fork_tokens == plain(plain_server, forked)
    # Deleted while the first replica is still down: the router answers for the replica it
    # reaches (never a 5xx for the one it cannot), names the one it could not, and the index
    # forgets the session, so no turn or peer is sent to what the first one kept of it.
    with client(replicas.router, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        r = c.delete(session_path(session))
    assert r.status_code == 200, r.text
    assert r.json()["unreachable"] == [{"url": first.url, "role": "both"}]
    assert replicas.hold(session) is None
    with replicas.redis_client() as redis:
        assert not redis.exists(RedisKeys(CLUSTER).session(digest(TENANT_A, session)))
    with client(other, headers={"Authorization": f"Bearer {KEY_A}"}) as c:
        assert c.get(session_path(session)).status_code == 404
