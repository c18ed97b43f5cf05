"""Aggregated replicas pull a session's history from the replica that holds it: two real
instances (``--role single --index redis://…``, each on its own core, NIXL over UCX on
loopback), a real Redis, no router in front — each turn is sent straight to a replica, as a
Kubernetes Service or round robin would send it.

Every answer is compared with plain vLLM's (greedy, token for token, logprobs). The replica a
turn lands on has its device cache *and* host store emptied first, so the pull from the other
replica is the only source of the history: wrong KV would show as a different answer.
"""

from __future__ import annotations

import os
import secrets
import time

import httpx

from server.common.tenants import scope_of
from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
from server.index.hold_cipher import HoldCipher
from server.index.redis_store import RedisKeys, decode_hold, digest, encode_hold
from server.launcher.process import free_port
from tests import prestart
from tests.integration.cluster_fixture import sigkill
from tests.integration.helpers import chat_body, client, size_args, system_prompt
from tests.integration.test_nixl_side_channel import check_side_channel
from tests.prestart import BIND_ENV
from tests.redis_server import RedisServer
from tests.server_process import ServerProcess

SECRET = secrets.token_hex(32)
#: Holds end 30 s after a turn unless pulled (offered 25 s): a test empties a replica by waiting
#: for its holds from earlier tests to end (a held turn's blocks cannot be reset away).
HOLD_TTL_S = 30
#: Two tenants: every request names one (the first is the servers' own, which helpers use).
KEY_A = "replica-tenant-a-" + secrets.token_hex(8)
KEY_B = "replica-tenant-b-" + secrets.token_hex(8)
TENANT_A = scope_of(f"Bearer {KEY_A}")
ARGS = [
    *size_args(0.25, 0.25, 4096),
    "--pd-hold-ttl-s",
    str(HOLD_TTL_S),
    *("--api-key", KEY_A, "--api-key", KEY_B),
]
MAX_TOKENS = 12


class Replicas:
    """Redis and two replicas sharing it, the cluster secret and one PYTHONHASHSEED: one
    process for :mod:`tests.prestart` (launched ahead of the module, two engines)."""

    engines = 2  # what tests.prestart counts against the memory budget

    def __init__(self) -> None:
        self.redis = RedisServer()
        env = {ENV_CLUSTER_SECRET: SECRET, "PYTHONHASHSEED": "0"}
        cores = os.environ.get(BIND_ENV)
        self.replicas = [
            ServerProcess(
                [
                    *ARGS,
                    "--index",
                    self.redis.url,
                    "--cpu-cores",
                    cores or core,
                    "--nixl-port",
                    str(free_port()),
                ],
                name=f"replica-{core}",
                ready_timeout=900,
                env=env,
            )
            for core in ("0", "1")
        ]

    def launch(self) -> None:
        self.redis.start()
        for server in self.replicas:
            server.launch()

    def wait_ready(self) -> None:
        for server in self.replicas:
            server.wait_ready()
        _wait_listed(self, len(self.replicas))

    def stop(self) -> None:
        for server in self.replicas:
            server.stop()
        self.redis.stop()


replicas = prestart.fixture("replicas", lambda: (Replicas(),), scope="module", engines=2)


def _wait_listed(cluster: Replicas, n: int, timeout_s: float = 60.0) -> None:
    """Both replicas' heartbeats are in the index (a peer is pulled from only once listed)."""
    import redis

    r = redis.Redis(unix_socket_path=str(cluster.redis.socket))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if len(list(r.scan_iter(match="*:inst:*"))) >= n:
            return
        time.sleep(0.5)
    raise AssertionError("the replicas never appeared in the index")


def _turn(
    server, messages, session, key: str = KEY_A
) -> tuple[list[tuple[str, float]], dict, dict]:
    """(greedy tokens with logprobs, the kvbranch split, the whole answer), as ``key``'s
    tenant."""
    body = chat_body(server, messages, session=session, max_tokens=MAX_TOKENS, logprobs=True)
    with client(server, headers={"Authorization": f"Bearer {key}"}) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    data = r.json()
    assert "kv_transfer_params" not in data, "a replica's handle reached the client"
    tokens = [
        (t["token"], round(t["logprob"], 3)) for t in data["choices"][0]["logprobs"]["content"]
    ]
    return tokens, data.get("kvbranch") or {}, data


def _plain(plain_server, messages) -> list[tuple[str, float]]:
    body = chat_body(plain_server, messages, max_tokens=MAX_TOKENS, logprobs=True)
    r = httpx.post(f"{plain_server.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return [
        (t["token"], round(t["logprob"], 3)) for t in r.json()["choices"][0]["logprobs"]["content"]
    ]


def _empty_caches(server) -> None:
    """Device prefix cache and host store emptied: only a pull can bring the history."""
    with client(server) as c:
        for _ in range(5 * (HOLD_TTL_S + 40)):  # a held turn's blocks stay until pulled or ended
            r = c.post("/reset_prefix_cache", params={"reset_external": "true"})
            if r.json().get("success"):
                return
            time.sleep(0.2)
    raise AssertionError("the prefix cache could not be reset")


def _stats(server) -> dict:
    with client(server) as c:
        r = c.get("/v1/kvbranch/stats")
    assert r.status_code == 200, r.text
    return r.json()


def _pair(replicas: Replicas) -> tuple[ServerProcess, ServerProcess]:
    """(where a conversation starts, where its next turn goes), the second emptied already:
    the one holding fewer turns of earlier tests, once those holds ended."""
    a, b = replicas.replicas
    if _stats(a)["pd"]["holds"] < _stats(b)["pd"]["holds"]:
        a, b = b, a
    _empty_caches(b)
    return a, b


def _conversation(seed: int) -> list[dict]:
    return [
        {"role": "system", "content": system_prompt(words=400, seed=seed)},
        {"role": "user", "content": "Which tool should run first? Answer briefly."},
    ]


def _next(messages: list[dict], tokens: list[tuple[str, float]], user: str) -> list[dict]:
    reply = "".join(t for t, _ in tokens)
    return [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": user}]


def test_each_turn_pulls_its_history_from_the_other_replica(replicas, plain_server):
    a, b = _pair(replicas)
    session = "agg-" + secrets.token_hex(4)
    messages = _conversation(seed=41)
    tokens, _, _ = _turn(a, messages, session)
    assert tokens == _plain(plain_server, messages)
    for step, (here, user) in enumerate(
        [(b, "The tool returned 42 records. Next?"), (a, "Price 17. Summarize."), (b, "Risk?")]
    ):
        messages = _next(messages, tokens, user)
        _empty_caches(here)
        remote_before = _stats(here)["hits_tokens"]["remote"]
        tokens, split, _ = _turn(here, messages, session)
        assert tokens == _plain(plain_server, messages), f"turn {step + 2} differs"
        pulled = _stats(here)["hits_tokens"]["remote"] - remote_before
        assert pulled >= 400, f"turn {step + 2} pulled {pulled} tokens from the peer"
        assert split.get("remote_hit_tokens", pulled) >= 400


def test_a_history_that_diverges_pulls_only_the_common_prefix(replicas, plain_server):
    a, b = _pair(replicas)
    session = "div-" + secrets.token_hex(4)
    messages = _conversation(seed=42)
    tokens, _, _ = _turn(a, messages, session)
    edited = _next(messages, tokens, "Answer again.")
    edited[1] = dict(edited[1], content="Which tool should run LAST? Answer briefly.")
    remote_before = _stats(b)["hits_tokens"]["remote"]
    mine, _, _ = _turn(b, edited, session)
    assert mine == _plain(plain_server, edited)
    pulled = _stats(b)["hits_tokens"]["remote"] - remote_before
    assert 0 < pulled < len(system_prompt(words=400, seed=42)), pulled


def test_another_tenant_with_the_same_session_id_pulls_nothing(replicas, plain_server):
    """Tenant B names tenant A's session: the index keys holds by tenant, so B's turn finds no
    hold (and a handle would fail the identity check anyway: its cache salt is A's)."""
    a, b = _pair(replicas)
    session = "tenant-" + secrets.token_hex(4)
    messages = _conversation(seed=47)
    tokens, _, _ = _turn(a, messages, session)
    messages = _next(messages, tokens, "Next?")
    remote_before = _stats(b)["hits_tokens"]["remote"]
    claims_before = _peer_turns(b, "peer")
    theirs, _, _ = _turn(b, messages, session, key=KEY_B)
    assert theirs == _plain(plain_server, messages)
    assert _peer_turns(b, "peer") == claims_before, "tenant B's turn claimed tenant A's hold"
    assert _stats(b)["hits_tokens"]["remote"] == remote_before, "tenant B pulled A's KV"
    # A's own next turn still finds A's hold and pulls it.
    mine, _, _ = _turn(b, messages, session)
    assert mine == _plain(plain_server, messages)
    assert _stats(b)["hits_tokens"]["remote"] - remote_before >= 400


def test_a_client_cannot_name_a_peer_or_skip_the_checks(replicas):
    a, _ = replicas.replicas
    body = chat_body(a, _conversation(seed=43), session="evil", max_tokens=2)
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
    import redis

    a, b = _pair(replicas)
    session = "tamper-" + secrets.token_hex(4)
    messages = _conversation(seed=44)
    tokens, _, _ = _turn(a, messages, session)
    keys = RedisKeys("default")
    name = keys.hold(digest(TENANT_A, session), digest(TENANT_A, session, "main"))
    cipher = HoldCipher(SECRET.encode())
    r = redis.Redis(unix_socket_path=str(replicas.redis.socket), socket_timeout=5)
    raw, ttl = r.get(name), r.pttl(name)
    assert raw is not None, "replica A filed no hold for the turn it served"
    hold = decode_hold(raw, ttl, cipher, name)
    assert hold is not None
    ids = hold.params["remote_block_ids"]
    hold.params["remote_block_ids"] = [[i + 1 for i in ids[0]]]
    r.set(name, encode_hold(hold, cipher, name), px=max(ttl, 60_000))
    messages = _next(messages, tokens, "Next?")
    remote_before = _stats(b)["hits_tokens"]["remote"]
    refused_before = _peer_turns(b, "claim_refused")
    mine, _, _ = _turn(b, messages, session)
    assert mine == _plain(plain_server, messages)
    assert _stats(b)["hits_tokens"]["remote"] == remote_before
    # The issuer refused to claim a handle whose seal fails: B never contacted its NIXL side.
    assert _peer_turns(b, "claim_refused") == refused_before + 1


def _peer_turns(server, source: str) -> float:
    with client(server) as c:
        text = c.get("/metrics").text
    line = f'kvbranch_peer_turns_total{{source="{source}"}}'
    for row in text.splitlines():
        if row.startswith(line):
            return float(row.split()[-1])
    raise AssertionError(f"no {line} on /metrics")


def test_a_replicas_nixl_side_channel_serves_only_the_cluster(replicas):
    """The pull's other door: a non-member on a replica's NIXL port gets nothing."""
    for server in replicas.replicas:
        port = server.args[server.args.index("--nixl-port") + 1]
        check_side_channel(f"tcp://127.0.0.1:{port}", SECRET)


# --- last: these stop Redis and a replica ---------------------------------------------------
def test_the_index_down_costs_a_recompute_never_the_turn(replicas, plain_server):
    a, b = _pair(replicas)
    messages = _conversation(seed=45)
    session = "down-" + secrets.token_hex(4)
    tokens, _, _ = _turn(a, messages, session)
    replicas.redis.stop()
    try:
        messages = _next(messages, tokens, "Next?")
        mine, _, _ = _turn(b, messages, session)
        assert mine == _plain(plain_server, messages)
    finally:
        replicas.redis.start()
    assert _peer_index_errors(b, "begin_turn") >= 1


def test_a_peer_killed_between_turns_costs_a_recompute(replicas, plain_server):
    a, b = _pair(replicas)
    _wait_listed(replicas, 2)  # both back in the restarted index: B will try A
    messages = _conversation(seed=46)
    session = "kill-" + secrets.token_hex(4)
    tokens, _, _ = _turn(a, messages, session)
    sigkill(a)  # a crash: its record stays listed until its heartbeat's TTL ends
    messages = _next(messages, tokens, "Next?")
    refused_before = _peer_turns(b, "claim_refused")
    mine, _, _ = _turn(b, messages, session)
    assert mine == _plain(plain_server, messages)
    assert _peer_turns(b, "claim_refused") == refused_before + 1


def _peer_index_errors(server, op: str) -> float:
    with client(server) as c:
        text = c.get("/metrics").text
    line = f'kvbranch_peer_index_errors_total{{op="{op}"}}'
    for row in text.splitlines():
        if row.startswith(line):
            return float(row.split()[-1])
    return 0.0
