"""Sessions and branches as the connector sees them: TTL pins inside a byte budget, forks that
share their parent's prefix blocks by reference, release on delete, per-tenant id spaces and
quotas, and expiry of idle sessions.

Tenants: a session is keyed by ``(owner, session_id)`` — the owner is the tenant id of the API
key that used it (``None`` on a server without keys). Each tenant has its own id space, so
reading, forking, deleting or creating an id behaves the same whether or not another tenant
uses that id (no existence probe, no squatting). Quotas per tenant: sessions (429), branches
per session (409), and a share of the pin budget (pins beyond it degrade the tenant's own
oldest leases; an explicit pin larger than the share is refused with 409).

Pin policy (documented in the README): pins are *leases*. Using a branch renews its lease. The
pin budget is a cap on the distinct blocks all pins hold; when a new or growing pin does not fit,
the oldest other leases are demoted to plain LRU retention ("degraded") until it fits. Only an
explicit pin of a branch that alone exceeds the whole budget (or its tenant's share) is refused
(HTTP 409). A chat request never fails because of a pin: its automatic pin degrades instead.

Expiry runs under the scheduler's lock after every request, so it never walks all branches:
lease deadlines sit in a heap (stale entries are skipped and compacted away), sessions in an
ordered dict by last use (idle ones are popped from its front).

Pure logic over :class:`HostBlockIndex`; the clock is injectable so tests need no sleeping.
"""

from __future__ import annotations

import heapq
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from server.connector.block_index import HostBlockIndex
from server.contract import ALREADY_EXISTS  # the router converges retries on this wording

DEFAULT_BRANCH = "main"
DEFAULT_MAX_SESSIONS_PER_TENANT = 1000
DEFAULT_MAX_BRANCHES_PER_SESSION = 256
DEFAULT_IDLE_TTL_S = 6 * 3600.0

#: (owner, session id): the registry's key of a session.
SessionKey = tuple[str | None, str]
_LeaseKey = tuple[str | None, str, str]  # (owner, session id, branch id)


class RegistryError(Exception):
    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(RegistryError):
    status = 404


class Conflict(RegistryError):
    status = 409


class QuotaExceeded(RegistryError):
    status = 429


class KeyRequired(RegistryError):
    status = 401


def new_id(prefix: str) -> str:
    """Unguessable ids: 128 random bits."""
    return f"{prefix}_{secrets.token_urlsafe(16)}"


@dataclass
class Branch:
    session_id: str
    branch_id: str
    parent: str | None = None
    fork_offset_tokens: int | None = None
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    pinned_hashes: list[bytes] = field(default_factory=list)
    pin_expires_at: float | None = None
    pin_ttl_s: float | None = None
    pinned_at: float = 0.0
    degraded: bool = False
    cache_salt: str | None = None
    requests: int = 0
    owner: str | None = None

    @property
    def pinned(self) -> bool:
        return self.pin_expires_at is not None and not self.degraded

    @property
    def lease_key(self) -> _LeaseKey:
        return (self.owner, self.session_id, self.branch_id)


@dataclass
class Session:
    session_id: str
    created_at: float
    auto_pin: bool
    pin_ttl_s: float
    owner: str | None = None
    branches: dict[str, Branch] = field(default_factory=dict)
    last_used: float = 0.0


class SessionRegistry:
    def __init__(
        self,
        index: HostBlockIndex,
        *,
        block_size: int,
        block_bytes: int,
        pin_budget_bytes: int,
        default_ttl_s: float,
        max_sessions: int = 100_000,
        max_sessions_per_tenant: int = DEFAULT_MAX_SESSIONS_PER_TENANT,
        max_branches_per_session: int = DEFAULT_MAX_BRANCHES_PER_SESSION,
        tenant_pin_share: float = 1.0,
        idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
        require_owner: bool = False,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.index = index
        self.block_size = block_size
        self.block_bytes = max(block_bytes, 1)
        self.pin_budget_blocks = min(pin_budget_bytes // self.block_bytes, index.num_slots)
        self.pin_budget_bytes = self.pin_budget_blocks * self.block_bytes
        self.default_ttl_s = default_ttl_s
        self.max_sessions = max_sessions
        self.max_sessions_per_tenant = max_sessions_per_tenant
        self.max_branches_per_session = max_branches_per_session
        self.tenant_pin_share = tenant_pin_share
        self.idle_ttl_s = idle_ttl_s
        #: With API keys every request has an owner; one without (a route kvbranch does not
        #: know) must not make a session that no key can reach.
        self.require_owner = require_owner
        self.clock = clock
        self.wall_clock = wall_clock
        #: Every session, least recently used first (idle expiry pops from the front).
        self.sessions: OrderedDict[SessionKey, Session] = OrderedDict()
        self._by_owner: dict[str | None, dict[str, Session]] = {}
        # When each recently deleted session went away: a request that was already running
        # at that moment must not bring the session (and its pins) back when it finishes.
        self.deleted_at: OrderedDict[SessionKey, float] = OrderedDict()
        # Lease deadlines: (expires_at, seq, lease key) in a heap; _deadline holds the live
        # one of each branch, so an entry that disagrees with it is stale and skipped.
        self._heap: list[tuple[float, int, _LeaseKey]] = []
        self._deadline: dict[_LeaseKey, float] = {}
        self._seq = 0
        # Branches that hold pins, oldest pin first: globally and per tenant.
        self._leases: OrderedDict[_LeaseKey, Branch] = OrderedDict()
        self._tenant_leases: dict[str | None, OrderedDict[_LeaseKey, Branch]] = {}
        # Per tenant: hash -> how many of its branches pin it (its share of the budget).
        self._tenant_pins: dict[str | None, dict[bytes, int]] = {}
        self.pins_degraded = 0
        self.pins_refused = 0
        self.sessions_expired = 0

    # --- tenants -----------------------------------------------------------------------------
    def tenant_pin_blocks(self, owner: str | None) -> int:
        """Blocks one tenant's pins may hold (the whole budget on a server without keys)."""
        if owner is None or self.tenant_pin_share >= 1.0:
            return self.pin_budget_blocks
        return min(self.pin_budget_blocks,
                   max(1, int(self.pin_budget_blocks * self.tenant_pin_share)))

    def sessions_of(self, owner: str | None) -> list[Session]:
        return list(self._by_owner.get(owner, {}).values())

    def _check_owner(self, owner: str | None) -> None:
        if owner is None and self.require_owner:
            raise KeyRequired("this server has API keys: sessions need one")

    # --- sessions ----------------------------------------------------------------------------
    def create_session(self, session_id: str | None = None, *, auto_pin: bool = True,
                       pin_ttl_s: float | None = None, owner: str | None = None) -> Session:
        self._check_owner(owner)
        session_id = session_id or new_id("sess")
        if (owner, session_id) in self.sessions:
            raise Conflict(f"session {session_id!r} {ALREADY_EXISTS}")
        mine = self._by_owner.get(owner, {})
        if len(mine) >= self.max_sessions_per_tenant:
            raise QuotaExceeded(
                f"session quota reached: this key has {len(mine)} sessions (the limit, "
                f"--max-sessions-per-tenant); delete some, or wait until idle ones expire "
                f"({self.idle_ttl_s:g} s without use)")
        if len(self.sessions) >= self.max_sessions:
            raise Conflict(f"too many sessions on this server ({self.max_sessions}); "
                           f"delete some first")
        now = self.clock()
        session = Session(session_id, self.wall_clock(), auto_pin,
                          pin_ttl_s or self.default_ttl_s, owner, last_used=now)
        session.branches[DEFAULT_BRANCH] = Branch(session_id, DEFAULT_BRANCH, owner=owner)
        self.sessions[(owner, session_id)] = session
        self._by_owner.setdefault(owner, {})[session_id] = session
        return session

    def get_session(self, session_id: str, owner: str | None = None) -> Session:
        """The caller's session (a use: it renews the idle clock)."""
        key = (owner, session_id)
        session = self.sessions.get(key)
        if session is None:
            raise NotFound(f"session {session_id!r} not found")
        session.last_used = self.clock()
        self.sessions.move_to_end(key)
        return session

    def get_branch(self, session_id: str, branch_id: str, owner: str | None = None) -> Branch:
        session = self.get_session(session_id, owner)
        branch = session.branches.get(branch_id)
        if branch is None:
            raise NotFound(f"branch {branch_id!r} not found in session {session_id!r}")
        return branch

    def delete_session(self, session_id: str, owner: str | None = None) -> int:
        session = self.get_session(session_id, owner)
        released = self._remove_session(session)
        key = (owner, session_id)
        self.deleted_at[key] = self.clock()
        while len(self.deleted_at) > self.max_sessions:
            self.deleted_at.popitem(last=False)
        return released

    def _remove_session(self, session: Session) -> int:
        released = 0
        for branch in session.branches.values():
            released += self._unpin_all(branch)
            self._deadline.pop(branch.lease_key, None)
        key = (session.owner, session.session_id)
        del self.sessions[key]
        mine = self._by_owner.get(session.owner)
        if mine is not None:
            mine.pop(session.session_id, None)
            if not mine:
                del self._by_owner[session.owner]
        return released

    # --- branches ----------------------------------------------------------------------------
    def _check_branch_quota(self, session: Session) -> None:
        if len(session.branches) >= self.max_branches_per_session:
            raise Conflict(
                f"branch quota reached: session {session.session_id!r} has "
                f"{len(session.branches)} branches (the limit, --max-branches-per-session); "
                f"delete some first")

    def fork(self, session_id: str, parent_id: str, new_branch_id: str | None = None, *,
             token_offset: int | None = None, token_prefix: Sequence[int] | None = None,
             owner: str | None = None) -> Branch:
        """New branch sharing ``parent``'s first ``token_offset`` tokens (or the longest
        common prefix with ``token_prefix``). Copies nothing: the new branch refers to the
        same block hashes, and pinning it only adds references."""
        session = self.get_session(session_id, owner)
        parent = self.get_branch(session_id, parent_id, owner)
        branch_id = new_branch_id or new_id("br")
        if branch_id in session.branches:
            raise Conflict(f"branch {branch_id!r} {ALREADY_EXISTS} in session {session_id!r}")
        self._check_branch_quota(session)
        if token_prefix is not None:
            offset = 0
            for mine, theirs in zip(parent.token_ids, token_prefix):
                if mine != theirs:
                    break
                offset += 1
        elif token_offset is not None:
            if token_offset > len(parent.token_ids):
                raise RegistryError(
                    f"token_offset {token_offset} is past the end of branch {parent_id!r} "
                    f"({len(parent.token_ids)} tokens)")
            offset = token_offset
        else:
            offset = len(parent.token_ids)
        full_blocks = offset // self.block_size
        branch = Branch(
            session_id, branch_id, parent=parent_id, fork_offset_tokens=offset,
            token_ids=parent.token_ids[:offset],
            block_hashes=parent.block_hashes[:full_blocks],
            cache_salt=parent.cache_salt, owner=owner,
        )
        session.branches[branch_id] = branch
        if session.auto_pin or parent.pinned:
            self._pin_branch(branch, parent.pin_ttl_s or session.pin_ttl_s, explicit=False)
        return branch

    def delete_branch(self, session_id: str, branch_id: str, owner: str | None = None) -> int:
        session = self.get_session(session_id, owner)
        branch = self.get_branch(session_id, branch_id, owner)
        released = self._unpin_all(branch)
        self._deadline.pop(branch.lease_key, None)
        del session.branches[branch_id]
        return released

    # --- pins --------------------------------------------------------------------------------
    def pin(self, session_id: str, branch_id: str, ttl_s: float,
            owner: str | None = None) -> Branch:
        branch = self.get_branch(session_id, branch_id, owner)
        self._pin_branch(branch, ttl_s, explicit=True)
        return branch

    def unpin(self, session_id: str, branch_id: str, owner: str | None = None) -> Branch:
        branch = self.get_branch(session_id, branch_id, owner)
        self._unpin_all(branch)
        self._deadline.pop(branch.lease_key, None)
        branch.pin_expires_at = None
        branch.degraded = False
        return branch

    def _pin_branch(self, branch: Branch, ttl_s: float, *, explicit: bool) -> None:
        owner = branch.owner
        wanted = list(dict.fromkeys(branch.block_hashes))
        already = set(branch.pinned_hashes)
        new = [h for h in wanted if h not in already]
        tenant = self._tenant_pins.setdefault(owner, {})
        tenant_cap = self.tenant_pin_blocks(owner)

        def extra_global() -> int:
            return sum(1 for h in new if self.index.pin_count(h) == 0)

        def extra_tenant() -> int:
            return sum(1 for h in new if h not in tenant)

        too_big = None
        if len(wanted) > self.pin_budget_blocks:
            too_big = f"more than the whole pin budget of {self.pin_budget_bytes} bytes"
        elif len(wanted) > tenant_cap:
            too_big = (f"more than this key's share of the pin budget "
                       f"({tenant_cap * self.block_bytes} bytes, --tenant-pin-share)")
        if too_big is not None:
            if explicit:
                self.pins_refused += 1
                raise Conflict(
                    f"pin refused: branch {branch.branch_id!r} holds {len(wanted)} blocks "
                    f"({len(wanted) * self.block_bytes} bytes), {too_big}")
            self._degrade(branch)
            return
        if tenant_cap < self.pin_budget_blocks:  # the tenant's own oldest leases go first
            self._make_room(self._tenant_leases.get(owner), branch,
                            lambda: len(tenant) + extra_tenant() > tenant_cap)
        self._make_room(self._leases, branch,
                        lambda: self.index.pinned_hashes + extra_global() > self.pin_budget_blocks)
        if (self.index.pinned_hashes + extra_global() > self.pin_budget_blocks
                or len(tenant) + extra_tenant() > tenant_cap):
            # Could not free enough (all other pins share blocks with this one).
            if explicit:
                self.pins_refused += 1
                raise Conflict("pin refused: the pin budget is full")
            self._degrade(branch)
            return
        for h in new:
            self.index.pin(h)
            tenant[h] = tenant.get(h, 0) + 1
        wanted_set = set(wanted)
        for h in branch.pinned_hashes:
            if h not in wanted_set:
                self._unpin_hash(owner, h)
        branch.pinned_hashes = wanted
        now = self.clock()
        branch.pin_ttl_s = ttl_s
        branch.pin_expires_at = now + ttl_s
        branch.pinned_at = now
        branch.degraded = False
        self._set_deadline(branch)
        key = branch.lease_key
        self._leases[key] = branch
        self._leases.move_to_end(key)
        mine = self._tenant_leases.setdefault(owner, OrderedDict())
        mine[key] = branch
        mine.move_to_end(key)

    def _make_room(self, leases: OrderedDict[_LeaseKey, Branch] | None, keep: Branch,
                   over: Callable[[], bool]) -> None:
        """Demote the oldest leases of ``leases`` (other than ``keep``) while ``over()``."""
        while leases and over():
            victim = next((b for b in leases.values() if b is not keep), None)
            if victim is None:
                return
            self._degrade(victim)

    def _degrade(self, branch: Branch) -> None:
        self._unpin_all(branch)
        if not branch.degraded:  # count transitions: a branch that stays degraded counts once
            branch.degraded = True
            self.pins_degraded += 1

    def _unpin_hash(self, owner: str | None, block_hash: bytes) -> bool:
        tenant = self._tenant_pins.get(owner)
        if tenant is not None and block_hash in tenant:
            if tenant[block_hash] <= 1:
                del tenant[block_hash]
            else:
                tenant[block_hash] -= 1
        return self.index.unpin(block_hash)

    def _unpin_all(self, branch: Branch) -> int:
        released = sum(1 for h in branch.pinned_hashes if self._unpin_hash(branch.owner, h))
        branch.pinned_hashes = []
        key = branch.lease_key
        self._leases.pop(key, None)
        mine = self._tenant_leases.get(branch.owner)
        if mine is not None:
            mine.pop(key, None)
            if not mine:
                del self._tenant_leases[branch.owner]
        return released

    def _set_deadline(self, branch: Branch) -> None:
        assert branch.pin_expires_at is not None
        key = branch.lease_key
        self._deadline[key] = branch.pin_expires_at
        self._seq += 1
        heapq.heappush(self._heap, (branch.pin_expires_at, self._seq, key))
        if len(self._heap) > 2 * len(self._deadline) + 64:  # renewals left stale entries
            self._heap = [(at, i, k) for i, (k, at) in enumerate(self._deadline.items())]
            heapq.heapify(self._heap)

    def lease_heap_size(self) -> int:
        return len(self._heap)

    def expire(self) -> int:
        """Release every lease whose TTL ran out, and delete sessions idle for longer than
        ``idle_ttl_s``; returns how many leases expired. Touches only what is due."""
        now = self.clock()
        expired = 0
        while self._heap and self._heap[0][0] <= now:
            at, _, key = heapq.heappop(self._heap)
            if self._deadline.get(key) != at:
                continue  # renewed, unpinned or deleted since
            del self._deadline[key]
            session = self.sessions.get((key[0], key[1]))
            branch = session.branches.get(key[2]) if session is not None else None
            if branch is None:
                continue
            self._unpin_all(branch)
            branch.pin_expires_at = None
            branch.degraded = False
            expired += 1
        if self.idle_ttl_s > 0:
            while self.sessions:
                session = next(iter(self.sessions.values()))
                if session.last_used + self.idle_ttl_s > now:
                    break
                self._remove_session(session)
                self.sessions_expired += 1
        return expired

    # --- requests ----------------------------------------------------------------------------
    def observe_request(self, session_id: str, branch_id: str, token_ids: Sequence[int],
                        block_hashes: Sequence[bytes], cache_salt: str | None,
                        owner: str | None = None, arrived_at: float | None = None
                        ) -> Branch | None:
        """A request of this branch finished: remember its tokens (for prefetch and forks)
        and renew the branch's lease over its new blocks. Unknown sessions are created —
        except one deleted after this request arrived (returns None then)."""
        self._check_owner(owner)
        key = (owner, session_id)
        if key in self.sessions:
            session = self.get_session(session_id, owner)
        else:
            deleted = self.deleted_at.get(key)
            if deleted is not None and arrived_at is not None and arrived_at <= deleted:
                return None
            session = self.create_session(session_id, owner=owner)
        branch = session.branches.get(branch_id)
        if branch is None:
            self._check_branch_quota(session)
            branch = Branch(session_id, branch_id, owner=owner)
            session.branches[branch_id] = branch
        branch.token_ids = list(token_ids)
        branch.block_hashes = list(block_hashes)
        branch.cache_salt = cache_salt
        branch.requests += 1
        ttl = branch.pin_ttl_s or session.pin_ttl_s
        if branch.pin_expires_at is not None or session.auto_pin:
            self._pin_branch(branch, ttl, explicit=False)
        return branch

    # --- reporting ---------------------------------------------------------------------------
    def branch_info(self, branch: Branch) -> dict:
        now = self.clock()
        return {
            "session_id": branch.session_id,
            "branch_id": branch.branch_id,
            "parent": branch.parent,
            "fork_offset_tokens": branch.fork_offset_tokens,
            "num_tokens": len(branch.token_ids),
            "pinned": branch.pinned,
            "pin_expires_in_s": (round(branch.pin_expires_at - now, 3)
                                 if branch.pin_expires_at is not None else None),
            "pinned_blocks": len(branch.pinned_hashes),
            "pinned_bytes": len(branch.pinned_hashes) * self.block_bytes,
            "stored_blocks": sum(1 for h in branch.block_hashes if h in self.index),
            "degraded": branch.degraded,
            "requests": branch.requests,
        }

    def session_info(self, session: Session) -> dict:
        pinned = {h for b in session.branches.values() for h in b.pinned_hashes}
        return {
            "session_id": session.session_id,
            "created_at": session.created_at,
            "auto_pin": session.auto_pin,
            "pin_ttl_s": session.pin_ttl_s,
            "branches": [self.branch_info(b) for b in session.branches.values()],
            "pinned_blocks": len(pinned),
            "pinned_bytes": len(pinned) * self.block_bytes,
        }
