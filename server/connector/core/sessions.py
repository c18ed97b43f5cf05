"""Sessions and branches as the connector sees them: TTL pins inside a byte budget, forks that
share their parent's prefix blocks by reference, release on delete, per-tenant id spaces and
quotas, and expiry of idle sessions.

Tenants: a session is keyed by ``(owner, session_id)`` — the owner is the tenant id of the API
key that used it (``None`` on a server without keys). Each tenant has its own id space, so
reading, forking, deleting or creating an id behaves the same whether or not another tenant
uses that id (no existence probe, no squatting). Quotas per tenant: sessions (429), branches
per session (409), and a share of the pin budget (pins beyond it degrade the tenant's own
oldest leases; an explicit pin larger than the share is refused with 409).

Pins (TTL leases in a byte budget, per-tenant shares, the lease heap) live in ``leases.py``;
the nouns (sessions, branches, errors) in ``branches.py``, re-exported here. Idle sessions
expire from the front of an ordered dict by last use, so expiry never walks all sessions.

Pure logic over :class:`HostBlockIndex`; the clock is injectable so tests need no sleeping.
(About 400 lines: one class, the registry's operations on sessions and branches; the pins
and the nouns are split out to ``leases.py`` and ``branches.py`` already.)
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from itertools import islice

from sdk.contract import ALREADY_EXISTS  # the router converges retries on this wording
from server.connector.core.block_index import HostBlockIndex
from server.connector.core.branches import (  # noqa: F401 - re-exported: the registry's API
    DEFAULT_BRANCH,
    DEFAULT_IDLE_TTL_S,
    DEFAULT_MAX_BRANCHES_PER_SESSION,
    DEFAULT_MAX_SESSIONS_PER_TENANT,
    Branch,
    Conflict,
    KeyRequired,
    NotFound,
    QuotaExceeded,
    RegistryError,
    Session,
    SessionKey,
    SharedSeq,
    new_id,
)
from server.connector.core.leases import PinLeases


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
        #: Whether this engine keeps ``(owner, session_id)``, with several data-parallel engines
        #: (``server.common.engine_choice``): a finished request of a session another engine owns
        #: leaves no state here, so a session is never recorded on two engines. None: every
        #: session is this engine's.
        self.keeps_session: Callable[[str | None, str], bool] | None = None
        self.leases = PinLeases(
            index,
            block_bytes=block_bytes,
            pin_budget_bytes=pin_budget_bytes,
            tenant_pin_share=tenant_pin_share,
            clock=clock,
        )
        self.default_ttl_s = default_ttl_s
        self.max_sessions = max_sessions
        self.max_sessions_per_tenant = max_sessions_per_tenant
        self.max_branches_per_session = max_branches_per_session
        self.idle_ttl_s = idle_ttl_s
        #: With API keys every request has an owner; one without (a route kvbranch does not
        #: know) must not make a session that no key can reach.
        self.require_owner = require_owner
        self.clock = clock
        self.wall_clock = wall_clock
        #: Every session, least recently used first (idle expiry pops from the front).
        self.sessions: OrderedDict[SessionKey, Session] = OrderedDict()
        #: Per tenant, least recently used first (stats lists the most recent ones).
        self._by_owner: dict[str | None, OrderedDict[str, Session]] = {}
        # When each recently deleted session went away: a request that was already running
        # at that moment must not bring the session (and its pins) back when it finishes.
        self.deleted_at: OrderedDict[SessionKey, float] = OrderedDict()
        self.sessions_expired = 0

    # --- pin budget: read it (budget, pins degraded and refused) from self.leases ------------
    def lease_heap_size(self) -> int:
        return self.leases.heap_size()

    # --- tenants -----------------------------------------------------------------------------
    def tenant_pin_blocks(self, owner: str | None) -> int:
        """Blocks one tenant's pins may hold (the whole budget on a server without keys)."""
        return self.leases.tenant_pin_blocks(owner)

    def sessions_of(self, owner: str | None, limit: int | None = None) -> list[Session]:
        """The tenant's sessions, least recently used first; with ``limit``, only the most
        recently used ``limit`` of them (without walking the others)."""
        mine = self._by_owner.get(owner)
        if not mine:
            return []
        if limit is None or limit >= len(mine):
            return list(mine.values())
        recent = list(islice(reversed(mine.values()), limit))
        recent.reverse()
        return recent

    def num_sessions_of(self, owner: str | None) -> int:
        return len(self._by_owner.get(owner, ()))

    def _check_owner(self, owner: str | None) -> None:
        if owner is None and self.require_owner:
            raise KeyRequired("this server has API keys: sessions need one")

    # --- sessions ----------------------------------------------------------------------------
    def create_session(
        self,
        session_id: str | None = None,
        *,
        auto_pin: bool = True,
        pin_ttl_s: float | None = None,
        owner: str | None = None,
    ) -> Session:
        self._check_owner(owner)
        session_id = session_id or new_id("sess")
        if (owner, session_id) in self.sessions:
            raise Conflict(f"session {session_id!r} {ALREADY_EXISTS}")
        mine = self._by_owner.get(owner, OrderedDict())
        if len(mine) >= self.max_sessions_per_tenant:
            raise QuotaExceeded(
                f"session quota reached: this key has {len(mine)} sessions (the limit, "
                f"--max-sessions-per-tenant); delete some, or wait until idle ones expire "
                f"({self.idle_ttl_s:g} s without use)"
            )
        if len(self.sessions) >= self.max_sessions:
            raise Conflict(
                f"too many sessions on this server ({self.max_sessions}); delete some first"
            )
        now = self.clock()
        session = Session(
            session_id,
            self.wall_clock(),
            auto_pin,
            pin_ttl_s or self.default_ttl_s,
            owner,
            last_used=now,
        )
        session.branches[DEFAULT_BRANCH] = Branch(session_id, DEFAULT_BRANCH, owner=owner)
        self.sessions[(owner, session_id)] = session
        self._by_owner.setdefault(owner, OrderedDict())[session_id] = session
        return session

    def get_session(self, session_id: str, owner: str | None = None) -> Session:
        """The caller's session (a use: it renews the idle clock)."""
        key = (owner, session_id)
        session = self.sessions.get(key)
        if session is None:
            raise NotFound(f"session {session_id!r} not found")
        session.last_used = self.clock()
        self.sessions.move_to_end(key)
        self._by_owner[owner].move_to_end(session_id)
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
            released += self.leases.release(branch)
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
                f"delete some first"
            )

    def fork(
        self,
        session_id: str,
        parent_id: str,
        new_branch_id: str | None = None,
        *,
        token_offset: int | None = None,
        token_prefix: Sequence[int] | None = None,
        owner: str | None = None,
    ) -> Branch:
        """New branch sharing ``parent``'s first ``token_offset`` tokens (or the longest
        common prefix with ``token_prefix``). Copies nothing: the new branch refers to the
        same block hashes, and pinning it only adds references."""
        session = self.get_session(session_id, owner)
        parent = self.get_branch(session_id, parent_id, owner)
        branch_id = new_branch_id or new_id("br")
        if branch_id in session.branches:
            raise Conflict(f"branch {branch_id!r} {ALREADY_EXISTS} in session {session_id!r}")
        self._check_branch_quota(session)
        parent_tokens = SharedSeq.of(parent.token_ids)
        if token_prefix is not None:
            offset = parent_tokens.common_prefix(token_prefix)
        elif token_offset is not None:
            if token_offset > len(parent.token_ids):
                raise RegistryError(
                    f"token_offset {token_offset} is past the end of branch {parent_id!r} "
                    f"({len(parent.token_ids)} tokens)"
                )
            offset = token_offset
        else:
            offset = len(parent.token_ids)
        full_blocks = offset // self.block_size
        # The parent's tail covers the fork's partial block when the fork point lies past its
        # start (a load uses only the prefix the next prompt repeats, so a shorter fork works).
        keeps_tail = parent.tail_key is not None and offset > parent.tail_start
        branch = Branch(
            session_id,
            branch_id,
            parent=parent_id,
            fork_offset_tokens=offset,
            # Shared with the parent, not copied (O(1) per fork until it diverges).
            token_ids=parent_tokens.prefix(offset),
            block_hashes=SharedSeq.of(parent.block_hashes).prefix(full_blocks),
            cache_salt=parent.cache_salt,
            owner=owner,
            tail_key=parent.tail_key if keeps_tail else None,
            tail_start=parent.tail_start if keeps_tail else 0,
        )
        session.branches[branch_id] = branch
        if session.auto_pin or parent.pinned:
            self.leases.pin(branch, parent.pin_ttl_s or session.pin_ttl_s, explicit=False)
        return branch

    def delete_branch(self, session_id: str, branch_id: str, owner: str | None = None) -> int:
        session = self.get_session(session_id, owner)
        branch = self.get_branch(session_id, branch_id, owner)
        released = self.leases.release(branch)
        del session.branches[branch_id]
        return released

    # --- pins --------------------------------------------------------------------------------
    def pin(
        self, session_id: str, branch_id: str, ttl_s: float, owner: str | None = None
    ) -> Branch:
        branch = self.get_branch(session_id, branch_id, owner)
        self.leases.pin(branch, ttl_s, explicit=True)
        return branch

    def unpin(self, session_id: str, branch_id: str, owner: str | None = None) -> Branch:
        branch = self.get_branch(session_id, branch_id, owner)
        self.leases.release(branch)
        branch.pin_expires_at = None
        branch.degraded = False
        return branch

    def expire(self) -> int:
        """Release every lease whose TTL ran out, and delete sessions idle for longer than
        ``idle_ttl_s``; returns how many leases expired. Touches only what is due."""
        now = self.clock()
        expired = self.leases.expire(now)
        if self.idle_ttl_s > 0:
            while self.sessions:
                session = next(iter(self.sessions.values()))
                if session.last_used + self.idle_ttl_s > now:
                    break
                self._remove_session(session)
                self.sessions_expired += 1
        return expired

    # --- requests ----------------------------------------------------------------------------
    def observe_request(
        self,
        session_id: str,
        branch_id: str,
        token_ids: Sequence[int],
        block_hashes: Sequence[bytes],
        cache_salt: str | None,
        owner: str | None = None,
        arrived_at: float | None = None,
        tail: tuple[bytes, int] | None = None,
        pin_ttl_s: float | None = None,
    ) -> Branch | None:
        """A request of this branch finished: remember its tokens (for prefetch and forks)
        and renew the branch's lease over its new blocks. Unknown sessions are created —
        except one deleted after this request arrived (returns None then)."""
        self._check_owner(owner)
        if self.keeps_session is not None and not self.keeps_session(owner, session_id):
            return None  # another engine's session (a route vLLM gives no engine choice)
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
        # Only what this request added past the branch's tokens is new memory (forks share
        # their parent's, turns the previous turn's).
        branch.token_ids = SharedSeq.of(branch.token_ids).rebased(token_ids)
        branch.block_hashes = SharedSeq.of(branch.block_hashes).rebased(block_hashes)
        branch.tail_key, branch.tail_start = tail if tail is not None else (None, 0)
        branch.cache_salt = cache_salt
        branch.requests += 1
        # A client's retention hint (server/dialects/) sets the lease; like any
        # automatic pin it degrades when the budget is full, it never fails the request.
        ttl = pin_ttl_s or branch.pin_ttl_s or session.pin_ttl_s
        if pin_ttl_s or branch.pin_expires_at is not None or session.auto_pin:
            self.leases.pin(branch, ttl, explicit=False)
        return branch

    # --- reporting ---------------------------------------------------------------------------
    def branch_info(self, branch: Branch, budget: list[int] | None = None) -> dict:
        """A branch's description. ``stored_blocks`` walks its blocks: with ``budget`` (a
        one-item list of hash lookups left, shared by a listing) and too few left, it is not
        counted (the key is left out)."""
        now = self.clock()
        info = {
            "session_id": branch.session_id,
            "branch_id": branch.branch_id,
            "parent": branch.parent,
            "fork_offset_tokens": branch.fork_offset_tokens,
            "num_tokens": len(branch.token_ids),
            "pinned": branch.pinned,
            "pin_expires_in_s": (
                round(branch.pin_expires_at - now, 3) if branch.pin_expires_at is not None else None
            ),
            "pinned_blocks": len(branch.pinned_hashes),
            "pinned_bytes": len(branch.pinned_hashes) * self.block_bytes,
            "degraded": branch.degraded,
            "requests": branch.requests,
        }
        wanted = branch.wanted_pins()
        if budget is None or budget[0] >= len(wanted):
            info["stored_blocks"] = sum(1 for h in wanted if h in self.index)
            if budget is not None:
                budget[0] -= len(wanted)
        return info

    def session_info(self, session: Session, budget: list[int] | None = None) -> dict:
        """A session's description; with ``budget`` (see :meth:`branch_info`) the block walks
        stop when it is spent (``pinned_blocks``/``stored_blocks`` are then left out)."""
        branches = list(session.branches.values())
        info: dict = {
            "session_id": session.session_id,
            "created_at": session.created_at,
            "auto_pin": session.auto_pin,
            "pin_ttl_s": session.pin_ttl_s,
        }
        size = sum(len(b.pinned_hashes) for b in branches)
        if budget is None or budget[0] >= size:
            pinned = len({h for b in branches for h in b.pinned_hashes})
            info["pinned_blocks"] = pinned
            info["pinned_bytes"] = pinned * self.block_bytes
            if budget is not None:
                budget[0] -= size
        info["branches"] = [self.branch_info(b, budget) for b in branches]
        return info
