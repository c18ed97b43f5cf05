"""An aggregated replica with two data-parallel engines is two cluster members: one real
instance (``--role single --index redis://…`` with ``--data-parallel-size 2``, the real SmolLM2
weights, NIXL over UCX on loopback) and a real Redis, against plain vLLM.

Each engine core has its own connector, host store, KV-event sockets (engine 1's on the
``ipc://`` ``_dp1`` sockets: vLLM alone would not start it) and NIXL side channel, so each is a
member of the index with a record of its own. Checked through the one path that needs every
piece at once: a new session the plugin gives engine 1, whose prompt engine 0's host store
holds, pulls it from engine 0 — the run is found in the index under engine 0's member (its KV
events), the block-run revive runs on engine 0 (the member it names), the claim reaches engine
0 (the side channel its handle names) and engine 1 reads the blocks over NIXL, verified as
every pull. The answer equals plain vLLM's. The next turn of that session finds its hold filed
under engine 1's member: its own.
"""

from __future__ import annotations

import asyncio
import secrets
import socket

from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
from server.index import InstanceRecord, open_store
from server.plugin.engines import engine_of
from tests import prestart
from tests.integration.helpers import chat_body, client, size_args, stats, system_prompt
from tests.integration.replica_fixture import MAX_TOKENS, Tokens, metric, plain, tokens_of
from tests.redis_server import RedisServer
from tests.server_process import ServerProcess

ENGINES = 2
CLUSTER = "default"


def free_port_pair() -> int:
    """A port that is free, with the next one free too (engine 1's side channel)."""
    for _ in range(100):
        with socket.socket() as first:
            first.bind(("127.0.0.1", 0))
            port = first.getsockname()[1]
            if port >= 65535:
                continue
            with socket.socket() as second:
                try:
                    second.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise AssertionError("no two consecutive free ports")


class DataParallelReplica:
    """Redis and one aggregated replica with two engines (what :mod:`tests.prestart` counts:
    two engines)."""

    engines = ENGINES

    def __init__(self) -> None:
        self.redis = RedisServer()
        self.server = ServerProcess(
            [*size_args(0.25, 0.25, 4096), "--index", self.redis.url]
            + ["--nixl-port", str(free_port_pair())]
            + ["--", "--data-parallel-size", str(ENGINES)],
            name="replica-dp2",
            ready_timeout=900,
            env={ENV_CLUSTER_SECRET: secrets.token_hex(32), "PYTHONHASHSEED": "0"},
        )

    def launch(self) -> None:
        self.redis.start()
        self.server.launch()

    def wait_ready(self) -> None:
        self.server.wait_ready()

    def stop(self) -> None:
        self.server.stop()
        self.redis.close()


dp_replica = prestart.fixture(
    "dp_replica", lambda: (DataParallelReplica(),), scope="module", engines=ENGINES
)


def session_on(engine: int, stem: str) -> str:
    """A session id the replica gives to ``engine`` (no API keys: no owner)."""
    return next(
        f"{stem}-{i}" for i in range(1000) if engine_of(None, f"{stem}-{i}", ENGINES) == engine
    )


def turn(server: ServerProcess, messages: list[dict], session: str) -> tuple[Tokens, dict]:
    body = chat_body(server, messages, session=session, max_tokens=MAX_TOKENS, logprobs=True)
    with client(server) as c:
        r = c.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert "kv_transfer_params" not in answer, "a replica's handle reached the client"
    return tokens_of(answer), answer.get("kvbranch") or {}


def members(replica: DataParallelReplica) -> dict[str, InstanceRecord]:
    """The index's live member records, by instance id, read as a router reads them."""

    async def read() -> list[InstanceRecord]:
        store = open_store(replica.redis.url, hold_ttl_s=30.0, cluster=CLUSTER)
        try:
            return await store.members()
        finally:
            await store.close()

    return {record.instance_id: record for record in asyncio.run(read())}


def test_each_engine_is_a_member_and_a_session_pulls_from_the_other_engine(
    dp_replica, plain_server
):
    server = dp_replica.server
    with client(server) as c:
        instance = c.get("/v1/kvbranch/health").json()["instance_id"]
    listed = members(dp_replica)
    assert set(listed) == {f"{instance}-dp0", f"{instance}-dp1"}, listed
    channels = [listed[f"{instance}-dp{e}"].nixl for e in range(ENGINES)]
    port = int(channels[0].rpartition(":")[2])
    assert channels[1] == f"{channels[0].rpartition(':')[0]}:{port + 1}", channels

    messages = [
        {"role": "system", "content": system_prompt(words=400, seed=91)},
        {"role": "user", "content": "Which tool should run first? Answer briefly."},
    ]
    first, _ = turn(server, messages, session_on(0, "dp-held"))
    assert first == plain(plain_server, messages)

    def revived_runs() -> float:
        return metric(server, "kvbranch_peer_turns_total", "source", "revived_run") or 0.0

    before, remote_before = revived_runs(), int(stats(server)["hits_tokens"]["remote"])
    # The same prompt in a new session on engine 1: its host store has none of it; engine 0's
    # host store has all of it, listed in the index under engine 0's member by its KV events.
    session = session_on(1, "dp-new")
    mine, split = turn(server, messages, session)
    assert mine == plain(plain_server, messages), "engine 1's pulled turn differs from plain"
    assert revived_runs() == before + 1, split
    pulled = int(stats(server)["hits_tokens"]["remote"]) - remote_before
    assert pulled >= 400, f"engine 1 pulled {pulled} tokens from engine 0 ({split})"

    own_before = metric(server, "kvbranch_peer_turns_total", "source", "own_hold") or 0.0
    reply = "".join(t for t, _ in mine)
    nxt = [*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "Why?"}]
    again, _ = turn(server, nxt, session)
    assert again == plain(plain_server, nxt)
    own = metric(server, "kvbranch_peer_turns_total", "source", "own_hold") or 0.0
    assert own == own_before + 1, "engine 1's turn did not find its own hold (filed as dp1)"
