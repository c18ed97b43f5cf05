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
All of the logic is in :mod:`sdk._session_core` and :mod:`sdk._branch_core`; the classes here
only run their flows, one line per method. They see their client through :mod:`sdk._driver`
(the interface the clients implement), so this module imports neither client: the clients
import it, to open sessions.
"""

from __future__ import annotations

from typing_extensions import Unpack

from sdk._branch_core import BranchCore, MessageInput
from sdk._common import ChatParams
from sdk._core import copy_docs
from sdk._driver import AsyncDriver, SyncDriver
from sdk._session_core import SessionCore
from sdk._stream import AsyncChatStream, ChatStream
from sdk.contract import BranchInfo, PrefetchResult, SessionInfo
from sdk.types import ChatResult

__all__ = ["Session", "Branch", "AsyncSession", "AsyncBranch"]


# --- sync -----------------------------------------------------------------------------------
class Branch(BranchCore["Session"]):
    """One line of a conversation: its message history, and the server-side branch of the
    same id that caches it."""

    def chat(
        self, content: MessageInput = None, *, role: str = "user", **params: Unpack[ChatParams]
    ) -> ChatResult:
        """Add ``content`` (a string as a ``role`` message, a message dict, or a list of
        them; ``None`` to just continue), generate the answer over the whole history and
        append it. The history changes only when the call succeeds."""
        return self.session.client._run(self._chat(content, role, params))

    def chat_stream(
        self, content: MessageInput = None, *, role: str = "user", **params: Unpack[ChatParams]
    ) -> ChatStream:
        """Like :meth:`chat`, streamed. The answer is appended to the history when the
        stream has been read to its end."""
        history, args, commit = self._turn(content, role, params)
        return self.session.client.chat_stream(history, on_complete=commit, **args)

    def fork(self, at_message: int | None = None, *, branch_id: str | None = None) -> Branch:
        """A new branch whose history is ``messages[:at_message]`` (default: all of it; a
        negative index counts from the end). The server forks its cache at the same point,
        sharing the common blocks."""
        return self.session.client._run(self._fork(at_message, branch_id))

    def pin(self, ttl_s: float) -> BranchInfo | None:
        """Keep this branch's cache for ``ttl_s`` seconds (each use renews the lease).
        :class:`~sdk.errors.ConflictError` when it exceeds the server's pin budget."""
        return self.session.client._run(self._pin(ttl_s))

    def unpin(self) -> BranchInfo | None:
        """Release the pin (the blocks stay cached as long as the store has room)."""
        return self.session.client._run(self._unpin())

    def prefetch(self, to_device: bool = False) -> PrefetchResult | None:
        """Make this branch's next turn start warm — e.g. when the model emitted a tool call,
        so the turn with the tool result starts warm. Returns at once. Costs no engine step
        when the server's device cache or host store already holds the branch (unless
        ``to_device``: then the engine loads it into the device cache in the background)."""
        return self.session.client._run(self._prefetch(to_device))

    def info(self) -> BranchInfo | None:
        """The server's view of this branch (``None`` without kvbranch)."""
        return self.session.client._run(self._info())

    def delete(self) -> None:
        """Delete the branch (server and client). ``main`` cannot be deleted."""
        return self.session.client._run(self._delete())


class Session(SessionCore[SyncDriver, Branch]):
    """A conversation and its branches (see the module docs). Get one with
    :meth:`KVBranchClient.session`."""

    _branch_type = Branch

    def info(self) -> SessionInfo | None:
        """The server's view of the session (``None`` without kvbranch)."""
        return self.client._run(self._info())

    def delete(self) -> None:
        """Delete the session on the server (releasing its pins) and forget its branches."""
        return self.client._run(self._delete())


# --- async ----------------------------------------------------------------------------------
class AsyncBranch(BranchCore["AsyncSession"]):
    """:class:`Branch` over :class:`AsyncKVBranchClient`."""

    async def chat(
        self, content: MessageInput = None, *, role: str = "user", **params: Unpack[ChatParams]
    ) -> ChatResult:
        return await self.session.client._arun(self._chat(content, role, params))

    async def chat_stream(
        self, content: MessageInput = None, *, role: str = "user", **params: Unpack[ChatParams]
    ) -> AsyncChatStream:
        history, args, commit = self._turn(content, role, params)
        return await self.session.client.chat_stream(history, on_complete=commit, **args)

    async def fork(
        self, at_message: int | None = None, *, branch_id: str | None = None
    ) -> AsyncBranch:
        return await self.session.client._arun(self._fork(at_message, branch_id))

    async def pin(self, ttl_s: float) -> BranchInfo | None:
        return await self.session.client._arun(self._pin(ttl_s))

    async def unpin(self) -> BranchInfo | None:
        return await self.session.client._arun(self._unpin())

    async def prefetch(self, to_device: bool = False) -> PrefetchResult | None:
        return await self.session.client._arun(self._prefetch(to_device))

    async def info(self) -> BranchInfo | None:
        return await self.session.client._arun(self._info())

    async def delete(self) -> None:
        return await self.session.client._arun(self._delete())


class AsyncSession(SessionCore[AsyncDriver, AsyncBranch]):
    """:class:`Session` over :class:`AsyncKVBranchClient`."""

    _branch_type = AsyncBranch

    async def info(self) -> SessionInfo | None:
        return await self.client._arun(self._info())

    async def delete(self) -> None:
        return await self.client._arun(self._delete())


copy_docs(AsyncBranch, Branch)
copy_docs(AsyncSession, Session)
