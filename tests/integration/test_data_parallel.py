"""Data parallelism: one kvbranch server with ``--data-parallel-size 2`` (two engine cores, each
with its own connector and host store) and the real SmolLM2 weights, against plain vLLM.

A session's every turn and every session route must reach one engine: the turn after a device
reset finds the first turn in the host store (of the engine that served it), a fork made through
the routes is found by the next turn on that branch, and a client's ``X-data-parallel-rank``
header does not move the turn elsewhere. Sessions on each of the two engines are checked (vLLM's
load balancer alone sends an idle server's requests to engine 0, where routes to engine 1
would not find them). Greedy answers equal plain vLLM's.
"""

from __future__ import annotations

import pytest

from server.plugin.engines import engine_of
from tests import prestart
from tests.integration.helpers import (
    BLOCK,
    chat,
    client,
    live_sessions,
    reset_device_cache,
    system_prompt,
    text_of,
)
from tests.server_process import ServerProcess

ENGINES = 2
ARGS = ["--kv-cache-gib", "0.25", "--host-store-gib", "0.25", "--max-model-len", "2048"]


def _dp_server() -> tuple[ServerProcess]:
    server = ServerProcess([*ARGS, "--", "--data-parallel-size", str(ENGINES)], name="kvbranch-dp2")
    server.engines = ENGINES  # type: ignore[attr-defined]  # for the prestart budget
    return (server,)


dp_server = prestart.fixture("dp_server", _dp_server, scope="module", engines=ENGINES)


def session_on(engine: int, stem: str) -> str:
    """A session id whose turns the server gives to ``engine`` (no API keys: no owner)."""
    return next(
        f"{stem}-{i}" for i in range(1000) if engine_of(None, f"{stem}-{i}", ENGINES) == engine
    )


@pytest.mark.parametrize("engine", range(ENGINES))
def test_a_sessions_turns_and_routes_reach_one_engine(dp_server, plain_server, engine):
    session = session_on(engine, "dp")
    other = str(1 - engine)
    messages = [
        {"role": "system", "content": system_prompt(words=300, seed=engine)},
        {"role": "user", "content": "Step 0. The tool returned 17 rows. What next?"},
    ]
    first = chat(dp_server, messages, session=session)
    assert text_of(first) == text_of(chat(plain_server, messages))
    stored = first["usage"]["prompt_tokens"] // BLOCK * BLOCK
    history = [*messages, {"role": "assistant", "content": text_of(first)}]

    # turn 2 from the host store alone, a client's engine choice ignored
    turn2 = [*history, {"role": "user", "content": "Step 1. It failed. What now?"}]
    reset_device_cache(dp_server)
    with client(dp_server, headers={"X-data-parallel-rank": other}) as c:
        r = c.post(
            "/v1/chat/completions",
            json={
                "model": dp_server.model,
                "messages": turn2,
                "temperature": 0,
                "max_tokens": 12,
                "session_id": session,
            },
        )
    assert r.status_code == 200, r.text
    second = r.json().get("kvbranch") or {}  # none when another engine served the turn
    assert second.get("device_hit_tokens") == 0, second
    assert second.get("host_hit_tokens", 0) >= stored, second
    assert text_of(r.json()) == text_of(chat(plain_server, turn2))

    # the session routes reach the engine that holds it: a fork there is found by the next turn
    with client(dp_server) as c:
        got = c.get(f"/v1/kvbranch/sessions/{session}")
        assert got.status_code == 200, got.text
        r = c.post(
            f"/v1/kvbranch/sessions/{session}/branches",
            json={"parent": "main", "branch_id": "alt", "messages": history},
        )
    assert r.status_code == 201, r.text
    alt = [*history, {"role": "user", "content": "Instead, retry with 3 rows. Which first?"}]
    reset_device_cache(dp_server)
    forked = chat(dp_server, alt, session=session, branch="alt")
    assert (forked.get("kvbranch") or {}).get("host_hit_tokens", 0) >= stored, forked
    assert text_of(forked) == text_of(chat(plain_server, alt))
    with client(dp_server) as c:
        assert c.delete(f"/v1/kvbranch/sessions/{session}").status_code == 200
        assert c.get(f"/v1/kvbranch/sessions/{session}").status_code == 404


def test_stats_and_metrics_count_every_engines_sessions(dp_server):
    sessions = [session_on(engine, "stats") for engine in range(ENGINES)]
    with client(dp_server) as c:
        for session in sessions:
            assert c.post("/v1/kvbranch/sessions", json={"session_id": session}).status_code == 201
        try:
            stats = c.get("/v1/kvbranch/stats").json()
            listed = {s["session_id"] for s in stats["sessions"]}
            assert set(sessions) <= listed, stats
            assert stats["num_own_sessions"] >= ENGINES
            # one store per engine: the server's capacity is both of them
            one = c.get("/v1/kvbranch/health").json()["connector"]["store_capacity_bytes"]
            capacity = stats["store"]["capacity_blocks"] * stats["store"]["block_bytes"]
            assert capacity > one * 1.5, (capacity, one)
            assert live_sessions(dp_server) >= ENGINES
        finally:
            for session in sessions:
                c.delete(f"/v1/kvbranch/sessions/{session}")


def test_a_turn_on_a_route_without_engine_choice_leaves_no_second_record(dp_server):
    # vLLM's /v1/responses takes no engine choice: its turn goes where the balancer puts it
    # (engine 0 on an idle server); the engine that does not own the session keeps no record
    session = session_on(1, "responses")
    messages = [{"role": "user", "content": "Name one prime number."}]
    chat(dp_server, messages, session=session, max_tokens=4)
    with client(dp_server) as c:
        try:
            for _ in range(2):
                r = c.post(
                    "/v1/responses",
                    json={
                        "model": dp_server.model,
                        "input": "Name one prime number.",
                        "max_output_tokens": 4,
                        "temperature": 0,
                        "session_id": session,
                    },
                )
                assert r.status_code == 200, r.text
            stats = c.get("/v1/kvbranch/stats").json()
            records = [s for s in stats["sessions"] if s["session_id"] == session]
            assert len(records) == 1, records
        finally:
            c.delete(f"/v1/kvbranch/sessions/{session}")
