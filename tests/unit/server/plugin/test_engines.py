"""Several data-parallel engines behind one API server: a session's turns and routes reach one
engine, chosen by a digest of owner and session id; a client's ``X-data-parallel-rank`` never
chooses it."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from sdk.contract import SESSIONS_PATH, session_path
from server.connector.control.models import ControlRequest, parse_answer
from server.plugin.engines import RANK_HEADER, Engines, engine_of, strip_client_rank
from server.plugin.guard import KVBranchGuard
from server.plugin.routes import router
from tests.unit.server.plugin.asgi import run_asgi as run_layer
from tests.unit.server.plugin.test_middleware import SPLIT, FakeApp, run_asgi
from tests.unit.server.plugin.test_routes import SESSION

USAGE = json.dumps({"choices": [], "usage": {"prompt_tokens": 10}}).encode()


class Control:
    """One engine's control socket: records its calls, answers a split only for its tags."""

    def __init__(self, split: Any = None) -> None:
        self.split = split
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def call(self, request: ControlRequest[Any]) -> Any:
        self.calls.append((request.op, request.model_dump(exclude_unset=True)))
        if request.op == "split":
            return parse_answer(request, self.split)
        return parse_answer(request, dict(SESSION, session_id=request.session_id))


def two_engines(splits: tuple[Any, Any] = (SPLIT, SPLIT)) -> Engines:
    engines = Engines(None, 2)
    engines.controls = [Control(splits[0]), Control(splits[1])]  # type: ignore[list-item]
    return engines


def app_with(engines: Engines) -> SimpleNamespace:
    kvb = SimpleNamespace(control=engines.controls[0], engines=engines)
    return SimpleNamespace(state=SimpleNamespace(kvbranch=kvb))


def sessions_on(engines: int, owner: str | None) -> dict[int, str]:
    """A session id that lands on each engine."""
    found: dict[int, str] = {}
    for i in range(200):
        found.setdefault(engine_of(owner, f"s{i}", engines), f"s{i}")
    return found


def test_the_engine_is_a_stable_digest_of_owner_and_session():
    assert engine_of(None, "s", 1) == 0
    picks = [engine_of(None, f"s{i}", 4) for i in range(400)]
    assert set(picks) == {0, 1, 2, 3}
    assert picks == [engine_of(None, f"s{i}", 4) for i in range(400)]
    # another owner's session of the same name need not share the engine
    assert any(engine_of("t_a", f"s{i}", 4) != engine_of("t_b", f"s{i}", 4) for i in range(50))


def test_a_clients_rank_header_is_dropped_by_the_guard():
    scope = {"type": "http", "headers": [(b"X-Data-Parallel-Rank", b"1"), (b"a", b"b")]}
    assert strip_client_rank(scope)["headers"] == [(b"a", b"b")]
    seen: dict[str, Any] = {}

    async def app(scope, receive, send):
        seen["headers"] = scope["headers"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    for method, path in (("GET", "/v1/models"), ("POST", "/v1/chat/completions")):
        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "headers": [(b"content-type", b"application/json"), (RANK_HEADER, b"1")],
        }
        assert run_layer(KVBranchGuard(app), scope, b"{}").status == 200
        assert RANK_HEADER not in [k.lower() for k, _ in seen["headers"]]


def test_a_session_turn_goes_to_its_engine_and_its_split_comes_from_there():
    for engine, session in sessions_on(2, None).items():
        engines = two_engines()
        app = FakeApp(200, b"application/json", [USAGE])
        body = json.dumps({"messages": [], "session_id": session}).encode()
        sent = run_asgi(app, body=body, app_obj=app_with(engines))
        assert app.scope is not None
        ranks = [v for k, v in app.scope["headers"] if k == RANK_HEADER]
        assert ranks == [str(engine).encode()]
        assert [op for op, _ in engines.controls[engine].calls] == ["split"]  # type: ignore[attr-defined]
        assert engines.controls[1 - engine].calls == []  # type: ignore[attr-defined]
        assert b"kvbranch" in b"".join(m.get("body", b"") for m in sent)


def test_a_turn_without_a_session_is_left_to_vllm_and_its_split_found_on_any_engine():
    engines = two_engines(splits=(None, SPLIT))
    app = FakeApp(200, b"application/json", [USAGE])
    sent = run_asgi(app, body=b'{"messages": []}', app_obj=app_with(engines))
    assert app.scope is not None
    assert RANK_HEADER not in [k for k, _ in app.scope["headers"]]
    assert [len(c.calls) for c in engines.controls] == [1, 1]  # type: ignore[attr-defined]
    assert b"kvbranch" in b"".join(m.get("body", b"") for m in sent)


def test_session_routes_reach_the_engine_that_holds_the_session():
    engines = two_engines()
    app = FastAPI()
    app.include_router(router)
    app.state.kvbranch = app_with(engines).state.kvbranch
    client = TestClient(app)
    for engine, session in sessions_on(2, None).items():
        for c in engines.controls:
            c.calls.clear()  # type: ignore[attr-defined]
        assert client.get(session_path(session)).status_code == 200
        assert client.post(SESSIONS_PATH, json={"session_id": session}).status_code == 201
        assert [op for op, _ in engines.controls[engine].calls] == [  # type: ignore[attr-defined]
            "get_session",
            "create_session",
        ]
        assert engines.controls[1 - engine].calls == []  # type: ignore[attr-defined]
    # a session without an id gets one here, and lands on that id's engine
    made = client.post(SESSIONS_PATH, json={}).json()["session_id"]
    engine = engine_of(None, made, 2)
    op, fields = engines.controls[engine].calls[-1]  # type: ignore[attr-defined]
    assert (op, fields["session_id"]) == ("create_session", made)


def test_the_stats_of_several_engines_are_summed_and_their_sessions_joined():
    from server.connector.control.models import EngineStats
    from server.plugin.engine_stats import merge_stats
    from tests.unit.server.plugin.test_routes import FakeControl

    answer = FakeControl().answers["stats"]
    one = EngineStats.model_validate(answer)
    store = dict(answer["store"], block_bytes=4096, used_blocks=3, capacity_blocks=10)
    two = EngineStats.model_validate(
        dict(answer, store=store, sessions=[dict(SESSION, session_id="s2")], time=9.0)
    )
    merged = merge_stats([one, two])
    assert merged.requests == 2 and merged.hits_tokens == {"device": 2}
    assert merged.store.capacity_blocks == 10 and merged.store.used_blocks == 3
    assert merged.store.block_bytes == 0  # one block's size: the first engine's, not a sum
    assert [s.session_id for s in merged.sessions] == ["s1", "s2"]
    assert merged.time == 9.0 and merged.pd is not None and merged.pd.holds == 2
    assert merge_stats([one]) is one
