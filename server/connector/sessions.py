"""Sessions and branches as the connector sees them: TTL pins inside a byte budget, forks that
share their parent's prefix blocks by reference, and release on delete.

Pin policy (documented in the README): pins are *leases*. Using a branch renews its lease. The
pin budget is a cap on the distinct blocks all pins hold; when a new or growing pin does not fit,
the oldest other leases are demoted to plain LRU retention ("degraded") until it fits. Only an
explicit pin of a branch that alone exceeds the whole budget is refused (HTTP 409). A chat
request never fails because of a pin: its automatic pin degrades instead.

Pure logic over :class:`HostBlockIndex`; the clock is injectable so tests need no sleeping.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from server.connector.block_index import HostBlockIndex

DEFAULT_BRANCH = "main"


class RegistryError(Exception):
    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(RegistryError):
    status = 404


class Conflict(RegistryError):
    status = 409


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

    @property
    def pinned(self) -> bool:
        return self.pin_expires_at is not None and not self.degraded


@dataclass
class Session:
    session_id: str
    created_at: float
    auto_pin: bool
    pin_ttl_s: float
    owner: str | None = None
    branches: dict[str, Branch] = field(default_factory=dict)


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
        self.clock = clock
        self.wall_clock = wall_clock
        self.sessions: dict[str, Session] = {}
        # When each recently deleted session went away: a request that was already running
        # at that moment must not bring the session (and its pins) back when it finishes.
        self.deleted_at: OrderedDict[str, float] = OrderedDict()
        self.pins_degraded = 0
        self.pins_refused = 0

    # --- sessions ----------------------------------------------------------------------------
    def create_session(self, session_id: str | None = None, *, auto_pin: bool = True,
                       pin_ttl_s: float | None = None, owner: str | None = None) -> Session:
        session_id = session_id or new_id("sess")
        existing = self.sessions.get(session_id)
        if existing is not None:
            if existing.owner != owner:
                raise NotFound(f"session {session_id!r} not found")
            raise Conflict(f"session {session_id!r} already exists")
        if len(self.sessions) >= self.max_sessions:
            raise Conflict(f"too many sessions ({self.max_sessions}); delete some first")
        session = Session(session_id, self.wall_clock(), auto_pin,
                          pin_ttl_s or self.default_ttl_s, owner)
        session.branches[DEFAULT_BRANCH] = Branch(session_id, DEFAULT_BRANCH)
        self.sessions[session_id] = session
        return session

    def get_session(self, session_id: str, owner: str | None = None) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.owner != owner:
            raise NotFound(f"session {session_id!r} not found")
        return session

    def get_branch(self, session_id: str, branch_id: str, owner: str | None = None) -> Branch:
        session = self.get_session(session_id, owner)
        branch = session.branches.get(branch_id)
        if branch is None:
            raise NotFound(f"branch {branch_id!r} not found in session {session_id!r}")
        return branch

    def delete_session(self, session_id: str, owner: str | None = None) -> int:
        session = self.get_session(session_id, owner)
        released = sum(self._unpin_all(b) for b in session.branches.values())
        del self.sessions[session_id]
        self.deleted_at[session_id] = self.clock()
        while len(self.deleted_at) > self.max_sessions:
            self.deleted_at.popitem(last=False)
        return released

    # --- branches ----------------------------------------------------------------------------
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
            raise Conflict(f"branch {branch_id!r} already exists in session {session_id!r}")
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
            cache_salt=parent.cache_salt,
        )
        session.branches[branch_id] = branch
        if session.auto_pin or parent.pinned:
            self._pin_branch(branch, parent.pin_ttl_s or session.pin_ttl_s, explicit=False)
        return branch

    def delete_branch(self, session_id: str, branch_id: str, owner: str | None = None) -> int:
        session = self.get_session(session_id, owner)
        branch = self.get_branch(session_id, branch_id, owner)
        released = self._unpin_all(branch)
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
        branch.pin_expires_at = None
        branch.degraded = False
        return branch

    def _pin_branch(self, branch: Branch, ttl_s: float, *, explicit: bool) -> None:
        wanted = list(dict.fromkeys(branch.block_hashes))
        already = set(branch.pinned_hashes)
        extra_blocks = sum(1 for h in wanted if h not in already and self.index.pin_count(h) == 0)
        if len(wanted) > self.pin_budget_blocks:
            if explicit:
                self.pins_refused += 1
                raise Conflict(
                    f"pin refused: branch {branch.branch_id!r} holds {len(wanted)} blocks "
                    f"({len(wanted) * self.block_bytes} bytes), more than the whole pin budget "
                    f"of {self.pin_budget_bytes} bytes")
            self._degrade(branch)
            return
        self._make_room(extra_blocks, keep=branch)
        if self.index.pinned_hashes + extra_blocks > self.pin_budget_blocks:
            # Could not free enough (all other pins share blocks with this one).
            if explicit:
                self.pins_refused += 1
                raise Conflict("pin refused: the pin budget is full")
            self._degrade(branch)
            return
        for h in wanted:
            if h not in already:
                self.index.pin(h)
        wanted_set = set(wanted)
        for h in branch.pinned_hashes:
            if h not in wanted_set:
                self.index.unpin(h)
        branch.pinned_hashes = wanted
        now = self.clock()
        branch.pin_ttl_s = ttl_s
        branch.pin_expires_at = now + ttl_s
        branch.pinned_at = now
        branch.degraded = False

    def _make_room(self, blocks_needed: int, keep: Branch) -> None:
        """Demote the oldest other leases until ``blocks_needed`` more fit in the budget."""
        if self.index.pinned_hashes + blocks_needed <= self.pin_budget_blocks:
            return
        leases = sorted(
            (b for s in self.sessions.values() for b in s.branches.values()
             if b.pinned and b is not keep),
            key=lambda b: b.pinned_at,
        )
        for victim in leases:
            if self.index.pinned_hashes + blocks_needed <= self.pin_budget_blocks:
                return
            self._degrade(victim)

    def _degrade(self, branch: Branch) -> None:
        self._unpin_all(branch)
        if not branch.degraded:  # count transitions: a branch that stays degraded counts once
            branch.degraded = True
            self.pins_degraded += 1

    def _unpin_all(self, branch: Branch) -> int:
        released = sum(1 for h in branch.pinned_hashes if self.index.unpin(h))
        branch.pinned_hashes = []
        return released

    def expire(self) -> int:
        """Release every lease whose TTL ran out; returns how many expired."""
        now = self.clock()
        expired = 0
        for session in self.sessions.values():
            for branch in session.branches.values():
                if branch.pin_expires_at is not None and branch.pin_expires_at <= now:
                    self._unpin_all(branch)
                    branch.pin_expires_at = None
                    branch.degraded = False
                    expired += 1
        return expired

    # --- requests ----------------------------------------------------------------------------
    def observe_request(self, session_id: str, branch_id: str, token_ids: Sequence[int],
                        block_hashes: Sequence[bytes], cache_salt: str | None,
                        owner: str | None = None, arrived_at: float | None = None
                        ) -> Branch | None:
        """A request of this branch finished: remember its tokens (for prefetch and forks)
        and renew the branch's lease over its new blocks. Unknown sessions are created —
        except one deleted after this request arrived (returns None then)."""
        session = self.sessions.get(session_id)
        if session is None:
            deleted = self.deleted_at.get(session_id)
            if deleted is not None and arrived_at is not None and arrived_at <= deleted:
                return None
            session = self.create_session(session_id, owner=owner)
        elif session.owner != owner:
            raise NotFound(f"session {session_id!r} not found")
        branch = session.branches.get(branch_id)
        if branch is None:
            branch = Branch(session_id, branch_id)
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
