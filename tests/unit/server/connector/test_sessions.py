"""SessionRegistry: sessions, owners, forks sharing blocks, TTL leases, the pin budget."""

from __future__ import annotations

import pytest

from server.connector.core.block_index import HostBlockIndex
from server.connector.core.sessions import (
    DEFAULT_BRANCH,
    Conflict,
    NotFound,
    RegistryError,
    SessionRegistry,
    new_id,
)

BS = 4
BLOCK_BYTES = 100


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def make(num_slots: int = 20, budget_blocks: int = 6, ttl: float = 60.0, **kw):
    clock = FakeClock()
    index = HostBlockIndex(num_slots)
    reg = SessionRegistry(
        index,
        block_size=BS,
        block_bytes=BLOCK_BYTES,
        pin_budget_bytes=budget_blocks * BLOCK_BYTES,
        default_ttl_s=ttl,
        clock=clock,
        wall_clock=lambda: 12345.0,
        **kw,
    )
    return reg, index, clock


def conv(tag: str, n_blocks: int, extra_tokens: int = 0, base: list[int] | None = None):
    """Tokens and per-full-block hashes; hashes chain over the prefix like vLLM's."""
    tokens = list(base or [])
    start = len(tokens)
    tokens += [hash((tag, i)) % 50_000 for i in range(start, n_blocks * BS + extra_tokens)]
    hashes = [f"{tuple(tokens[: (k + 1) * BS])}".encode() for k in range(len(tokens) // BS)]
    return tokens, hashes


def observe(reg, sid, branch, tokens, hashes, salt=None, owner=None):
    return reg.observe_request(sid, branch, tokens, hashes, salt, owner=owner)


def unpinned_session(reg, tag: str, n_blocks: int):
    """Session "s" created without auto pin, its main branch observed on ``conv(tag, n_blocks)``
    (so nothing is pinned yet); returns those tokens and hashes."""
    reg.create_session("s", auto_pin=False)
    tokens, hashes = conv(tag, n_blocks)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    return tokens, hashes


# --- sessions ---------------------------------------------------------------------------------
def test_new_id_is_prefixed_and_unique():
    ids = {new_id("sess") for _ in range(200)}
    assert len(ids) == 200
    assert all(i.startswith("sess_") and len(i) > 20 for i in ids)


def test_create_session_defaults():
    reg, _, _ = make(ttl=42.0)
    s = reg.create_session()
    assert s.session_id.startswith("sess_")
    assert s.auto_pin is True
    assert s.pin_ttl_s == 42.0
    assert s.created_at == 12345.0
    assert s.owner is None
    assert list(s.branches) == [DEFAULT_BRANCH]
    assert reg.get_session(s.session_id) is s
    assert reg.get_branch(s.session_id, DEFAULT_BRANCH).session_id == s.session_id


def test_create_session_explicit_id_and_options():
    reg, _, _ = make()
    s = reg.create_session("mine", auto_pin=False, pin_ttl_s=5.0, owner="t_a")
    assert s.session_id == "mine" and not s.auto_pin and s.pin_ttl_s == 5.0
    assert s.owner == "t_a"


def test_create_duplicate_session_conflicts():
    reg, _, _ = make()
    reg.create_session("s1")
    with pytest.raises(Conflict) as exc:
        reg.create_session("s1")
    assert exc.value.status == 409


def test_same_id_under_another_owner_is_another_session():
    """Issue 13 item 8: sessions are keyed by (tenant, id); creating another tenant's id
    behaves exactly as creating a fresh one (no existence probe, no squatting)."""
    reg, _, _ = make()
    a = reg.create_session("s1", owner="t_a")
    b = reg.create_session("s1", owner="t_b")
    assert a is not b and b.owner == "t_b"
    assert reg.get_session("s1", "t_a") is a and reg.get_session("s1", "t_b") is b
    reg.delete_session("s1", "t_b")
    assert reg.get_session("s1", "t_a") is a


def test_max_sessions():
    reg, _, _ = make(max_sessions=2)
    reg.create_session("a")
    reg.create_session("b")
    with pytest.raises(Conflict):
        reg.create_session("c")
    reg.delete_session("a")
    reg.create_session("c")


def test_error_statuses():
    assert RegistryError("x").status == 400
    assert NotFound("x").status == 404
    assert Conflict("x").status == 409
    assert Conflict("boom").message == "boom"
    assert issubclass(NotFound, RegistryError) and issubclass(Conflict, RegistryError)


def test_get_unknown_session_and_branch():
    reg, _, _ = make()
    with pytest.raises(NotFound):
        reg.get_session("nope")
    reg.create_session("s")
    with pytest.raises(NotFound):
        reg.get_branch("s", "nope")
    with pytest.raises(NotFound):
        reg.delete_branch("s", "nope")


def test_delete_session():
    reg, index, _ = make()
    tokens, hashes = conv("a", 3)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    assert index.pinned_hashes == 3
    assert reg.delete_session("s") == 3
    assert index.pinned_hashes == 0
    with pytest.raises(NotFound):
        reg.get_session("s")
    with pytest.raises(NotFound):
        reg.delete_session("s")


# --- owner isolation --------------------------------------------------------------------------
def test_owner_isolation_everywhere():
    reg, index, _ = make()
    tokens, hashes = conv("a", 2)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes, owner="t_a")
    for other in ("t_b", None):
        with pytest.raises(NotFound):
            reg.get_session("s", other)
        with pytest.raises(NotFound):
            reg.get_branch("s", DEFAULT_BRANCH, other)
        with pytest.raises(NotFound):
            reg.fork("s", DEFAULT_BRANCH, "f", owner=other)
        with pytest.raises(NotFound):
            reg.pin("s", DEFAULT_BRANCH, 10.0, owner=other)
        with pytest.raises(NotFound):
            reg.unpin("s", DEFAULT_BRANCH, owner=other)
        with pytest.raises(NotFound):
            reg.delete_branch("s", DEFAULT_BRANCH, owner=other)
        with pytest.raises(NotFound):
            reg.delete_session("s", owner=other)
    # the owner's state is untouched by the refused calls
    branch = reg.get_branch("s", DEFAULT_BRANCH, "t_a")
    assert branch.requests == 1 and branch.pinned
    assert index.pinned_hashes == 2
    assert "f" not in reg.get_session("s", "t_a").branches
    # a request of another tenant naming "s" makes that tenant's own session
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes, owner="t_b")
    assert reg.get_branch("s", DEFAULT_BRANCH, "t_a").requests == 1
    assert reg.get_branch("s", DEFAULT_BRANCH, "t_b").requests == 1


# --- forks ------------------------------------------------------------------------------------
def test_fork_by_token_offset():
    reg, _, _ = make()
    tokens, hashes = conv("a", 3, extra_tokens=2)  # 14 tokens, 3 full blocks
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes, salt="salty")
    fork = reg.fork("s", DEFAULT_BRANCH, "f", token_offset=9)
    assert fork.branch_id == "f" and fork.parent == DEFAULT_BRANCH
    assert fork.fork_offset_tokens == 9
    assert fork.token_ids == tokens[:9]
    assert fork.block_hashes == hashes[:2]
    assert fork.cache_salt == "salty"
    assert reg.get_branch("s", "f") is fork


def test_fork_token_offset_zero_and_end():
    reg, _, _ = make()
    tokens, hashes = conv("a", 2)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    zero = reg.fork("s", DEFAULT_BRANCH, "zero", token_offset=0)
    assert zero.token_ids == [] and zero.block_hashes == []
    end = reg.fork("s", DEFAULT_BRANCH, "end", token_offset=len(tokens))
    assert end.token_ids == tokens and end.block_hashes == hashes


def test_fork_offset_past_end_is_400():
    reg, _, _ = make()
    tokens, hashes = conv("a", 2)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    with pytest.raises(RegistryError) as exc:
        reg.fork("s", DEFAULT_BRANCH, "f", token_offset=len(tokens) + 1)
    assert exc.value.status == 400
    assert "f" not in reg.get_session("s").branches


def test_fork_by_token_prefix_uses_longest_common_prefix():
    reg, _, _ = make()
    tokens, hashes = conv("a", 3)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    prefix = tokens[:6] + [-5, -6, -7]
    fork = reg.fork("s", DEFAULT_BRANCH, "f", token_prefix=prefix)
    assert fork.fork_offset_tokens == 6
    assert fork.token_ids == tokens[:6]
    assert fork.block_hashes == hashes[:1]
    longer = reg.fork("s", DEFAULT_BRANCH, "g", token_prefix=tokens + [1, 2, 3])
    assert longer.fork_offset_tokens == len(tokens)
    # token_prefix wins over token_offset
    both = reg.fork("s", DEFAULT_BRANCH, "h", token_offset=1, token_prefix=tokens[:5])
    assert both.fork_offset_tokens == 5


def test_fork_default_is_whole_parent_and_generated_id():
    reg, _, _ = make()
    tokens, hashes = conv("a", 2, extra_tokens=3)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    fork = reg.fork("s", DEFAULT_BRANCH)
    assert fork.branch_id.startswith("br_")
    assert fork.token_ids == tokens and fork.block_hashes == hashes
    assert fork.fork_offset_tokens == len(tokens)
    # the fork shares the parent's (immutable) tokens; its own turn leaves the parent alone
    assert fork.token_ids is reg.get_branch("s", DEFAULT_BRANCH).token_ids
    assert not hasattr(fork.token_ids, "append")
    observe(reg, "s", fork.branch_id, tokens + [1], hashes)
    assert reg.get_branch("s", fork.branch_id).token_ids == tokens + [1]
    assert reg.get_branch("s", DEFAULT_BRANCH).token_ids == tokens


def test_fork_duplicate_branch_conflicts_and_unknown_parent():
    reg, _, _ = make()
    reg.create_session("s")
    reg.fork("s", DEFAULT_BRANCH, "f")
    with pytest.raises(Conflict):
        reg.fork("s", DEFAULT_BRANCH, "f")
    with pytest.raises(Conflict):
        reg.fork("s", "f", DEFAULT_BRANCH)
    with pytest.raises(NotFound):
        reg.fork("s", "nope", "g")
    with pytest.raises(NotFound):
        reg.fork("nope", DEFAULT_BRANCH, "g")


def test_fork_shares_blocks_by_reference():
    reg, index, _ = make()
    tokens, hashes = conv("a", 4)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    assert index.pinned_hashes == 4
    fork = reg.fork("s", DEFAULT_BRANCH, "f", token_offset=12)
    assert fork.pinned
    assert fork.pinned_hashes == hashes[:3]
    assert index.pinned_hashes == 4  # nothing new pinned: shared
    assert [index.pin_count(x) for x in hashes] == [2, 2, 2, 1]
    info = reg.session_info(reg.get_session("s"))
    assert info["pinned_blocks"] == 4
    assert info["pinned_bytes"] == 4 * BLOCK_BYTES


def test_deleting_fork_releases_only_its_own_blocks():
    reg, index, _ = make(budget_blocks=10)
    tokens, hashes = conv("a", 3)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    fork = reg.fork("s", DEFAULT_BRANCH, "f", token_offset=8)
    f_tokens, f_hashes = conv("b", 5, base=fork.token_ids)
    assert f_hashes[:2] == hashes[:2]
    observe(reg, "s", "f", f_tokens, f_hashes)
    assert index.pinned_hashes == 3 + 3  # main's 3 + the fork's own 3
    released = reg.delete_branch("s", "f")
    assert released == 3
    assert index.pinned_hashes == 3
    assert all(index.pin_count(x) == 1 for x in hashes)
    assert all(index.pin_count(x) == 0 for x in f_hashes[2:])
    assert "f" not in reg.get_session("s").branches


def test_deleting_parent_keeps_fork_blocks_pinned():
    reg, index, _ = make()
    tokens, hashes = conv("a", 3)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    reg.fork("s", DEFAULT_BRANCH, "f", token_offset=8)
    assert reg.delete_branch("s", DEFAULT_BRANCH) == 1  # only block 3 was main's alone
    assert index.pinned_hashes == 2
    assert reg.delete_session("s") == 2
    assert index.pinned_hashes == 0


def test_fork_of_unpinned_parent_without_auto_pin_is_unpinned():
    reg, index, _ = make()
    tokens, hashes = unpinned_session(reg, "a", 2)
    assert not reg.get_branch("s", DEFAULT_BRANCH).pinned
    fork = reg.fork("s", DEFAULT_BRANCH, "f")
    assert not fork.pinned and fork.pinned_hashes == []
    assert index.pinned_hashes == 0


def test_fork_of_pinned_parent_without_auto_pin_is_pinned_with_parent_ttl():
    reg, index, clock = make()
    tokens, hashes = unpinned_session(reg, "a", 2)
    reg.pin("s", DEFAULT_BRANCH, 7.0)
    fork = reg.fork("s", DEFAULT_BRANCH, "f")
    assert fork.pinned
    assert fork.pin_ttl_s == 7.0
    assert fork.pin_expires_at == clock.now + 7.0
    assert index.pinned_hashes == 2


# --- TTL --------------------------------------------------------------------------------------
def test_pin_ttl_expires_with_fake_clock():
    reg, index, clock = make()
    tokens, hashes = unpinned_session(reg, "a", 3)
    assert index.pinned_hashes == 0
    branch = reg.pin("s", DEFAULT_BRANCH, 10.0)
    assert branch.pinned and branch.pin_expires_at == clock.now + 10.0
    assert index.pinned_hashes == 3
    assert reg.branch_info(branch)["pin_expires_in_s"] == 10.0
    clock.advance(9.5)
    assert reg.expire() == 0
    assert branch.pinned
    assert reg.branch_info(branch)["pin_expires_in_s"] == 0.5
    clock.advance(0.5)
    assert reg.expire() == 1
    assert not branch.pinned
    assert branch.pin_expires_at is None
    assert branch.pinned_hashes == []
    assert index.pinned_hashes == 0
    assert reg.expire() == 0
    assert reg.branch_info(branch)["pin_expires_in_s"] is None


def test_use_renews_lease():
    reg, index, clock = make(ttl=10.0)
    tokens, hashes = conv("a", 2)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    branch = reg.get_branch("s", DEFAULT_BRANCH)
    assert branch.pin_expires_at == clock.now + 10.0
    clock.advance(8)
    tokens2, hashes2 = conv("a", 3)
    observe(reg, "s", DEFAULT_BRANCH, tokens2, hashes2)
    assert branch.pin_expires_at == clock.now + 10.0
    clock.advance(8)
    assert reg.expire() == 0
    assert index.pinned_hashes == 3
    clock.advance(2)
    assert reg.expire() == 1
    assert index.pinned_hashes == 0


def test_unpin_releases_and_clears_lease():
    reg, index, _ = make()
    tokens, hashes = conv("a", 2)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    branch = reg.unpin("s", DEFAULT_BRANCH)
    assert not branch.pinned and branch.pin_expires_at is None and not branch.degraded
    assert index.pinned_hashes == 0
    # blocks are LRU again: evictable
    for x in hashes:
        index.allocate(x, [0] * BS)
    for i in range(index.num_slots):
        index.allocate(f"other{i}".encode(), [i] * BS)
    assert all(x not in index for x in hashes)


def test_session_ttl_used_for_new_branches():
    reg, _, clock = make(ttl=60.0)
    reg.create_session("s", pin_ttl_s=3.0)
    tokens, hashes = conv("a", 1)
    branch = observe(reg, "s", "other", tokens, hashes)
    assert branch.pin_ttl_s == 3.0
    assert branch.pin_expires_at == clock.now + 3.0


# --- budget -----------------------------------------------------------------------------------
def test_budget_is_capped_by_slots():
    clock = FakeClock()
    reg = SessionRegistry(
        HostBlockIndex(5),
        block_size=BS,
        block_bytes=BLOCK_BYTES,
        pin_budget_bytes=10_000,
        default_ttl_s=1,
        clock=clock,
    )
    assert reg.leases.pin_budget_blocks == 5
    assert reg.leases.pin_budget_bytes == 5 * BLOCK_BYTES


def test_oldest_lease_degrades_when_budget_is_full():
    reg, index, clock = make(budget_blocks=6)
    ta, ha = conv("a", 3)
    tb, hb = conv("b", 2)
    tc, hc = conv("c", 3)
    a = observe(reg, "A", DEFAULT_BRANCH, ta, ha)
    clock.advance(1)
    b = observe(reg, "B", DEFAULT_BRANCH, tb, hb)
    clock.advance(1)
    assert index.pinned_hashes == 5
    c = observe(reg, "C", DEFAULT_BRANCH, tc, hc)  # needs 3, 1 free: A (oldest) degrades
    assert a.degraded and not a.pinned and a.pinned_hashes == []
    assert b.pinned and not b.degraded
    assert c.pinned
    assert reg.leases.pins_degraded == 1
    assert index.pinned_hashes == 5
    assert all(index.pin_count(x) == 0 for x in ha)
    assert reg.branch_info(a)["degraded"] is True


def leases_a_then_b(budget_blocks: int):
    """Sessions A, then B a second later, each auto-pinned on 3 blocks of its own:
    (reg, index, clock, a, b, A's tokens, A's hashes)."""
    reg, index, clock = make(budget_blocks=budget_blocks)
    ta, ha = conv("a", 3)
    tb, hb = conv("b", 3)
    a = observe(reg, "A", DEFAULT_BRANCH, ta, ha)
    clock.advance(1)
    b = observe(reg, "B", DEFAULT_BRANCH, tb, hb)
    return reg, index, clock, a, b, ta, ha


def test_degrade_order_follows_pinned_at_not_creation():
    reg, _, clock, a, b, ta, ha = leases_a_then_b(budget_blocks=6)
    clock.advance(1)
    observe(reg, "A", DEFAULT_BRANCH, ta, ha)  # renew A: B is now the oldest lease
    clock.advance(1)
    tc, hc = conv("c", 2)
    observe(reg, "C", DEFAULT_BRANCH, tc, hc)
    assert a.pinned and b.degraded


def test_explicit_pin_larger_than_budget_is_409():
    reg, index, _ = make(budget_blocks=4)
    tokens, hashes = unpinned_session(reg, "a", 5)
    with pytest.raises(Conflict) as exc:
        reg.pin("s", DEFAULT_BRANCH, 30.0)
    assert exc.value.status == 409
    assert "budget" in exc.value.message
    assert reg.leases.pins_refused == 1
    assert index.pinned_hashes == 0
    assert not reg.get_branch("s", DEFAULT_BRANCH).pinned


def lease_a_then_unpinned_s(n_blocks: int):
    """A 4-block budget: session A auto-pinned on 3 blocks, then (a second later) session "s"
    unpinned on ``n_blocks`` others: (reg, index, a)."""
    reg, index, clock = make(budget_blocks=4)
    ta, ha = conv("a", 3)
    a = observe(reg, "A", DEFAULT_BRANCH, ta, ha)
    clock.advance(1)
    unpinned_session(reg, "b", n_blocks)
    return reg, index, a


def test_explicit_pin_over_budget_does_not_degrade_others():
    reg, index, a = lease_a_then_unpinned_s(5)
    with pytest.raises(Conflict):
        reg.pin("s", DEFAULT_BRANCH, 30.0)
    assert a.pinned and not a.degraded
    assert index.pinned_hashes == 3


def test_automatic_pin_larger_than_budget_degrades_without_error():
    reg, index, _ = make(budget_blocks=4)
    tokens, hashes = conv("a", 5)
    branch = observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    assert branch.degraded and not branch.pinned
    assert reg.leases.pins_refused == 0
    assert reg.leases.pins_degraded == 1
    assert index.pinned_hashes == 0


def test_explicit_pin_that_fits_degrades_older_leases():
    reg, index, a = lease_a_then_unpinned_s(3)
    b = reg.pin("s", DEFAULT_BRANCH, 30.0)
    assert b.pinned and a.degraded
    assert index.pinned_hashes == 3


def test_degraded_branch_repins_on_next_use():
    reg, index, clock, a, b, ta, ha = leases_a_then_b(budget_blocks=4)
    assert a.degraded and b.pinned
    clock.advance(1)
    observe(reg, "A", DEFAULT_BRANCH, ta, ha)
    assert a.pinned and not a.degraded
    assert a.pinned_hashes == ha
    assert b.degraded
    assert reg.leases.pins_degraded == 2
    assert index.pinned_hashes == 3


def test_degraded_branch_of_non_autopin_session_repins_on_use():
    reg, _, clock = make(budget_blocks=4)
    reg.create_session("A", auto_pin=False)
    ta, ha = conv("a", 3)
    observe(reg, "A", DEFAULT_BRANCH, ta, ha)
    a = reg.pin("A", DEFAULT_BRANCH, 100.0)
    clock.advance(1)
    tb, hb = conv("b", 3)
    observe(reg, "B", DEFAULT_BRANCH, tb, hb)
    assert a.degraded
    clock.advance(1)
    observe(reg, "A", DEFAULT_BRANCH, ta, ha)  # lease exists (degraded): renewed
    assert a.pinned and a.pin_ttl_s == 100.0
    assert a.pin_expires_at == clock.now + 100.0


def test_growing_pin_keeps_shared_blocks_counted_once():
    reg, index, _ = make(budget_blocks=6)
    tokens, hashes = conv("a", 2)
    branch = observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    tokens2, hashes2 = conv("a", 4)
    assert hashes2[:2] == hashes
    observe(reg, "s", DEFAULT_BRANCH, tokens2, hashes2)
    assert branch.pinned_hashes == hashes2
    assert [index.pin_count(x) for x in hashes2] == [1, 1, 1, 1]
    assert index.pinned_hashes == 4


def test_changed_branch_unpins_blocks_it_no_longer_has():
    reg, index, _ = make(budget_blocks=6)
    tokens, hashes = conv("a", 3)
    observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    other_tokens, other_hashes = conv("z", 2)
    branch = observe(reg, "s", DEFAULT_BRANCH, other_tokens, other_hashes)
    assert branch.pinned_hashes == other_hashes
    assert index.pinned_hashes == 2
    assert all(index.pin_count(x) == 0 for x in hashes)


# --- observe_request --------------------------------------------------------------------------
def test_observe_request_auto_creates_session_and_branch():
    reg, index, clock = make(ttl=30.0)
    tokens, hashes = conv("a", 2, extra_tokens=1)
    branch = observe(reg, "new", "b1", tokens, hashes, salt="s1", owner="t_x")
    session = reg.get_session("new", "t_x")
    assert session.owner == "t_x" and session.auto_pin
    assert set(session.branches) == {DEFAULT_BRANCH, "b1"}
    assert branch.token_ids == tokens and branch.block_hashes == hashes
    assert branch.cache_salt == "s1"
    assert branch.requests == 1
    assert branch.pinned and branch.pin_expires_at == clock.now + 30.0
    assert index.pinned_hashes == 2
    observe(reg, "new", "b1", tokens, hashes, salt="s1", owner="t_x")
    assert branch.requests == 2


def test_branch_info_and_session_info():
    reg, index, clock = make()
    tokens, hashes = conv("a", 3, extra_tokens=1)
    index.allocate(hashes[0], tokens[:BS])
    index.allocate(hashes[1], tokens[BS : 2 * BS])
    branch = observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
    info = reg.branch_info(branch)
    assert info == {
        "session_id": "s",
        "branch_id": DEFAULT_BRANCH,
        "parent": None,
        "fork_offset_tokens": None,
        "num_tokens": 13,
        "pinned": True,
        "pin_expires_in_s": 60.0,
        "pinned_blocks": 3,
        "pinned_bytes": 3 * BLOCK_BYTES,
        "stored_blocks": 2,
        "degraded": False,
        "requests": 1,
    }
    sinfo = reg.session_info(reg.get_session("s"))
    assert sinfo["session_id"] == "s"
    assert sinfo["auto_pin"] is True
    assert [b["branch_id"] for b in sinfo["branches"]] == [DEFAULT_BRANCH]
    assert sinfo["pinned_blocks"] == 3


def test_request_running_at_delete_does_not_resurrect_the_session():
    from server.connector.core.block_index import HostBlockIndex
    from server.connector.core.sessions import SessionRegistry

    now = [100.0]
    registry = SessionRegistry(
        HostBlockIndex(16),
        block_size=4,
        block_bytes=1,
        pin_budget_bytes=8,
        default_ttl_s=60,
        clock=lambda: now[0],
    )
    registry.create_session("s")
    arrived = now[0]
    now[0] += 1
    registry.delete_session("s")
    now[0] += 1
    assert (
        registry.observe_request("s", "main", [1, 2, 3, 4], [b"h"], None, arrived_at=arrived)
        is None
    )
    assert (None, "s") not in registry.sessions
    # a request that arrives after the delete starts a fresh session
    assert (
        registry.observe_request("s", "main", [1, 2, 3, 4], [b"h"], None, arrived_at=now[0])
        is not None
    )
    assert registry.sessions[(None, "s")].branches["main"].pinned


# --- issue 13 item 8: (tenant, id) keys, quotas, idle expiry ------------------------------------
def _same_error(call_a, call_b) -> None:
    """Both raise the same error class with the same message (ids aside)."""
    errors = []
    for call in (call_a, call_b):
        with pytest.raises(RegistryError) as exc:
            call()
        errors.append(exc.value)
    assert type(errors[0]) is type(errors[1]) and errors[0].status == errors[1].status
    assert errors[0].message.replace("theirs", "X") == errors[1].message.replace("nobody", "X")


def test_another_tenants_id_looks_like_an_id_nobody_made():
    reg, _, _ = make()
    reg.create_session("theirs", owner="t_a")
    for op in (
        lambda sid: reg.get_session(sid, "t_b"),
        lambda sid: reg.get_branch(sid, DEFAULT_BRANCH, "t_b"),
        lambda sid: reg.fork(sid, DEFAULT_BRANCH, owner="t_b"),
        lambda sid: reg.pin(sid, DEFAULT_BRANCH, 5.0, "t_b"),
        lambda sid: reg.unpin(sid, DEFAULT_BRANCH, "t_b"),
        lambda sid: reg.delete_branch(sid, DEFAULT_BRANCH, "t_b"),
        lambda sid: reg.delete_session(sid, "t_b"),
    ):
        _same_error(lambda op=op: op("theirs"), lambda op=op: op("nobody"))
    assert reg.get_session("theirs", "t_a").branches[DEFAULT_BRANCH].pin_expires_at is None


def test_a_request_naming_another_tenants_session_makes_its_own():
    reg, _, _ = make()
    reg.create_session("s", owner="t_a")
    tokens, hashes = conv("x", 2)
    branch = observe(reg, "s", DEFAULT_BRANCH, tokens, hashes, owner="t_b")
    assert branch is not None and reg.get_session("s", "t_b").branches[DEFAULT_BRANCH] is branch
    assert reg.get_branch("s", DEFAULT_BRANCH, "t_a").requests == 0


def test_sessions_per_tenant_quota_is_429_and_per_tenant():
    reg, _, _ = make(max_sessions_per_tenant=2)
    reg.create_session("a1", owner="t_a")
    reg.create_session("a2", owner="t_a")
    with pytest.raises(RegistryError) as exc:
        reg.create_session("a3", owner="t_a")
    assert exc.value.status == 429 and "2 sessions" in exc.value.message
    reg.create_session("b1", owner="t_b")  # another tenant is not affected
    reg.delete_session("a1", "t_a")
    reg.create_session("a3", owner="t_a")
    # a chat request naming a new session over the quota is refused the same way
    with pytest.raises(RegistryError) as exc:
        observe(reg, "a4", DEFAULT_BRANCH, *conv("x", 1), owner="t_a")
    assert exc.value.status == 429


def test_branches_per_session_quota_is_409():
    reg, _, _ = make(max_branches_per_session=3)
    reg.create_session("s", owner="t_a")
    reg.fork("s", DEFAULT_BRANCH, "b1", owner="t_a")
    observe(reg, "s", "b2", *conv("x", 1), owner="t_a")
    for make_one in (
        lambda: reg.fork("s", DEFAULT_BRANCH, "b3", owner="t_a"),
        lambda: observe(reg, "s", "b3", *conv("y", 1), owner="t_a"),
    ):
        with pytest.raises(Conflict) as exc:
            make_one()
        assert exc.value.status == 409 and "3 branches" in exc.value.message
        assert "already exists" not in exc.value.message  # the router's "created" marker
    reg.delete_branch("s", "b1", "t_a")
    reg.fork("s", DEFAULT_BRANCH, "b3", owner="t_a")


def test_tenant_share_of_the_pin_budget():
    """With a share of 0.5 of 6 blocks, one tenant's pins hold at most 3 blocks: its own
    oldest leases degrade first, and another tenant's pins are untouched."""
    reg, index, clock = make(budget_blocks=6, tenant_pin_share=0.5)
    assert reg.tenant_pin_blocks("t_a") == 3 and reg.tenant_pin_blocks(None) == 6
    b_tokens, b_hashes = conv("b", 2)
    reg.create_session("sb", owner="t_b")
    b_branch = observe(reg, "sb", DEFAULT_BRANCH, b_tokens, b_hashes, owner="t_b")
    clock.advance(1)
    reg.create_session("s1", owner="t_a")
    first = observe(reg, "s1", DEFAULT_BRANCH, *conv("a1", 2), owner="t_a")
    clock.advance(1)
    reg.create_session("s2", owner="t_a")
    second = observe(reg, "s2", DEFAULT_BRANCH, *conv("a2", 2), owner="t_a")
    assert second.pinned and first.degraded and b_branch.pinned
    assert index.pinned_hashes == 4
    # an explicit pin bigger than the share is refused with a message naming the share
    reg.create_session("s3", owner="t_a")
    big = observe(reg, "s3", DEFAULT_BRANCH, *conv("a3", 4), owner="t_a")
    assert big.degraded
    with pytest.raises(Conflict) as exc:
        reg.pin("s3", DEFAULT_BRANCH, 10.0, "t_a")
    assert "share" in exc.value.message and "already exists" not in exc.value.message


def test_idle_sessions_expire_and_release_their_pins():
    reg, index, clock = make(idle_ttl_s=100.0, ttl=1000.0)
    reg.create_session("old", owner="t_a")
    observe(reg, "old", DEFAULT_BRANCH, *conv("o", 2), owner="t_a")
    clock.advance(60)
    reg.create_session("young", owner="t_a")
    clock.advance(30)
    reg.get_session("old", "t_a")  # a use renews it
    clock.advance(80)  # old: idle 80 s, young: idle 110 s
    reg.expire()
    assert reg.get_session("old", "t_a") is not None
    with pytest.raises(NotFound):
        reg.get_session("young", "t_a")
    clock.advance(101)
    reg.expire()
    assert len(reg.sessions) == 0 and index.pinned_hashes == 0
    assert reg.sessions_expired == 2
    reg.create_session("young", owner="t_a")  # the quota counted them out


class _CountingDict(dict):
    walks = 0

    def values(self):
        _CountingDict.walks += 1
        return super().values()

    def items(self):
        _CountingDict.walks += 1
        return super().items()

    def __iter__(self):
        _CountingDict.walks += 1
        return super().__iter__()


def test_expiry_does_not_walk_every_branch():
    """expire() runs under the scheduler lock after every request: with nothing due it must
    not visit the sessions' branches, and with one lease due only that one."""
    reg, _, clock = make(num_slots=4000, budget_blocks=4000, ttl=50.0)
    for i in range(300):
        reg.create_session(f"s{i}", owner="t_a")
        observe(reg, f"s{i}", DEFAULT_BRANCH, *conv(f"c{i}", 1), owner="t_a")
        reg.fork(f"s{i}", DEFAULT_BRANCH, "f", owner="t_a")
        clock.advance(0.1)
    for session in reg.sessions.values():
        session.branches = _CountingDict(session.branches)
    _CountingDict.walks = 0
    assert reg.expire() == 0
    assert _CountingDict.walks == 0
    clock.now = 1000.0 + 50.0 + 0.05  # only s0's two leases (pinned at 1000.0) are due
    assert reg.expire() == 2
    assert _CountingDict.walks == 0


def test_lease_heap_stays_bounded_under_renewals():
    reg, _, clock = make(ttl=10.0)
    reg.create_session("s")
    tokens, hashes = conv("x", 2)
    for _ in range(5000):
        observe(reg, "s", DEFAULT_BRANCH, tokens, hashes)
        clock.advance(0.01)
        reg.expire()
    assert reg.lease_heap_size() < 200


def test_require_owner_keeps_ownerless_sessions_out():
    """With API keys, a request that reached the engine without an owner (a route kvbranch
    does not know) must not make a session that no key can reach."""
    reg, _, _ = make(require_owner=True)
    with pytest.raises(RegistryError):
        observe(reg, "s", DEFAULT_BRANCH, *conv("x", 1))
    with pytest.raises(RegistryError):
        reg.create_session("s")
    assert len(reg.sessions) == 0
    reg.create_session("s", owner="t_a")


def test_an_engine_keeps_no_state_for_another_engines_session():
    # several data-parallel engines: a turn that lands on the wrong engine (a route vLLM gives
    # no engine choice) must not start a second record of the session there
    from server.common.engine_choice import engine_of

    mine = next(f"s{i}" for i in range(100) if engine_of("t", f"s{i}", 2) == 1)
    theirs = next(f"s{i}" for i in range(100) if engine_of("t", f"s{i}", 2) == 0)
    reg, _, _ = make()
    reg.keeps_session = lambda owner, session: engine_of(owner, session, 2) == 1
    tokens, hashes = conv("a", 2)
    assert observe(reg, theirs, DEFAULT_BRANCH, tokens, hashes, owner="t") is None
    assert ("t", theirs) not in reg.sessions
    assert observe(reg, mine, DEFAULT_BRANCH, tokens, hashes, owner="t") is not None
    assert ("t", mine) in reg.sessions
