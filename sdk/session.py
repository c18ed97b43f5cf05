"""Sessions and branches as a user holds them.

A :class:`Session` owns :class:`Branch`\\ es; each branch keeps its whole message history on
the client. Every chat turn re-sends that history (OpenAI-style) and names the session and
branch, so the server reuses the branch's KV cache when it still has it and recomputes it when
it does not (restart, TTL expiry, another instance): the answers are the same, only slower.
The client history is the truth: when a kvbranch route answers 404 because the server lost the
session or branch, the sdk recreates them (session, then the branch as a fork at its history)
and repeats the call.

On a server without kvbranch (a plain OpenAI-compatible server) the same objects work
client-side only: one warning, no ``session_id``/``vllm_xargs`` sent, and ``pin``,
``unpin``, ``prefetch`` and ``info`` return ``None``.

:class:`AsyncSession`/:class:`AsyncBranch` are the same over :class:`AsyncKVBranchClient`.
"""

from __future__ import annotations

import copy
import logging
import secrets
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from typing_extensions import Unpack

from server.contract import (
    DEFAULT_BRANCH,
    BranchInfo,
    PinRequest,
    PrefetchResult,
    SessionInfo,
    check_id,
)

from sdk._common import ChatParams, check_messages
from sdk.errors import BadRequestError, ConflictError, KVBranchUnavailableError, NotFoundError
from sdk.types import ChatResult

if TYPE_CHECKING:
    from sdk.aclient import AsyncChatStream, AsyncKVBranchClient
    from sdk.client import ChatStream, KVBranchClient

__all__ = ["Session", "Branch", "AsyncSession", "AsyncBranch"]

logger = logging.getLogger("kvbranch.sdk")
T = TypeVar("T")
MessageInput = str | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None
S = TypeVar("S", bound="_SessionBase")


def new_branch_id() -> str:
    return f"br_{secrets.token_hex(8)}"


def _local_session_id() -> str:
    return f"sess_{secrets.token_urlsafe(16)}"


# --- shared, I/O-free parts -----------------------------------------------------------------
class _BranchBase(Generic[S]):
    def __init__(self, session: S, branch_id: str, messages: list[dict[str, Any]], *,
                 parent_id: str | None = None, fork_index: int | None = None) -> None:
        self.session = session
        self.branch_id = check_id(branch_id, "branch_id")
        self.parent_id = parent_id
        self.fork_index = fork_index
        """Index in the parent's history where this branch forked (its first own message)."""
        self._messages = messages
        self.pin_ttl_s: float | None = None
        """TTL of the last explicit :meth:`pin` (re-applied when the branch is restored)."""

    @property
    def session_id(self) -> str:
        return self.session.session_id

    @property
    def messages(self) -> list[dict[str, Any]]:
        """A copy of the branch's message history."""
        return copy.deepcopy(self._messages)

    def __len__(self) -> int:
        return len(self._messages)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(session_id={self.session_id!r}, "
                f"branch_id={self.branch_id!r}, messages={len(self._messages)})")

    def add(self, *messages: Mapping[str, Any]) -> None:
        """Append messages without generating (e.g. tool results, or a scripted turn)."""
        self._messages.extend(check_messages(list(messages)))

    def set_messages(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Replace the client history, for callers that own the conversation and send it
        whole on every call (agent frameworks): the next :meth:`chat` with no content sends
        exactly ``messages``, and forks and server-side restores start from them."""
        self._messages = check_messages(messages)

    def add_tool_result(self, tool_call_id: str, content: str, *, name: str | None = None
                        ) -> None:
        """Append the ``tool`` message answering the tool call ``tool_call_id``."""
        if not isinstance(content, str):
            raise TypeError(f"tool result content must be a string, got "
                            f"{type(content).__name__} (serialize it, e.g. json.dumps)")
        message: dict[str, Any] = {"role": "tool", "tool_call_id": tool_call_id,
                                   "content": content}
        if name:
            message["name"] = name
        self._messages.append(message)

    def _next_history(self, content: MessageInput, role: str) -> list[dict[str, Any]]:
        history = copy.deepcopy(self._messages)
        if content is None:
            pass
        elif isinstance(content, str):
            history.append({"role": role, "content": content})
        elif isinstance(content, Mapping):
            history.extend(check_messages([content]))
        else:
            history.extend(check_messages(content))
        if not history:
            raise ValueError("nothing to send: the branch has no messages and no content was "
                             "given")
        return history

    def _ids(self) -> dict[str, str]:
        if self.session._kvbranch_on():
            return {"session_id": self.session_id, "branch_id": self.branch_id}
        return {}

    def _commit(self, history: list[dict[str, Any]]) -> Callable[[ChatResult], None]:
        def commit(result: ChatResult) -> None:
            self._messages = history + [result.message]
        return commit

    def _fork_index(self, at_message: int | None) -> int:
        n = len(self._messages)
        if at_message is None:
            return n
        if isinstance(at_message, bool) or not isinstance(at_message, int):
            raise TypeError(f"at_message must be an int, got {type(at_message).__name__}")
        index = at_message + n if at_message < 0 else at_message
        if not 0 <= index <= n:
            raise IndexError(f"at_message={at_message} is outside this branch's history "
                             f"(0..{n}, or -{n}..-1)")
        return index

    def _new_child(self, index: int, branch_id: str | None):
        branch_id = check_id(branch_id, "branch_id") if branch_id else new_branch_id()
        if branch_id in self.session.branches:
            raise ValueError(f"branch {branch_id!r} already exists in this session")
        return type(self)(self.session, branch_id, copy.deepcopy(self._messages[:index]),
                          parent_id=self.branch_id, fork_index=index)

    def _fork_body(self) -> dict[str, Any]:
        """ForkRequest fields that recreate this branch on the server from its history."""
        if self._messages:
            return {"messages": self.messages}
        return {"token_offset": 0}

    def _fork_fallback(self, parent_len: int | None, exc: BadRequestError) -> dict[str, Any]:
        """Fork fields to use when the server could not render the history with the chat
        template: the parent's whole sequence when forking at its end, else no shared
        prefix. Either way the answers are unchanged (the full history is sent each turn);
        only cache sharing between the branches is lost."""
        logger.warning("kvbranch: the server could not fork %s/%s at its messages (%s); "
                       "forking without a shared prefix", self.session_id, self.branch_id,
                       exc.message)
        if parent_len is not None and self.fork_index == parent_len:
            return {}
        return {"token_offset": 0}


class _SessionBase:
    def __init__(self, client: Any, session_id: str, *, auto_pin: bool,
                 pin_ttl_s: float | None) -> None:
        self.client = client
        self.session_id = check_id(session_id, "session_id")
        self.auto_pin = auto_pin
        self.pin_ttl_s = pin_ttl_s
        self.branches: dict[str, Any] = {}
        self.recoveries = 0
        """How many times the server had lost this session or a branch and the sdk restored
        it from the client history."""

    def _kvbranch_on(self) -> bool:
        return self.client._kvbranch is True

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(session_id={self.session_id!r}, "
                f"branches={list(self.branches)})")

    def branch(self, branch_id: str):
        """The local branch of that id (``KeyError`` if this session has none)."""
        try:
            return self.branches[branch_id]
        except KeyError:
            raise KeyError(f"no branch {branch_id!r} in session {self.session_id!r} "
                           f"(branches: {list(self.branches)})") from None

    @property
    def main(self):
        return self.branches[DEFAULT_BRANCH]


def _initial(system: str | None, messages: Sequence[Mapping[str, Any]] | None
             ) -> list[dict[str, Any]]:
    history: list[dict[str, Any]] = []
    if system is not None:
        if not isinstance(system, str):
            raise TypeError("system must be a string")
        history.append({"role": "system", "content": system})
    if messages is not None:
        history.extend(check_messages(messages))
    return history


# --- sync -----------------------------------------------------------------------------------
class Session(_SessionBase):
    """A conversation and its branches (see the module docs). Get one with
    :meth:`KVBranchClient.session`."""

    client: KVBranchClient
    branches: dict[str, Branch]

    @classmethod
    def _open(cls, client: KVBranchClient, session_id: str | None, *, system: str | None,
              messages: Sequence[Mapping[str, Any]] | None, auto_pin: bool,
              pin_ttl_s: float | None) -> Session:
        history = _initial(system, messages)
        if session_id is not None:
            check_id(session_id, "session_id")
        if client.kvbranch_available():
            try:
                info = client.create_session(session_id, auto_pin=auto_pin,
                                             pin_ttl_s=pin_ttl_s)
            except ConflictError:
                info = client.get_session(session_id)  # type: ignore[arg-type]
            except KVBranchUnavailableError:
                client._mark_unavailable()
                info = None
            if info is not None:
                session_id = info.session_id
        session = cls(client, session_id or _local_session_id(), auto_pin=auto_pin,
                      pin_ttl_s=pin_ttl_s)
        session.branches[DEFAULT_BRANCH] = Branch(session, DEFAULT_BRANCH, history)
        return session

    @property
    def main(self) -> Branch:
        """The ``main`` branch."""
        return self.branches[DEFAULT_BRANCH]

    def _server(self, branch: Branch | None, fn: Callable[[], T]) -> T | None:
        """Run a kvbranch call; restore the session (and ``branch``) once if the server lost
        them; ``None`` on a server without kvbranch."""
        if not self.client.kvbranch_available():
            return None
        try:
            return fn()
        except KVBranchUnavailableError:
            self.client._mark_unavailable()
            return None
        except NotFoundError as exc:
            logger.info("kvbranch: server lost %s (%s); restoring it from the client history",
                        self.session_id, exc.message)
            self._restore(branch)
            return fn()

    def _restore(self, branch: Branch | None) -> None:
        self.recoveries += 1
        try:
            self.client.create_session(self.session_id, auto_pin=self.auto_pin,
                                       pin_ttl_s=self.pin_ttl_s)
        except ConflictError:
            pass  # the session exists; the branch was missing
        if branch is not None and branch.branch_id != DEFAULT_BRANCH:
            try:
                self._fork(DEFAULT_BRANCH, branch, None)
            except ConflictError:
                pass
        if branch is not None and branch.pin_ttl_s is not None:
            try:
                self.client.pin_branch(self.session_id, branch.branch_id, branch.pin_ttl_s)
            except ConflictError as exc:
                logger.warning("kvbranch: could not re-pin %s/%s: %s", self.session_id,
                               branch.branch_id, exc.message)

    def _fork(self, parent: str, child: Branch, parent_len: int | None) -> BranchInfo:
        try:
            return self.client.fork_branch(self.session_id, parent=parent,
                                           branch_id=child.branch_id, **child._fork_body())
        except BadRequestError as exc:
            if not child._messages:
                raise
            return self.client.fork_branch(self.session_id, parent=parent,
                                           branch_id=child.branch_id,
                                           **child._fork_fallback(parent_len, exc))

    def info(self) -> SessionInfo | None:
        """The server's view of the session (``None`` without kvbranch)."""
        return self._server(None, lambda: self.client.get_session(self.session_id))

    def delete(self) -> None:
        """Delete the session on the server (releasing its pins) and forget its branches."""
        if self.client.kvbranch_available():
            try:
                self.client.delete_session(self.session_id)
            except NotFoundError:
                pass
        self.branches.clear()


class Branch(_BranchBase[Session]):
    """One line of a conversation: its message history, and the server-side branch of the
    same id that caches it."""

    def chat(self, content: MessageInput = None, *, role: str = "user",
             **params: Unpack[ChatParams]) -> ChatResult:
        """Add ``content`` (a string as a ``role`` message, a message dict, or a list of
        them; ``None`` to just continue), generate the answer over the whole history and
        append it. The history changes only when the call succeeds."""
        history = self._next_history(content, role)
        result = self.session.client.chat(history, **self._ids(), **params)
        self._commit(history)(result)
        return result

    def chat_stream(self, content: MessageInput = None, *, role: str = "user",
                    **params: Unpack[ChatParams]) -> ChatStream:
        """Like :meth:`chat`, streamed. The answer is appended to the history when the
        stream has been read to its end."""
        history = self._next_history(content, role)
        return self.session.client.chat_stream(history, **self._ids(), **params,
                                               on_complete=self._commit(history))

    def fork(self, at_message: int | None = None, *, branch_id: str | None = None) -> Branch:
        """A new branch whose history is ``messages[:at_message]`` (default: all of it; a
        negative index counts from the end). The server forks its cache at the same point,
        sharing the common blocks."""
        index = self._fork_index(at_message)
        child = self._new_child(index, branch_id)
        self.session._server(self, lambda: self.session._fork(self.branch_id, child,
                                                              len(self._messages)))
        self.session.branches[child.branch_id] = child
        return child

    def pin(self, ttl_s: float) -> BranchInfo | None:
        """Keep this branch's cache for ``ttl_s`` seconds (each use renews the lease).
        :class:`~sdk.errors.ConflictError` when it exceeds the server's pin budget."""
        PinRequest(ttl_s=ttl_s)  # validate here, also when the server has no kvbranch
        info = self.session._server(self, lambda: self.session.client.pin_branch(
            self.session_id, self.branch_id, ttl_s))
        self.pin_ttl_s = ttl_s
        return info

    def unpin(self) -> BranchInfo | None:
        self.pin_ttl_s = None
        return self.session._server(self, lambda: self.session.client.unpin_branch(
            self.session_id, self.branch_id))

    def prefetch(self) -> PrefetchResult | None:
        """Warm the server's device cache with this branch's last sequence, in the
        background — e.g. when the model emitted a tool call, so the turn with the tool
        result starts warm. Returns at once."""
        return self.session._server(self, lambda: self.session.client.prefetch_branch(
            self.session_id, self.branch_id))

    def info(self) -> BranchInfo | None:
        """The server's view of this branch (``None`` without kvbranch)."""
        return self.session._server(self, lambda: self.session.client.get_branch(
            self.session_id, self.branch_id))

    def delete(self) -> None:
        """Delete the branch (server and client). ``main`` cannot be deleted."""
        if self.branch_id == DEFAULT_BRANCH:
            raise ValueError("the main branch cannot be deleted; delete the session")
        if self.session.client.kvbranch_available():
            try:
                self.session.client.delete_branch(self.session_id, self.branch_id)
            except NotFoundError:
                pass
        self.session.branches.pop(self.branch_id, None)


# --- async ----------------------------------------------------------------------------------
class AsyncSession(_SessionBase):
    """:class:`Session` over :class:`AsyncKVBranchClient`."""

    client: AsyncKVBranchClient
    branches: dict[str, AsyncBranch]

    @classmethod
    async def _open(cls, client: AsyncKVBranchClient, session_id: str | None, *,
                    system: str | None, messages: Sequence[Mapping[str, Any]] | None,
                    auto_pin: bool, pin_ttl_s: float | None) -> AsyncSession:
        history = _initial(system, messages)
        if session_id is not None:
            check_id(session_id, "session_id")
        if await client.kvbranch_available():
            try:
                info = await client.create_session(session_id, auto_pin=auto_pin,
                                                   pin_ttl_s=pin_ttl_s)
            except ConflictError:
                info = await client.get_session(session_id)  # type: ignore[arg-type]
            except KVBranchUnavailableError:
                client._mark_unavailable()
                info = None
            if info is not None:
                session_id = info.session_id
        session = cls(client, session_id or _local_session_id(), auto_pin=auto_pin,
                      pin_ttl_s=pin_ttl_s)
        session.branches[DEFAULT_BRANCH] = AsyncBranch(session, DEFAULT_BRANCH, history)
        return session

    @property
    def main(self) -> AsyncBranch:
        return self.branches[DEFAULT_BRANCH]

    async def _server(self, branch: AsyncBranch | None, fn: Callable[[], Awaitable[T]]
                      ) -> T | None:
        if not await self.client.kvbranch_available():
            return None
        try:
            return await fn()
        except KVBranchUnavailableError:
            self.client._mark_unavailable()
            return None
        except NotFoundError as exc:
            logger.info("kvbranch: server lost %s (%s); restoring it from the client history",
                        self.session_id, exc.message)
            await self._restore(branch)
            return await fn()

    async def _restore(self, branch: AsyncBranch | None) -> None:
        self.recoveries += 1
        try:
            await self.client.create_session(self.session_id, auto_pin=self.auto_pin,
                                             pin_ttl_s=self.pin_ttl_s)
        except ConflictError:
            pass
        if branch is not None and branch.branch_id != DEFAULT_BRANCH:
            try:
                await self._fork(DEFAULT_BRANCH, branch, None)
            except ConflictError:
                pass
        if branch is not None and branch.pin_ttl_s is not None:
            try:
                await self.client.pin_branch(self.session_id, branch.branch_id,
                                             branch.pin_ttl_s)
            except ConflictError as exc:
                logger.warning("kvbranch: could not re-pin %s/%s: %s", self.session_id,
                               branch.branch_id, exc.message)

    async def _fork(self, parent: str, child: AsyncBranch, parent_len: int | None
                    ) -> BranchInfo:
        try:
            return await self.client.fork_branch(self.session_id, parent=parent,
                                                 branch_id=child.branch_id,
                                                 **child._fork_body())
        except BadRequestError as exc:
            if not child._messages:
                raise
            return await self.client.fork_branch(self.session_id, parent=parent,
                                                 branch_id=child.branch_id,
                                                 **child._fork_fallback(parent_len, exc))

    async def info(self) -> SessionInfo | None:
        return await self._server(None, lambda: self.client.get_session(self.session_id))

    async def delete(self) -> None:
        if await self.client.kvbranch_available():
            try:
                await self.client.delete_session(self.session_id)
            except NotFoundError:
                pass
        self.branches.clear()


class AsyncBranch(_BranchBase[AsyncSession]):
    """:class:`Branch` over :class:`AsyncKVBranchClient`."""

    async def chat(self, content: MessageInput = None, *, role: str = "user",
                   **params: Unpack[ChatParams]) -> ChatResult:
        history = self._next_history(content, role)
        result = await self.session.client.chat(history, **self._ids(), **params)
        self._commit(history)(result)
        return result

    async def chat_stream(self, content: MessageInput = None, *, role: str = "user",
                          **params: Unpack[ChatParams]) -> AsyncChatStream:
        history = self._next_history(content, role)
        return await self.session.client.chat_stream(history, **self._ids(), **params,
                                                     on_complete=self._commit(history))

    async def fork(self, at_message: int | None = None, *, branch_id: str | None = None
                   ) -> AsyncBranch:
        index = self._fork_index(at_message)
        child = self._new_child(index, branch_id)
        await self.session._server(self, lambda: self.session._fork(
            self.branch_id, child, len(self._messages)))
        self.session.branches[child.branch_id] = child
        return child

    async def pin(self, ttl_s: float) -> BranchInfo | None:
        PinRequest(ttl_s=ttl_s)  # validate here, also when the server has no kvbranch
        info = await self.session._server(self, lambda: self.session.client.pin_branch(
            self.session_id, self.branch_id, ttl_s))
        self.pin_ttl_s = ttl_s
        return info

    async def unpin(self) -> BranchInfo | None:
        self.pin_ttl_s = None
        return await self.session._server(self, lambda: self.session.client.unpin_branch(
            self.session_id, self.branch_id))

    async def prefetch(self) -> PrefetchResult | None:
        return await self.session._server(self, lambda: self.session.client.prefetch_branch(
            self.session_id, self.branch_id))

    async def info(self) -> BranchInfo | None:
        return await self.session._server(self, lambda: self.session.client.get_branch(
            self.session_id, self.branch_id))

    async def delete(self) -> None:
        if self.branch_id == DEFAULT_BRANCH:
            raise ValueError("the main branch cannot be deleted; delete the session")
        if await self.session.client.kvbranch_available():
            try:
                await self.session.client.delete_branch(self.session_id, self.branch_id)
            except NotFoundError:
                pass
        self.session.branches.pop(self.branch_id, None)
