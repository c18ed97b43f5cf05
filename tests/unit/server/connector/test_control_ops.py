"""Typed control ops (issue 25 item 2): every op has a request and an answer model, the engine's
dispatcher and the API process's client both build and parse through them, and a field that
drifted fails at the boundary, naming itself.

The round trips run the real scheduler side (registry, planner, handlers) behind a real control
socket, so they also prove that every real handler's answer matches its model strictly."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from sdk.contract import CLAIM_FIELD, BranchInfo, HoldClaimResult, SessionInfo
from server.connector.config import ConnectorConfig
from server.connector.control.models import (
    REQUESTS,
    ClaimHold,
    CreateSession,
    DeleteBranch,
    DeleteSession,
    EngineInfo,
    EngineStats,
    Fork,
    GetBranch,
    GetSession,
    GetStats,
    HostCoverage,
    Info,
    ListBranches,
    Pin,
    PlanPrefetch,
    ResetStore,
    RunCoverage,
    Split,
    Unpin,
    parse_answer,
    parse_request,
    request_line,
)
from server.connector.control.ops import OPS, Op, run_op
from server.connector.control.transport import (
    AsyncControlClient,
    ControlError,
    ControlServer,
    call_sync,
    call_sync_raw,
)
from server.connector.engine.scheduler_side import KVBranchScheduler

BS = 4


def make_side(tmp_path: Any, **extra: Any) -> KVBranchScheduler:
    folder = tmp_path / "ctl"
    folder.mkdir(mode=0o700)
    return KVBranchScheduler(
        block_size=BS,
        block_bytes=1,
        num_slots=16,
        enabled=True,
        config=ConnectorConfig.from_extra(
            {
                "host_store_bytes": 16,
                "pin_budget_bytes": 8,
                "control_socket": str(folder / "c.sock"),
                **extra,
            }
        ),
    )


@pytest.fixture
def side(tmp_path):
    side = make_side(tmp_path)
    yield side
    side.shutdown()


# --- the registry -------------------------------------------------------------------------------
def test_every_op_has_one_request_model_one_answer_model_and_one_handler():
    # claim_hold, host_coverage and run_coverage: P/D adds them (pd/verified_nixl.py,
    # pd/host_coverage.py)
    assert set(REQUESTS) == {*OPS, ClaimHold.op, HostCoverage.op, RunCoverage.op}
    assert len(REQUESTS) == 17
    for name, op in OPS.items():
        assert op.name == name and op.request is REQUESTS[name]
        assert op.answer is op.request.answer and callable(op.handler)
    assert GetSession.answer is SessionInfo and GetBranch.answer is BranchInfo  # the contract's
    assert ClaimHold.answer is HoldClaimResult and GetStats.answer is EngineStats


def test_the_wire_line_is_the_op_and_its_fields():
    assert request_line(Pin(session_id="s", branch_id="b", ttl_s=5)) == {
        "op": "pin",
        "owner": None,
        "session_id": "s",
        "branch_id": "b",
        "ttl_s": 5.0,
    }
    line = request_line(Fork(session_id="s", owner="t_a"))
    assert line["parent"] == "main" and line["owner"] == "t_a"
    assert parse_request(json.loads(json.dumps(line))) == Fork(session_id="s", owner="t_a")


# --- the engine's side: requests ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("line", "named"),
    [
        ({"op": "frobnicate"}, "'frobnicate'"),
        ({"op": "pin", "session_id": "s", "branch_id": "b"}, "'ttl_s'"),  # missing
        ({"op": "pin", "session_id": "s", "branch_id": "b", "ttl": 5}, "'ttl'"),  # renamed
        ({"op": "pin", "session_id": "s", "branch_id": "b", "ttl_s": "soon"}, "'ttl_s'"),
        ({"op": "get_session"}, "'session_id'"),
        ({"op": "claim_hold", "handle": {}}, "'claim_hold'"),  # only P/D engines serve it
    ],
)
def test_a_bad_op_or_field_is_a_400_that_names_it(side, line, named):
    with pytest.raises(ControlError) as exc:
        side.handle_control(line)
    assert exc.value.status == 400 and named in exc.value.message


def test_over_the_socket_a_bad_field_is_the_same_400(side):
    assert side.control is not None
    with pytest.raises(ControlError) as exc:
        call_sync_raw(side.control.path, "get_branch", session_id="s", branch="main")
    assert exc.value.status == 400
    assert "'branch_id'" in exc.value.message and "'branch'" in exc.value.message


# --- the engine's side: answers -------------------------------------------------------------------
def _drifted(answer: Any) -> dict[str, Op[Any]]:
    return {GetBranch.op: Op(GetBranch, lambda side, req: answer)}


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        ({"session_id": "s", "num_tokens": 3}, "'branch_id'"),  # a required field missing
        ({"session_id": "s", "branch_id": "b", "stored": 1}, "'stored'"),  # a renamed default
        ({"session_id": "s", "branch_id": "b", "pinned": "maybe"}, "'pinned'"),
    ],
)
def test_a_handler_whose_answer_drifted_fails_in_the_dispatcher(side, answer, named):
    with pytest.raises(ControlError) as exc:
        run_op(side, _drifted(answer), {"op": "get_branch", "session_id": "s", "branch_id": "b"})
    assert exc.value.status == 500
    assert "kvbranch engine" in exc.value.message and "BranchInfo" in exc.value.message
    assert named in exc.value.message


def test_a_nested_drift_fails_too(side):
    """Strict at every depth: a stats answer whose session lists a renamed branch field."""
    stats = side.handle_control({"op": "stats", "all_owners": True})
    stats["sessions"] = [
        {
            "session_id": "s",
            "created_at": 0.0,
            "auto_pin": True,
            "pin_ttl_s": 1.0,
            "branches": [{"session_id": "s", "branch_id": "main", "stored": 0}],
        }
    ]
    ops = {GetStats.op: Op(GetStats, lambda side, req: stats)}
    with pytest.raises(ControlError) as exc:
        run_op(side, ops, {"op": "stats"})
    assert exc.value.status == 500 and "'sessions.0.branches.0.stored'" in exc.value.message


# --- the API process's side -----------------------------------------------------------------------
def test_info_and_stats_report_the_pin_budget_and_its_counts(side):
    """The pin budget and its refusal counts live in the registry's leases: info and stats read
    them there (the budget: 8 one-byte blocks)."""
    leases = side.planner.registry.leases
    leases.pins_degraded, leases.pins_refused = 2, 3
    assert side.handle_control({"op": "info"})["pin_budget_bytes"] == 8
    stats = side.handle_control({"op": "stats", "all_owners": True})
    assert stats["store"]["pin_budget_bytes"] == 8
    assert (stats["pins_degraded"], stats["pins_refused"]) == (2, 3)


def test_the_client_refuses_an_answer_that_does_not_match(tmp_path):
    """An engine of another build (or a bug past its dispatcher): the typed client names the
    field instead of handing a dict with a hole to the route."""
    folder = tmp_path / "raw"
    folder.mkdir(mode=0o700)
    srv = ControlServer(str(folder / "c.sock"), lambda req: {"session_id": "s", "branch": "b"})
    try:
        request = GetBranch(session_id="s", branch_id="b")
        with pytest.raises(ControlError) as exc:
            call_sync(srv.path, request)
        assert exc.value.status == 500
        assert "kvbranch API" in exc.value.message and "BranchInfo" in exc.value.message
        assert "'branch_id'" in exc.value.message and "'branch'" in exc.value.message

        async def main() -> None:
            with pytest.raises(ControlError) as exc:
                await AsyncControlClient(srv.path).call(request)
            assert exc.value.status == 500 and "'branch_id'" in exc.value.message

        asyncio.run(main())
    finally:
        srv.close()


def test_parse_answer_gives_the_answer_model():
    branch = parse_answer(
        GetBranch(session_id="s", branch_id="b"), {"session_id": "s", "branch_id": "b"}
    )
    assert isinstance(branch, BranchInfo) and branch.stored_blocks == 0
    assert parse_answer(Split(tag="t"), None).root is None


# --- both ends, for real -------------------------------------------------------------------------
def test_every_op_round_trips_through_the_real_handlers(side):
    assert side.control is not None
    path = side.control.path
    client = AsyncControlClient(path)

    async def main() -> None:
        info = await client.call(Info())
        assert isinstance(info, EngineInfo) and info.block_size == BS and info.enabled
        session = await client.call(CreateSession(session_id="s1", owner=None))
        assert isinstance(session, SessionInfo) and session.branches[0].branch_id == "main"
        assert (await client.call(GetSession(session_id="s1"))).session_id == "s1"
        fork = await client.call(Fork(session_id="s1", branch_id="b"))
        assert fork.parent == "main"
        listed = await client.call(ListBranches(session_id="s1"))
        assert [b.branch_id for b in listed.root] == ["main", "b"]
        assert (await client.call(GetBranch(session_id="s1", branch_id="b"))).branch_id == "b"
        pinned = await client.call(Pin(session_id="s1", branch_id="b", ttl_s=5))
        assert pinned.pinned
        assert not (await client.call(Unpin(session_id="s1", branch_id="b"))).pinned
        plan = await client.call(PlanPrefetch(session_id="s1", branch_id="b"))
        assert plan.token_ids == [] and plan.location is None
        assert (await client.call(Split(tag="nobody"))).root is None
        stats = await client.call(GetStats())
        assert stats.num_own_sessions == 1 and stats.sessions[0].session_id == "s1"
        assert (await client.call(ResetStore())).dropped_blocks == 0
        deleted = await client.call(DeleteBranch(session_id="s1", branch_id="b"))
        assert deleted.deleted == "b"
        assert (await client.call(DeleteSession(session_id="s1"))).deleted == "s1"
        with pytest.raises(ControlError) as exc:
            await client.call(GetSession(session_id="s1"))
        assert exc.value.status == 404

    asyncio.run(main())
    assert call_sync(path, GetStats(all_owners=True)).sessions == []


def test_a_composing_connectors_op_is_typed_too(side):
    """P/D's ``claim_hold`` rides in ``extra_ops`` as an :class:`Op` (outside the planner's
    lock); its request and answer are validated like every other op's."""
    seen: list[ClaimHold] = []

    def claim(_side: Any, req: ClaimHold) -> dict:
        seen.append(req)
        return {CLAIM_FIELD: {"handle": "m", "until": 2.0, "until_perf": 3.0, "mac": "x"}}

    side.extra_ops[ClaimHold.op] = Op(ClaimHold, claim, locked=False)
    assert side.control is not None
    result = call_sync(side.control.path, ClaimHold(handle={"remote_request_id": "r"}))
    assert isinstance(result, HoldClaimResult) and result.kvbranch_claim.until == 2.0
    assert seen == [ClaimHold(handle={"remote_request_id": "r"})]
    side.extra_ops[ClaimHold.op] = Op(ClaimHold, lambda _side, req: {CLAIM_FIELD: {}}, locked=False)
    with pytest.raises(ControlError) as exc:
        call_sync(side.control.path, ClaimHold(handle={}))
    assert exc.value.status == 500 and "'kvbranch_claim.until'" in exc.value.message
    with pytest.raises(ControlError) as exc:
        call_sync_raw(side.control.path, "claim_hold", handle="not a dict")
    assert exc.value.status == 400 and "'handle'" in exc.value.message


def test_the_real_pd_claim_answers_the_contracts_claim():
    """``VerifiedNixlConnector.claim_hold`` (stand-in ``self``: its secret and holds) takes the
    typed request and answers what :class:`~sdk.contract.HoldClaimResult` says."""
    import time
    from types import SimpleNamespace

    from server.connector.control.models import check_answer
    from server.connector.pd.hold_registry import Hold, HoldRegistry
    from server.connector.pd.transfer_auth import EXPIRES_FIELD, MAC_FIELD, seal
    from server.connector.pd.verified_nixl import VerifiedNixlConnector

    secret = b"s" * 32
    handle = seal({"remote_request_id": "r1", EXPIRES_FIELD: time.time() + 60}, secret)
    holds = HoldRegistry(claim_ttl_s=10.0)
    holds.add(Hold("r1", handle[MAC_FIELD], 2))
    nixl = SimpleNamespace(secret=secret, holds=holds)
    result = VerifiedNixlConnector.claim_hold(nixl, ClaimHold(handle=handle))  # type: ignore[arg-type]
    claim = check_answer(HoldClaimResult, result, ClaimHold.op, "test").kvbranch_claim
    assert claim.handle == handle[MAC_FIELD] and claim.until > time.time()
    with pytest.raises(ControlError) as exc:  # claimed once: the second claim is refused
        VerifiedNixlConnector.claim_hold(nixl, ClaimHold(handle=handle))  # type: ignore[arg-type]
    assert exc.value.status == 410
