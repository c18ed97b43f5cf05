"""An *owned* session: one the conversation creates itself, with its pin settings, and whose
branches are sdk :class:`~sdk.Branch`\\ es, so forks at a message, pins and prefetches get the
sdk's recovery (a server that lost the session or a branch gets it back from the client side).

What the sdk needs for that is each branch's *last exchange*: the messages of its last call
plus the answer, which is what the server's branch caches. It is where a fork at a message cuts
and what a lost branch is restored from; it is never sent as history (the framework's messages
are). Sync calls use one :class:`~sdk.Session`, async calls one :class:`~sdk.AsyncSession` per
event loop; both see the same last exchanges through :meth:`OwnedSession.view`.
"""

from __future__ import annotations

import asyncio
import threading
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sdk import (
    AsyncBranch,
    AsyncKVBranchClient,
    AsyncSession,
    Branch,
    ChatResult,
    KVBranchClient,
    Session,
)
from sdk.conversation._flow import BranchRef, Flow, SessionSettings, answer_message

__all__ = ["OwnedSession"]


@dataclass
class _Line:
    """An owned branch: its last exchange and where it forked."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    parent_id: str | None = None
    fork_index: int | None = None


class OwnedSession:
    def __init__(self, settings: SessionSettings) -> None:
        self.settings = settings
        self._lock = threading.RLock()
        self._lines: dict[str, _Line] = {}
        self._session: tuple[KVBranchClient, Session] | None = None
        self._asession: tuple[AsyncKVBranchClient, asyncio.Future[AsyncSession]] | None = None

    def owns(self, ref: BranchRef) -> bool:
        return ref.session_id == self.settings.session_id

    # --- the sdk session, per client ------------------------------------------------------
    def open(self, client: Any) -> Any:
        """Op: the session on ``client`` (opened once per client; concurrent async callers
        await the same opening). The sdk's warning about a server without kvbranch is only
        logged: a framework's LLM works the same there."""
        with self._lock:
            if isinstance(client, KVBranchClient):
                if self._session is None or self._session[0] is not client:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore", RuntimeWarning)
                        self._session = (client, self._open(client))
                return self._session[1]
            if self._asession is None or self._asession[0] is not client:
                task = asyncio.ensure_future(self._aopen(client))
                task.add_done_callback(self._forget_failed)
                self._asession = (client, task)
            return self._asession[1]

    def _open(self, client: KVBranchClient) -> Session:
        s = self.settings
        return client.session(s.session_id, auto_pin=s.auto_pin, pin_ttl_s=s.pin_ttl_s)

    async def _aopen(self, client: AsyncKVBranchClient) -> AsyncSession:
        s = self.settings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return await client.session(s.session_id, auto_pin=s.auto_pin, pin_ttl_s=s.pin_ttl_s)

    def _forget_failed(self, task: asyncio.Future[AsyncSession]) -> None:
        if task.cancelled() or task.exception() is not None:
            with self._lock:
                if self._asession is not None and self._asession[1] is task:
                    self._asession = None

    def forget(self, *, sync: bool) -> None:
        """Drop the sync (or async) session: its client was closed."""
        with self._lock:
            if sync:
                self._session = None
            else:
                self._asession = None

    def opened(self) -> Flow[Any]:
        """The session of the driver's client."""
        return (yield self.open)

    # --- branches -------------------------------------------------------------------------
    def view(self, session: Session | AsyncSession, branch_id: str) -> Any:
        """The sdk branch of ``session`` for ``branch_id``, holding its last exchange."""
        with self._lock:
            line = self._lines.get(branch_id) or _Line()
            branches: dict[str, Any] = session.branches
            branch = branches.get(branch_id)
            if branch is None:
                kind: Any = Branch if isinstance(session, Session) else AsyncBranch
                branch = kind(
                    session, branch_id, [], parent_id=line.parent_id, fork_index=line.fork_index
                )
                branches[branch_id] = branch
            branch.set_messages(line.messages)
            return branch

    def record(
        self, branch_id: str, messages: Sequence[Mapping[str, Any]], result: ChatResult
    ) -> None:
        """A call on ``branch_id`` answered: its last exchange is now ``messages`` + answer."""
        with self._lock:
            line = self._lines.setdefault(branch_id, _Line())
            line.messages = [dict(m) for m in messages] + [answer_message(result)]

    def last_exchange(self, branch_id: str) -> list[dict[str, Any]]:
        with self._lock:
            line = self._lines.get(branch_id)
            return [dict(m) for m in line.messages] if line is not None else []

    def fork(
        self, ref: BranchRef, at_message: int | None, branch_id: str | None
    ) -> Flow[BranchRef]:
        """Fork ``ref``'s branch at ``at_message`` of its last exchange (:meth:`sdk.Branch.fork`:
        the server forks where those messages end, with the sdk's fallback and recovery)."""
        with self._lock:
            if branch_id is not None and branch_id in self._lines:
                raise ValueError(
                    f"branch {branch_id!r} already exists in session {ref.session_id!r}"
                )
        parent = self.view((yield self.open), ref.branch)
        child = yield lambda _: parent.fork(at_message, branch_id=branch_id)
        with self._lock:
            self._lines[child.branch_id] = _Line(child.messages, child.parent_id, child.fork_index)
        return BranchRef(ref.session_id, child.branch_id)

    def branch_op(self, ref: BranchRef, name: str, *args: Any) -> Flow[Any]:
        """``pin``/``unpin``/``prefetch``/``info`` of the sdk branch."""
        view = self.view((yield self.open), ref.branch)
        return (yield lambda _: getattr(view, name)(*args))

    def delete(self) -> Flow[None]:
        """Delete the session on the server and forget every branch."""
        session = yield self.open
        yield lambda _: session.delete()
        with self._lock:
            self._lines.clear()
