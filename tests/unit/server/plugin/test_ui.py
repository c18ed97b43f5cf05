"""The agent page's data route answers the caller's tenant only, its turn log is bounded, and
the page's files carry their security headers. The connector is a fake control client (pure
logic: it answers ``stats`` with the sessions of the owner it is asked for, as the connector's
registry does); the routes, FastAPI, the turn log and the recorder are the real ones."""

from __future__ import annotations

import re
from argparse import Namespace
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from server.common.tenants import tenant_id
from server.common.ui_page import PAGE_PATHS, UI_DATA_PATH, UI_PATH
from server.connector.control.models import ControlRequest, EngineStoreStats, parse_answer
from server.plugin.middleware import _ResponseRewriter
from server.plugin.turn_log import SPLIT_SCOPE_KEY, Turn, TurnLog, TurnRecorder
from server.plugin.ui import install

KEY_A, KEY_B = "ui-key-a", "ui-key-b"
#: An empty store, as the engine reports it (every field of its answer model).
STORE = dict.fromkeys(EngineStoreStats.model_fields, 0)


def session(sid: str, *branches: str) -> dict[str, Any]:
    return {
        "session_id": sid,
        "created_at": 1.0,
        "auto_pin": True,
        "pin_ttl_s": 300.0,
        "branches": [{"session_id": sid, "branch_id": b, "num_tokens": 7} for b in branches],
    }


class TenantControl:
    """Answers ``stats`` with the asking owner's sessions and ``split`` from ``splits``."""

    def __init__(self, sessions: dict[str | None, list[dict[str, Any]]]) -> None:
        self.sessions = sessions
        self.splits: dict[str, dict[str, Any]] = {}

    async def call(self, request: ControlRequest[Any]) -> Any:
        if request.op == "split":
            return parse_answer(request, self.splits.get(request.tag))  # type: ignore[attr-defined]
        mine = self.sessions.get(request.owner, [])
        answer = {
            "store": STORE,
            "hits_tokens": {},
            "requests": 0,
            "pins_degraded": 0,
            "pins_refused": 0,
            "prefetches": 0,
            "sessions": mine,
            "num_own_sessions": len(mine),
            "num_sessions": sum(len(s) for s in self.sessions.values()),
            "remote_failed_tokens": 0,
            "time": 5.0,
        }
        return parse_answer(request, answer)


def turn(sid: str, bid: str, prompt: int = 10) -> Turn:
    return Turn(sid, bid, 1.0, prompt, prompt - 2, 1, 0, 1, 0.1, 0.5, True)


@pytest.fixture
def app() -> FastAPI:
    a, b = tenant_id(KEY_A), tenant_id(KEY_B)
    app = FastAPI()
    app.state.args = Namespace(api_key=[KEY_A, KEY_B])
    app.state.kvbranch = SimpleNamespace(
        control=TenantControl(
            {a: [session("a-only", "main"), session("same", "main")], b: [session("same", "main")]}
        ),
        role="single",
    )
    log = install(app)
    log.add(a, turn("same", "main", prompt=11))
    log.add(b, turn("same", "main", prompt=99))
    log.add(b, turn("b-only", "main", prompt=98))
    return app


def data(app: FastAPI, key: str | None) -> Any:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return TestClient(app).get(UI_DATA_PATH, headers=headers)


def test_data_is_the_callers_sessions_and_turns_only(app: FastAPI) -> None:
    mine = data(app, KEY_A).json()
    assert [s["session_id"] for s in mine["sessions"]] == ["a-only", "same"]
    # Both tenants chose the session id "same": A sees its own turn of it, never B's.
    assert [(t["session_id"], t["prompt_tokens"]) for t in mine["turns"]] == [("same", 11)]
    theirs = data(app, KEY_B).json()
    assert [s["session_id"] for s in theirs["sessions"]] == ["same"]
    assert [t["prompt_tokens"] for t in theirs["turns"]] == [99]  # b-only has no session now


def test_data_without_a_key_of_this_server_is_refused(app: FastAPI) -> None:
    for key in (None, "not-a-key"):
        answer = data(app, key)
        assert answer.status_code == 401
        assert "sessions" not in answer.json()


def test_page_files_are_open_with_security_headers(app: FastAPI) -> None:
    client = TestClient(app)
    for path in PAGE_PATHS:
        answer = client.get(path)
        assert answer.status_code == 200, path
        policy = answer.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "unsafe-inline" not in policy
        assert answer.headers["x-content-type-options"] == "nosniff"
    page = client.get(UI_PATH).text
    assert "<script>" not in page and 'src="ui.js"' in page  # no inline script
    script = client.get(UI_PATH + ".js").text
    # data goes in as text only; the key never outlives the tab
    assert not re.search(r"\.(inner|outer)HTML|insertAdjacentHTML|document\.write|eval\(", script)
    assert "localStorage" not in script


def test_turn_log_is_bounded_per_branch_tenant_and_in_all() -> None:
    log = TurnLog(turns_per_branch=2, branches_per_tenant=3, max_branches=4)
    for i in range(5):
        log.add("t1", turn("s", "main", prompt=i))
    assert [t.prompt_tokens for t in log.turns_of("t1")] == [3, 4]
    for i in range(5):
        log.add("t1", turn("s", f"b{i}"))
    assert len(log) == 3
    assert {t.branch_id for t in log.turns_of("t1")} == {"b2", "b3", "b4"}
    log.add("t2", turn("s", "x"))
    log.add("t2", turn("s", "y"))  # over max_branches: t1 (least recently used) gives way
    assert len(log) == 4
    assert {t.branch_id for t in log.turns_of("t1")} == {"b3", "b4"}
    assert [t.branch_id for t in log.turns_of("t2", [("s", "y"), ("gone", "x")])] == ["y"]


async def test_recorder_files_a_streamed_turn_under_the_callers_tenant(app: FastAPI) -> None:
    log = TurnLog()
    control = app.state.kvbranch.control
    split = {"session_id": "s", "branch_id": "main", "prompt_tokens": 5}
    control.splits["kvb-1"] = dict(
        split, device_hit_tokens=3, host_hit_tokens=1, recomputed_tokens=1
    )

    async def engine(scope: Any, receive: Any, send: Any) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"authorization", f"Bearer {KEY_B}".encode())],
        "app": app,
    }

    def looked_up(tag: str) -> dict[str, Any]:
        """The scope as the completion middleware hands it inward: its split lookup in it."""
        return dict(scope, **{SPLIT_SCOPE_KEY: _ResponseRewriter(scope, send, tag).fetch_split})

    await TurnRecorder(engine, log)(looked_up("kvb-1"), None, send)
    assert len(sent) == 3  # the response went out unchanged
    (filed,) = log.turns_of(tenant_id(KEY_B))
    assert (filed.session_id, filed.device_hit_tokens, filed.streamed) == ("s", 3, True)
    assert filed.ttft_s is not None and filed.ttft_s <= filed.latency_s
    assert log.turns_of(tenant_id(KEY_A)) == []
    control.splits.clear()  # a request the engine kept no split for: nothing filed
    await TurnRecorder(engine, log)(looked_up("kvb-2"), None, send)
    assert len(log.turns_of(tenant_id(KEY_B))) == 1
