"""What a session does, written once for :mod:`sdk.session`'s sync and async classes: opening (or
attaching to) the server session, recovery when the server lost it or a branch (recreate,
re-fork from the client history, re-pin), and the server-side fork with its fallback; the
branches' part is :mod:`sdk._branch_core`. Everything that talks to the server is a flow of
:mod:`sdk._core` (a generator of requests), so :class:`~sdk.Session` and
:class:`~sdk.AsyncSession` differ only in running them with ``client._run`` or ``await
client._arun``.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar, cast

from typing_extensions import Self

from sdk import contract
from sdk._branch_core import BranchCore
from sdk._common import SessionArgs, check_keywords, check_messages
from sdk._core import ClientCore, Flow, Flows
from sdk.errors import BadRequestError, ConflictError, KVBranchUnavailableError, NotFoundError

__all__ = ["SessionCore"]

logger = logging.getLogger("kvbranch.sdk")
T = TypeVar("T")
C = TypeVar("C", bound=ClientCore)
B = TypeVar("B", bound=BranchCore[Any])


def _local_session_id() -> str:
    return f"sess_{secrets.token_urlsafe(16)}"


def _initial(
    system: str | None, messages: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = []
    if system is not None:
        if not isinstance(system, str):
            raise TypeError("system must be a string")
        history.append({"role": "system", "content": system})
    if messages is not None:
        history.extend(check_messages(messages))
    return history


class SessionCore(Generic[C, B]):
    """A conversation and its branches (see :class:`sdk.Session`)."""

    _branch_type: type[B]

    def __init__(
        self, client: C, session_id: str, *, auto_pin: bool, pin_ttl_s: float | None
    ) -> None:
        self.client = client
        self.session_id = contract.check_id(session_id, "session_id")
        self.auto_pin = auto_pin
        self.pin_ttl_s = pin_ttl_s
        self.branches: dict[str, B] = {}
        self.recoveries = 0
        """How many times the server had lost this session or a branch and the sdk restored
        it from the client history."""

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(session_id={self.session_id!r}, branches={list(self.branches)})"
        )

    @property
    def main(self) -> B:
        """The ``main`` branch."""
        return self.branches[contract.DEFAULT_BRANCH]

    def branch(self, branch_id: str) -> B:
        """The local branch of that id (``KeyError`` if this session has none)."""
        try:
            return self.branches[branch_id]
        except KeyError:
            raise KeyError(
                f"no branch {branch_id!r} in session {self.session_id!r} "
                f"(branches: {list(self.branches)})"
            ) from None

    @property
    def _flows(self) -> Flows:
        return self.client._flows

    def _kvbranch_on(self) -> bool:
        return self.client._kvbranch is True

    def _add(self, branch: BranchCore[Any]) -> None:
        self.branches[branch.branch_id] = cast(B, branch)

    # --- flows ----------------------------------------------------------------------------
    @classmethod
    def _opening(cls, client: C, session_id: str | None, options: SessionArgs) -> Flow[Self]:
        """Create (or attach to) the server session; a client-only one without kvbranch."""
        check_keywords(options, SessionArgs, "session")
        history = _initial(options.get("system"), options.get("messages"))
        auto_pin = options.get("auto_pin", True)
        pin_ttl_s = options.get("pin_ttl_s")
        if session_id is not None:
            contract.check_id(session_id, "session_id")
        flows = client._flows
        if (yield from flows.kvbranch_available()):
            try:
                info = yield from flows.create_session(
                    session_id, auto_pin=auto_pin, pin_ttl_s=pin_ttl_s
                )
                session_id = info.session_id
            except ConflictError:
                session_id = (yield from flows.get_session(cast(str, session_id))).session_id
            except KVBranchUnavailableError:
                client._mark_unavailable()
        session = cls(
            client, session_id or _local_session_id(), auto_pin=auto_pin, pin_ttl_s=pin_ttl_s
        )
        session._add(cls._branch_type(session, contract.DEFAULT_BRANCH, history))
        return session

    def _server(
        self, branch: BranchCore[Any] | None, make: Callable[[], Flow[T]]
    ) -> Flow[T | None]:
        """Run a kvbranch call; restore the session (and ``branch``) once if the server lost
        them; ``None`` on a server without kvbranch."""
        if not (yield from self._flows.kvbranch_available()):
            return None
        try:
            return (yield from make())
        except KVBranchUnavailableError:
            self.client._mark_unavailable()
            return None
        except NotFoundError as exc:
            logger.info(
                "kvbranch: server lost %s (%s); restoring it from the client history",
                self.session_id,
                exc.message,
            )
            yield from self._restore(branch)
            return (yield from make())

    def _restore(self, branch: BranchCore[Any] | None) -> Flow[None]:
        self.recoveries += 1
        try:
            yield from self._flows.create_session(
                self.session_id, auto_pin=self.auto_pin, pin_ttl_s=self.pin_ttl_s
            )
        except ConflictError:
            pass  # the session exists; the branch was missing
        if branch is not None and branch.branch_id != contract.DEFAULT_BRANCH:
            try:
                yield from self._fork(contract.DEFAULT_BRANCH, branch, None)
            except ConflictError:
                pass
        if branch is not None and branch.pin_ttl_s is not None:
            try:
                yield from self._flows.pin_branch(
                    self.session_id, branch.branch_id, branch.pin_ttl_s
                )
            except ConflictError as exc:
                logger.warning(
                    "kvbranch: could not re-pin %s/%s: %s",
                    self.session_id,
                    branch.branch_id,
                    exc.message,
                )

    def _fork(
        self, parent: str, child: BranchCore[Any], parent_len: int | None
    ) -> Flow[contract.BranchInfo]:
        """Fork ``child`` on the server at its history; if the server cannot render that
        history with the chat template, fork without it (:meth:`BranchCore._fork_fallback`)."""
        try:
            return (
                yield from self._flows.fork_branch(
                    self.session_id, parent=parent, branch_id=child.branch_id, **child._fork_body()
                )
            )
        except BadRequestError as exc:
            if not child._messages:
                raise
            return (
                yield from self._flows.fork_branch(
                    self.session_id,
                    parent=parent,
                    branch_id=child.branch_id,
                    **child._fork_fallback(parent_len, exc),
                )
            )

    def _info(self) -> Flow[contract.SessionInfo | None]:
        return (yield from self._server(None, lambda: self._flows.get_session(self.session_id)))

    def _delete(self) -> Flow[None]:
        if (yield from self._flows.kvbranch_available()):
            try:
                yield from self._flows.delete_session(self.session_id)
            except NotFoundError:
                pass
        self.branches.clear()
