"""Where a prefetch finds a branch (issue 14 item 2: a prefetch costs no engine step when the
host store can bring the branch back): the control op over a real planner, block index and
session registry, with the device-residency probe as the only stand-in."""

from __future__ import annotations

from types import SimpleNamespace

from server.connector.control.models import PlanPrefetch
from server.connector.control.ops import OPS
from tests.unit.server.connector.fakes import BS, make_planner
from tests.unit.server.connector.test_tails import HISTORY, REPLY, FakeRequest, finish


def side_of(planner, *, on_device: bool = False, enabled: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        planner=planner, enabled=enabled, device_resident=lambda hashes: on_device
    )


def stored_branch():
    """A session's main branch whose two full blocks and tail are all in the host store."""
    planner, index, registry = make_planner(num_slots=8)
    first = FakeRequest("r0", HISTORY, 10)
    for k in range(2):
        index.allocate(first.block_hashes[k], HISTORY[k * BS : (k + 1) * BS])
    finish(planner, "r1", HISTORY, REPLY, session="s")
    planner.plan_tail_saves(set())
    branch = registry.get_branch("s", "main")
    assert len(branch.block_hashes) == 2 and index.slot_of(branch.tail_key) is not None
    return planner, index, branch


def plan(side, **extra):
    request = PlanPrefetch(session_id="s", branch_id="main", **extra)
    return OPS[PlanPrefetch.op].handler(side, request)


def test_a_branch_the_host_store_holds_runs_nothing_and_is_kept_warm():
    planner, index, branch = stored_branch()
    planner.registry.unpin("s", "main", None)  # a pin alone would keep them
    # fill the rest of the store so that the branch's blocks are the least recently used
    for k in range(5):
        index.allocate(f"other-{k}".encode(), (k,) * BS)
    result = plan(side_of(planner))
    assert result["location"] == "host" and planner.prefetches_skipped == 1
    assert result["token_ids"] == list(branch.token_ids)
    # the next allocation evicts another block, not one of the branch's
    index.allocate(b"newcomer", (9,) * BS)
    assert index.slot_of(b"other-0") is None
    for key in [*branch.block_hashes, branch.tail_key]:
        assert index.slot_of(key) is not None


def test_to_device_runs_the_branch_through_the_engine_anyway():
    planner, _, _ = stored_branch()
    assert plan(side_of(planner), to_device=True)["location"] is None
    assert planner.prefetches_skipped == 0


def test_device_resident_comes_first():
    planner, _, _ = stored_branch()
    assert plan(side_of(planner, on_device=True), to_device=True)["location"] == "device"
    assert planner.prefetches_skipped == 1


def test_a_branch_missing_one_block_from_the_host_store_runs_in_the_engine():
    planner, index, branch = stored_branch()
    index._drop(index.slot_of(branch.block_hashes[1]))
    assert plan(side_of(planner))["location"] is None
    assert planner.prefetches_skipped == 0


def test_without_a_host_store_the_engine_runs_it():
    planner, _, _ = stored_branch()
    assert plan(side_of(planner, enabled=False))["location"] is None
