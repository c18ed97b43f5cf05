"""The :class:`Conversation` (see :mod:`sdk.conversation`): every operation is one flow
(:mod:`sdk.conversation._flow`), and each public method is that flow run by the sync or the
async driver."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from sdk import (
    AsyncBranch,
    AsyncChatStream,
    AsyncSession,
    BadRequestError,
    Branch,
    BranchInfo,
    ChatResult,
    ChatStream,
    ConflictError,
    KVBranchError,
    NotFoundError,
    PrefetchResult,
    Session,
)
from sdk.conversation._clients import ClientSet
from sdk.conversation._flow import (
    BranchRef,
    Flow,
    SessionSettings,
    arun_flow,
    available,
    run_flow,
)
from sdk.conversation._owned import OwnedSession
from sdk.conversation._prefetch import Prefetches

__all__ = ["Conversation"]

_CLIENT_OPS = {
    "pin": "pin_branch",
    "unpin": "unpin_branch",
    "prefetch": "prefetch_branch",
    "info": "get_branch",
}
Reply = tuple[ChatResult, dict[str, str]]
Messages = Sequence[Mapping[str, Any]]


class Conversation:
    """The kvbranch side of a framework's conversations: ids, forks, prefetches. Shared by a
    framework model and all its copies (bindings, forks).

    Args:
        clients: the sdk clients to use.
        session: an owned session (see :mod:`sdk.conversation`); ``None``: named sessions.
        logger: where fork fallbacks and failed background prefetches are logged.
    """

    def __init__(
        self,
        clients: ClientSet,
        *,
        session: SessionSettings | None = None,
        logger: logging.Logger | None = None,
    ) -> None:
        self.clients = clients
        self.owned = OwnedSession(session) if session is not None else None
        self._log = logger or logging.getLogger("kvbranch.sdk")
        self._lock = threading.Lock()
        self._forked: set[tuple[str, str]] = set()
        self._prefetches = Prefetches(self._log)

    def _run(self, flow: Flow[Any]) -> Any:
        return run_flow(flow, self.clients.sync)

    async def _arun(self, flow: Flow[Any]) -> Any:
        return await arun_flow(flow, self.clients.current())

    # --- chat -----------------------------------------------------------------------------
    def chat(
        self,
        ref: BranchRef,
        messages: Messages,
        *,
        prefetch_on_tool_call: bool = True,
        **params: Any,
    ) -> Reply:
        """One answer to ``messages`` (sent as they are) on ``ref``'s branch, and the ids the
        request named (``{}`` without kvbranch). ``params``: :meth:`sdk.KVBranchClient.chat`'s.
        An answer with tool calls starts a background prefetch of the branch."""
        flow = self._chat(ref, messages, params, False, prefetch_on_tool_call, self._spawn)
        return cast(Reply, self._run(flow))

    async def achat(
        self,
        ref: BranchRef,
        messages: Messages,
        *,
        prefetch_on_tool_call: bool = True,
        **params: Any,
    ) -> Reply:
        flow = self._chat(ref, messages, params, False, prefetch_on_tool_call, self._aspawn)
        return cast(Reply, await self._arun(flow))

    def chat_stream(
        self,
        ref: BranchRef,
        messages: Messages,
        *,
        prefetch_on_tool_call: bool = True,
        **params: Any,
    ) -> tuple[ChatStream, dict[str, str]]:
        """:meth:`chat`, streamed: the open :class:`~sdk.ChatStream` (the prefetch starts
        when it has been read to its end) and the ids."""
        flow = self._chat(ref, messages, params, True, prefetch_on_tool_call, self._spawn)
        return cast(tuple[ChatStream, dict[str, str]], self._run(flow))

    async def achat_stream(
        self,
        ref: BranchRef,
        messages: Messages,
        *,
        prefetch_on_tool_call: bool = True,
        **params: Any,
    ) -> tuple[AsyncChatStream, dict[str, str]]:
        flow = self._chat(ref, messages, params, True, prefetch_on_tool_call, self._aspawn)
        return cast(tuple[AsyncChatStream, dict[str, str]], await self._arun(flow))

    def _chat(
        self,
        ref: BranchRef,
        messages: Messages,
        params: Mapping[str, Any],
        stream: bool,
        prefetch: bool,
        spawn: Callable[[BranchRef], None],
    ) -> Flow[tuple[Any, dict[str, str]]]:
        ids = yield from self._ids(ref, messages)
        owned = self.owned if self.owned is not None and self.owned.owns(ref) else None

        def done(result: ChatResult) -> None:
            if owned is not None:
                owned.record(ref.branch, messages, result)
            if prefetch and ids and result.tool_calls:
                spawn(ref)

        if stream:
            opened = yield lambda c: c.chat_stream(messages, **ids, **params, on_complete=done)
            return opened, ids
        result = yield lambda c: c.chat(messages, **ids, **params)
        done(result)
        return result, ids

    def _ids(self, ref: BranchRef, messages: Messages) -> Flow[dict[str, str]]:
        """The ids to send: after opening an owned session, and after forking a lazily
        forked branch (once) where its first prompt agrees with its parent."""
        if ref.session_id is None:
            return {}
        if self.owned is not None and self.owned.owns(ref):
            yield self.owned.open
        if not (yield available):
            return {}
        if ref.fork_parent and ref.branch_id and self._claim(ref.session_id, ref.branch_id):
            yield from self._fork_at(ref.session_id, ref.fork_parent, ref.branch_id, list(messages))
        return ref.ids()

    # --- forks ----------------------------------------------------------------------------
    def fork(
        self,
        ref: BranchRef,
        branch_id: str,
        *,
        at_messages: Messages | None = None,
    ) -> BranchRef:
        """Branch ``branch_id`` of ``ref``'s named session, forked from ``ref``'s branch
        where ``at_messages`` end (default: at the parent's end): on the server at once when
        the parent is there, else at the new branch's first call. Server errors only lose
        cache sharing, never the branch."""
        return cast(BranchRef, self._run(self._fork_named(ref, branch_id, at_messages)))

    async def afork(
        self,
        ref: BranchRef,
        branch_id: str,
        *,
        at_messages: Messages | None = None,
    ) -> BranchRef:
        return cast(BranchRef, await self._arun(self._fork_named(ref, branch_id, at_messages)))

    def fork_owned(
        self, ref: BranchRef, at_message: int | None = None, *, branch_id: str | None = None
    ) -> BranchRef:
        """A new branch of the owned session whose last exchange is ``ref``'s
        ``[:at_message]`` (default all of it), forked on the server at the same point.
        ``ValueError`` for an id already in use."""
        return cast(BranchRef, self._run(self._owned().fork(ref, at_message, branch_id)))

    async def afork_owned(
        self, ref: BranchRef, at_message: int | None = None, *, branch_id: str | None = None
    ) -> BranchRef:
        flow = self._owned().fork(ref, at_message, branch_id)
        return cast(BranchRef, await self._arun(flow))

    def _fork_named(
        self, ref: BranchRef, branch_id: str, at_messages: Messages | None
    ) -> Flow[BranchRef]:
        child = BranchRef(ref.session_id, branch_id, fork_parent=ref.branch)
        if ref.session_id is None or not (yield available):
            return child  # forked at its first call, if that names a kvbranch session
        self._claim(ref.session_id, branch_id)
        messages = None if at_messages is None else list(at_messages)
        if not (yield from self._fork_at(ref.session_id, ref.branch, branch_id, messages)):
            with self._lock:  # the parent is not on the server yet: fork at the first call
                self._forked.discard((ref.session_id, branch_id))
        return child

    def _fork_at(
        self, session_id: str, parent: str, branch_id: str, messages: list[Mapping[str, Any]] | None
    ) -> Flow[bool]:
        """Fork on the server where ``messages`` end (``None``: at the parent's end). A 400
        (messages the chat template cannot render) forks without a shared prefix. ``False``
        when the parent is not on the server yet."""
        body: dict[str, Any] = {} if messages is None else {"messages": messages}
        try:
            yield lambda c: c.fork_branch(session_id, parent=parent, branch_id=branch_id, **body)
        except ConflictError:
            pass  # made already
        except NotFoundError:
            return False
        except BadRequestError as exc:
            self._log.info(
                "kvbranch: the server could not fork %s/%s at its messages (%s); "
                "forking without a shared prefix",
                session_id,
                branch_id,
                exc,
            )
            yield from self._fork_at_start(session_id, parent, branch_id)
        except KVBranchError as exc:
            self._log.warning(
                "kvbranch: fork of %s/%s failed (%s); the branch works, without "
                "sharing the parent's cache",
                session_id,
                branch_id,
                exc,
            )
        return True

    def _fork_at_start(self, session_id: str, parent: str, branch_id: str) -> Flow[None]:
        try:
            yield lambda c: c.fork_branch(
                session_id, parent=parent, branch_id=branch_id, token_offset=0
            )
        except KVBranchError as exc:
            self._log.warning("kvbranch: fork of %s/%s failed (%s)", session_id, branch_id, exc)

    def _claim(self, session_id: str, branch_id: str) -> bool:
        """Whether this call is the one to fork ``branch_id`` (once per branch)."""
        with self._lock:
            if (session_id, branch_id) in self._forked:
                return False
            self._forked.add((session_id, branch_id))
            return True

    # --- explicit hooks (None without kvbranch) -------------------------------------------
    def pin(self, ref: BranchRef, ttl_s: float) -> BranchInfo | None:
        """Keep the branch in the server's host store for ``ttl_s`` seconds, renewed by each
        use."""
        return cast("BranchInfo | None", self._run(self._branch_op(ref, "pin", ttl_s)))

    async def apin(self, ref: BranchRef, ttl_s: float) -> BranchInfo | None:
        return cast("BranchInfo | None", await self._arun(self._branch_op(ref, "pin", ttl_s)))

    def unpin(self, ref: BranchRef) -> BranchInfo | None:
        return cast("BranchInfo | None", self._run(self._branch_op(ref, "unpin")))

    async def aunpin(self, ref: BranchRef) -> BranchInfo | None:
        return cast("BranchInfo | None", await self._arun(self._branch_op(ref, "unpin")))

    def prefetch(self, ref: BranchRef) -> PrefetchResult | None:
        """Ask the server to warm its device cache with the branch (returns at once)."""
        return cast("PrefetchResult | None", self._run(self._branch_op(ref, "prefetch")))

    async def aprefetch(self, ref: BranchRef) -> PrefetchResult | None:
        flow = self._branch_op(ref, "prefetch")
        return cast("PrefetchResult | None", await self._arun(flow))

    def info(self, ref: BranchRef) -> BranchInfo | None:
        """The server's view of the branch."""
        return cast("BranchInfo | None", self._run(self._branch_op(ref, "info")))

    async def ainfo(self, ref: BranchRef) -> BranchInfo | None:
        return cast("BranchInfo | None", await self._arun(self._branch_op(ref, "info")))

    def _branch_op(self, ref: BranchRef, name: str, *args: Any) -> Flow[Any]:
        if ref.session_id is None:
            raise ValueError("no kvbranch session for this call")
        if self.owned is not None and self.owned.owns(ref):
            return (yield from self.owned.branch_op(ref, name, *args))
        if not (yield available):
            return None
        sid, bid = ref.session_id, ref.branch
        return (yield lambda c: getattr(c, _CLIENT_OPS[name])(sid, bid, *args))

    def delete_session(self, session_id: str) -> None:
        """Delete the session on the server (releasing its pins); a missing one is fine."""
        self._run(self._delete(session_id))

    async def adelete_session(self, session_id: str) -> None:
        await self._arun(self._delete(session_id))

    def _delete(self, session_id: str) -> Flow[None]:
        if self.owned is not None and self.owned.owns(BranchRef(session_id)):
            yield from self.owned.delete()
        elif (yield available):
            try:
                yield lambda c: c.delete_session(session_id)
            except NotFoundError:
                pass

    # --- the owned session's sdk objects --------------------------------------------------
    def _owned(self) -> OwnedSession:
        if self.owned is None:
            raise ValueError("this conversation has no owned session")
        return self.owned

    def session(self) -> Session:
        """The owned session's sdk :class:`~sdk.Session` (opened on first use)."""
        return cast(Session, self._run(self._owned().opened()))

    async def asession(self) -> AsyncSession:
        """The owned session's :class:`~sdk.AsyncSession` for the running event loop."""
        return cast(AsyncSession, await self._arun(self._owned().opened()))

    def branch(self, branch_id: str) -> Branch:
        """The sdk :class:`~sdk.Branch` of an owned branch (its last exchange as history)."""
        return cast(Branch, self._owned().view(self.session(), branch_id))

    async def abranch(self, branch_id: str) -> AsyncBranch:
        return cast(AsyncBranch, self._owned().view(await self.asession(), branch_id))

    def last_exchange(self, branch_id: str) -> list[dict[str, Any]]:
        """A copy of an owned branch's last exchange (``[]`` before its first call)."""
        return self._owned().last_exchange(branch_id)

    # --- background prefetch --------------------------------------------------------------
    def _spawn(self, ref: BranchRef) -> None:
        self._prefetches.start(ref, lambda: self.prefetch(ref))

    def _aspawn(self, ref: BranchRef) -> None:
        self._prefetches.astart(ref, lambda: self.aprefetch(ref))

    def wait_prefetches(self, timeout: float | None = 30.0) -> None:
        """Wait for the background prefetches of sync calls."""
        self._prefetches.wait(timeout)

    async def await_prefetches(self, timeout: float | None = 30.0) -> None:
        """Wait for the background prefetches of async calls in the running event loop."""
        await self._prefetches.await_tasks(timeout)

    # --- lifecycle ------------------------------------------------------------------------
    def close(self) -> None:
        """Close the sync client (a later call opens a new one)."""
        if self.owned is not None:
            self.owned.forget(sync=True)
        self.clients.close()

    async def aclose(self) -> None:
        """Wait (10 s at most) for this loop's prefetches, then close its async client and
        the sync one."""
        await self.await_prefetches(10.0)
        if self.owned is not None:
            self.owned.forget(sync=False)
        await self.clients.aclose()
        self.close()
