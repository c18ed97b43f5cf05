"""Issue 22 item 3b: ``/v1/kvbranch/stats`` runs under the planner's lock in the engine core,
so it lists a bounded number of sessions and makes a bounded number of block lookups."""

from __future__ import annotations

from types import SimpleNamespace

from server.connector.control import ops as control_ops
from server.connector.core.block_index import HostBlockIndex
from server.connector.core.planner import Planner
from server.connector.core.sessions import DEFAULT_BRANCH
from tests.unit.server.connector.fakes import make_planner

BS = 16


class CountingIndex(HostBlockIndex):
    lookups = 0

    def __contains__(self, block_hash: bytes) -> bool:
        CountingIndex.lookups += 1
        return super().__contains__(block_hash)


def test_stats_lists_recent_sessions_and_bounds_its_block_walk():
    _, index, reg = make_planner(budget_blocks=32, index=CountingIndex(64), block_size=BS)
    hashes = [b"h%031d" % k for k in range(512)]
    tokens = list(range(512 * BS))
    n_sessions = control_ops.STATS_MAX_SESSIONS + 50
    for i in range(n_sessions):
        reg.observe_request(f"s{i}", DEFAULT_BRANCH, tokens, hashes, None)
        for j in range(8):
            reg.fork(f"s{i}", DEFAULT_BRANCH, f"b{j}")
    reg.get_session("s0")  # the most recently used now
    side = SimpleNamespace(
        planner=Planner(index, reg, BS),
        block_bytes=1,
        window_bytes=0,
        state_bytes=0,
        extra_stats={},
        num_slots=64,
    )
    CountingIndex.lookups = 0
    stats = control_ops.stats_of(side, None)  # type: ignore[arg-type]
    listed = [s["session_id"] for s in stats["sessions"]]
    assert len(listed) == control_ops.STATS_MAX_SESSIONS and listed[-1] == "s0"
    assert stats["num_own_sessions"] == n_sessions
    # 100 sessions x 9 branches x 512 blocks would be 460,800 lookups.
    assert CountingIndex.lookups <= control_ops.STATS_WALK_BUDGET
    counted = [b for s in stats["sessions"] for b in s["branches"] if "stored_blocks" in b]
    assert counted and all(b["stored_blocks"] == 0 for b in counted)
    # One session's own route still counts everything.
    info = reg.session_info(reg.get_session("s1"))
    assert all("stored_blocks" in b for b in info["branches"]) and "pinned_blocks" in info
