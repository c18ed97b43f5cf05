"""The ``/v1/kvbranch`` routes answer through the contract's models, and their errors are the
one error shape (server.common.errors). The connector is a fake control client (pure logic) that
parses its canned answers as the real one does; the routes, FastAPI and the models are the
real ones."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from sdk.contract import (
    CLAIM_FIELD,
    HEALTH_PATH,
    HOLD_CLAIM_PATH,
    SESSIONS_PATH,
    STATS_PATH,
    BranchInfo,
    ErrorBody,
    HoldClaimResult,
    SessionInfo,
    Stats,
    branch_path,
    branches_path,
    pin_path,
    prefetch_path,
    session_path,
)
from server.connector.control.models import ControlRequest, EngineStoreStats, parse_answer
from server.connector.control.transport import ControlError
from server.plugin.engines import Engines
from server.plugin.holds import router as holds_router
from server.plugin.routes import router


def branch(bid: str = "main", **extra: Any) -> dict[str, Any]:
    return dict({"session_id": "s1", "branch_id": bid, "num_tokens": 3}, **extra)


SESSION = {
    "session_id": "s1",
    "created_at": 1.0,
    "auto_pin": True,
    "pin_ttl_s": 300.0,
    "branches": [branch()],
}
#: An empty store, as the engine reports it (every field of its answer model).
STORE = dict.fromkeys(EngineStoreStats.model_fields, 0)


class FakeControl:
    def __init__(self) -> None:
        self.answers: dict[str, Any] = {
            "info": {
                "enabled": True,
                "block_size": 128,
                "block_bytes": 1,
                "num_slots": 10,
                "store_capacity_bytes": 10,
                "pin_budget_bytes": 5,
                "platform": "cpu",
            },
            "create_session": SESSION,
            "get_session": SESSION,
            "delete_session": {"deleted": "s1", "released_blocks": 2},
            "list_branches": [branch(), branch("b")],
            "get_branch": branch(),
            "fork": branch("b", parent="main"),
            "pin": branch(pinned=True),
            "unpin": branch(),
            "delete_branch": {"deleted": "b", "released_blocks": 0},
            "prefetch_plan": {"token_ids": [1, 2, 3]},
            "stats": {
                "store": STORE,
                "hits_tokens": {"device": 1},
                "requests": 1,
                "pins_degraded": 0,
                "pins_refused": 0,
                "prefetches": 0,
                "sessions": [SESSION],
                "num_sessions": 1,
                "remote_failed_tokens": 0,
                "time": 5.0,
                "pd": {
                    "holds": 1,
                    "held_blocks": 2,
                    "holds_released_for_new_work": 0,
                    "claims": 1,
                    "claims_refused": 0,
                    "stalled_steps": 0,
                    "handles_declined": {"unclaimed": 1},
                },
            },
            "claim_hold": {
                CLAIM_FIELD: {"handle": "h", "until": 2.0, "until_perf": 3.0, "mac": "m"}
            },
        }
        self.calls: list[tuple[str, dict[str, Any]]] = []

    async def call(self, request: ControlRequest[Any]) -> Any:
        self.calls.append((request.op, request.model_dump(exclude_unset=True)))
        answer = self.answers[request.op]
        if isinstance(answer, ControlError):
            raise answer
        return parse_answer(request, answer)


@pytest.fixture
def control() -> FakeControl:
    return FakeControl()


@pytest.fixture
def client(control: FakeControl) -> TestClient:
    app = FastAPI()
    app.include_router(router)
    app.include_router(holds_router)
    prefetched: list[Any] = []
    app.state.kvbranch = SimpleNamespace(
        control=control,
        engines=Engines(None, 1),
        engine_client=None,
        model_name="m",
        max_model_len=3,
        vllm_version="v",
        instance_id="i",
        role="single",
        start_prefetch=lambda tokens, salt, engine=None: prefetched.append(tokens),
        prefetched=prefetched,
    )
    return TestClient(app, raise_server_exceptions=False)


def test_every_route_answers_its_model(client: TestClient) -> None:
    health = client.get(HEALTH_PATH).json()
    assert health["connector"] == {
        "loaded": True,
        "name": "KVBranchConnector",
        "block_size": 128,
        "store_capacity_bytes": 10,
        "pin_budget_bytes": 5,
        "platform": "cpu",
    }
    assert health["status"] == "ok" and health["role"] == "single"
    created = client.post(SESSIONS_PATH, json={})
    assert created.status_code == 201
    assert SessionInfo.model_validate(created.json()).branches[0].branch_id == "main"
    assert created.json()["branches"][0]["pinned_bytes"] == 0  # model defaults filled in
    assert client.get(session_path("s1")).json()["session_id"] == "s1"
    assert client.delete(session_path("s1")).json() == {"deleted": "s1", "released_blocks": 2}
    listed = client.get(branches_path("s1")).json()
    assert [BranchInfo.model_validate(b).branch_id for b in listed] == ["main", "b"]
    forked = client.post(branches_path("s1"), json={"parent": "main"})
    assert forked.status_code == 201 and forked.json()["parent"] == "main"
    assert client.get(branch_path("s1", "main")).json()["branch_id"] == "main"
    assert client.post(pin_path("s1", "main"), json={"ttl_s": 5}).json()["pinned"] is True
    assert client.delete(pin_path("s1", "main")).json()["pinned"] is False
    assert client.delete(branch_path("s1", "b")).json()["deleted"] == "b"
    stats = client.get(STATS_PATH).json()
    assert Stats.model_validate(stats).pd is not None
    assert "time" not in stats  # only the contract's fields reach clients


def test_prefetch_is_capped_and_scheduled(client: TestClient) -> None:
    r = client.post(prefetch_path("s1", "main"))
    assert r.status_code == 202
    assert r.json() == {
        "session_id": "s1",
        "branch_id": "main",
        "status": "scheduled",
        "num_tokens": 2,
    }  # max_model_len - 1
    assert client.app.state.kvbranch.prefetched == [[1, 2]]


def test_prefetch_of_a_branch_the_host_store_holds_runs_nothing(
    client: TestClient, control: FakeControl
) -> None:
    control.answers["prefetch_plan"] = {"token_ids": [1, 2, 3], "location": "host"}
    r = client.post(prefetch_path("s1", "main"), json={})
    assert r.status_code == 202 and r.json()["status"] == "in_host_store"
    assert client.app.state.kvbranch.prefetched == []
    assert control.calls[-1] == (
        "prefetch_plan",
        {"owner": None, "session_id": "s1", "branch_id": "main", "to_device": False},
    )
    client.post(prefetch_path("s1", "main"), json={"to_device": True})
    assert control.calls[-1][1]["to_device"] is True


def test_connector_errors_are_the_one_error_shape(client: TestClient, control: FakeControl) -> None:
    control.answers["get_session"] = ControlError(404, "session 's9' not found")
    r = client.get(session_path("s9"))
    assert r.status_code == 404
    assert ErrorBody.model_validate(r.json()).error.type == "NotFoundError"
    assert r.json() == {
        "error": {
            "message": "session 's9' not found",
            "type": "NotFoundError",
            "param": None,
            "code": 404,
        }
    }
    r = client.post(branches_path("s1"), json={"messages": [], "token_offset": 1})
    assert r.status_code == 400 and r.json()["error"]["type"] == "BadRequestError"


def test_a_connector_answer_that_drifted_from_the_contract_fails_loudly(
    client: TestClient, control: FakeControl
) -> None:
    control.answers["get_branch"] = {"session_id": "s1"}  # no branch_id
    assert client.get(branch_path("s1", "main")).status_code == 500


def test_without_the_connector_every_route_is_503(client: TestClient) -> None:
    client.app.state.kvbranch.control = None
    r = client.get(STATS_PATH)
    assert r.status_code == 503 and r.json()["error"]["type"] == "ServiceUnavailableError"
    assert client.get(HEALTH_PATH).json()["connector"]["loaded"] is False
    assert client.post(HOLD_CLAIM_PATH, json={"handle": {}}).status_code == 503


def test_a_hold_claim_reaches_the_engine_whose_side_channel_the_handle_names(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With data-parallel engines a claim goes to the engine that issued the handle: vLLM's
    side channel of engine i is the launcher's port plus i. A port that is none of them goes
    to engine 0, which refuses a handle it did not issue."""
    from server.common.env import ENV_NIXL_PORT

    monkeypatch.setenv(ENV_NIXL_PORT, "18000")
    engines = Engines(None, 2)
    engines.controls = [FakeControl(), FakeControl()]  # type: ignore[list-item]
    client.app.state.kvbranch.engines = engines  # type: ignore[attr-defined]
    for port, engine in ((18001, 1), (18000, 0), (18002, 0), ("18001", 0), (17999, 0)):
        handle = {"remote_request_id": "x", "remote_port": port}
        r = client.post(HOLD_CLAIM_PATH, json={"handle": handle})
        assert r.status_code == 200, r.text
        called = [len(c.calls) for c in engines.controls]  # type: ignore[attr-defined]
        assert engines.controls[engine].calls[-1] == ("claim_hold", {"handle": handle}), port  # type: ignore[attr-defined]
        for c in engines.controls:
            c.calls.clear()  # type: ignore[attr-defined]
        assert called[1 - engine] == 0, port


def test_hold_claims(client: TestClient, control: FakeControl) -> None:
    r = client.post(HOLD_CLAIM_PATH, json={"handle": {"remote_request_id": "x"}})
    assert r.status_code == 200
    assert HoldClaimResult.model_validate(r.json()).kvbranch_claim.until == 2.0
    assert control.calls[-1] == ("claim_hold", {"handle": {"remote_request_id": "x"}})
    bad = client.post(HOLD_CLAIM_PATH, json={"nope": 1})
    assert bad.status_code == 400 and "handle" in bad.json()["error"]["message"]
    control.answers["claim_hold"] = ControlError(410, "hold released")
    gone = client.post(HOLD_CLAIM_PATH, json={"handle": {}})
    assert gone.status_code == 410 and gone.json()["error"]["type"] == "GoneError"
