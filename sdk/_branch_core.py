"""What a branch does, written once for :class:`sdk.Branch` and :class:`sdk.AsyncBranch`: its
client-side history, the request of a turn, forks (with the fallback when the server cannot
render the history) and its server-side state (pin, prefetch, info, delete), each a flow of
:mod:`sdk._core` that the session runs with recovery (:mod:`sdk._session_core`).
"""

from __future__ import annotations

import copy
import logging
import secrets
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, Protocol, TypeVar, cast

from typing_extensions import Self

from sdk import contract
from sdk._common import ChatArgs, ChatParams, check_messages
from sdk._core import Flow, Flows
from sdk.errors import BadRequestError, NotFoundError
from sdk.types import ChatResult

__all__ = ["BranchCore", "BranchSession", "MessageInput", "new_branch_id"]

logger = logging.getLogger("kvbranch.sdk")
T = TypeVar("T")
MessageInput = str | Mapping[str, Any] | Sequence[Mapping[str, Any]] | None


class BranchSession(Protocol):
    """What a branch needs of its session (:class:`sdk._session_core.SessionCore` has it), so
    that this module, below the session's, does not import it back."""

    session_id: str
    branches: dict[str, Any]

    @property
    def _flows(self) -> Flows: ...

    def _kvbranch_on(self) -> bool: ...

    def _add(self, branch: BranchCore[Any]) -> None: ...

    def _server(
        self, branch: BranchCore[Any] | None, make: Callable[[], Flow[T]]
    ) -> Flow[T | None]: ...

    def _fork(
        self, parent: str, child: BranchCore[Any], parent_len: int | None
    ) -> Flow[contract.BranchInfo]: ...


S = TypeVar("S", bound=BranchSession)


def new_branch_id() -> str:
    return f"br_{secrets.token_hex(8)}"


class BranchCore(Generic[S]):
    """One line of a conversation (see :class:`sdk.Branch`)."""

    def __init__(
        self,
        session: S,
        branch_id: str,
        messages: list[dict[str, Any]],
        *,
        parent_id: str | None = None,
        fork_index: int | None = None,
    ) -> None:
        self.session = session
        self.branch_id = contract.check_id(branch_id, "branch_id")
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
        return (
            f"{type(self).__name__}(session_id={self.session_id!r}, "
            f"branch_id={self.branch_id!r}, messages={len(self._messages)})"
        )

    def add(self, *messages: Mapping[str, Any]) -> None:
        """Append messages without generating (e.g. tool results, or a scripted turn)."""
        self._messages.extend(check_messages(list(messages)))

    def set_messages(self, messages: Sequence[Mapping[str, Any]]) -> None:
        """Replace the client history, for callers that own the conversation and send it
        whole on every call (agent frameworks): the next :meth:`chat` with no content sends
        exactly ``messages``, and forks and server-side restores start from them."""
        self._messages = check_messages(messages)

    def add_tool_result(self, tool_call_id: str, content: str, *, name: str | None = None) -> None:
        """Append the ``tool`` message answering the tool call ``tool_call_id``."""
        if not isinstance(content, str):
            raise TypeError(
                f"tool result content must be a string, got "
                f"{type(content).__name__} (serialize it, e.g. json.dumps)"
            )
        message: dict[str, Any] = {"role": "tool", "tool_call_id": tool_call_id, "content": content}
        if name:
            message["name"] = name
        self._messages.append(message)

    # --- turns ----------------------------------------------------------------------------
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
            raise ValueError("nothing to send: the branch has no messages and no content was given")
        return history

    def _args(self, params: ChatParams) -> ChatArgs:
        """``params`` plus this branch's ids (on a kvbranch server)."""
        args = cast(ChatArgs, dict(params))
        if self.session._kvbranch_on():
            args["session_id"] = self.session_id
            args["branch_id"] = self.branch_id
        return args

    def _commit(self, history: list[dict[str, Any]]) -> Callable[[ChatResult], None]:
        def commit(result: ChatResult) -> None:
            self._messages = history + [result.message]

        return commit

    def _turn(
        self, content: MessageInput, role: str, params: ChatParams
    ) -> tuple[list[dict[str, Any]], ChatArgs, Callable[[ChatResult], None]]:
        """The history a turn sends, its request arguments, and what commits its answer."""
        history = self._next_history(content, role)
        return history, self._args(params), self._commit(history)

    def _chat(self, content: MessageInput, role: str, params: ChatParams) -> Flow[ChatResult]:
        history, args, commit = self._turn(content, role, params)
        result = yield from self.session._flows.chat(history, **args)
        commit(result)
        return result

    # --- forks ----------------------------------------------------------------------------
    def _fork_index(self, at_message: int | None) -> int:
        n = len(self._messages)
        if at_message is None:
            return n
        if isinstance(at_message, bool) or not isinstance(at_message, int):
            raise TypeError(f"at_message must be an int, got {type(at_message).__name__}")
        index = at_message + n if at_message < 0 else at_message
        if not 0 <= index <= n:
            raise IndexError(
                f"at_message={at_message} is outside this branch's history (0..{n}, or -{n}..-1)"
            )
        return index

    def _fork(self, at_message: int | None, branch_id: str | None) -> Flow[Self]:
        index = self._fork_index(at_message)
        branch_id = contract.check_id(branch_id, "branch_id") if branch_id else new_branch_id()
        if branch_id in self.session.branches:
            raise ValueError(f"branch {branch_id!r} already exists in this session")
        child = type(self)(
            self.session,
            branch_id,
            copy.deepcopy(self._messages[:index]),
            parent_id=self.branch_id,
            fork_index=index,
        )
        yield from self.session._server(
            self, lambda: self.session._fork(self.branch_id, child, len(self._messages))
        )
        self.session._add(child)
        return child

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
        logger.warning(
            "kvbranch: the server could not fork %s/%s at its messages (%s); "
            "forking without a shared prefix",
            self.session_id,
            self.branch_id,
            exc.message,
        )
        if parent_len is not None and self.fork_index == parent_len:
            return {}
        return {"token_offset": 0}

    # --- server-side state ----------------------------------------------------------------
    def _pin(self, ttl_s: float) -> Flow[contract.BranchInfo | None]:
        contract.PinRequest(ttl_s=ttl_s)  # validate here, also when the server has no kvbranch
        info = yield from self.session._server(
            self, lambda: self.session._flows.pin_branch(self.session_id, self.branch_id, ttl_s)
        )
        self.pin_ttl_s = ttl_s
        return info

    def _unpin(self) -> Flow[contract.BranchInfo | None]:
        self.pin_ttl_s = None
        return (
            yield from self.session._server(
                self, lambda: self.session._flows.unpin_branch(self.session_id, self.branch_id)
            )
        )

    def _prefetch(self, to_device: bool = False) -> Flow[contract.PrefetchResult | None]:
        return (
            yield from self.session._server(
                self,
                lambda: self.session._flows.prefetch_branch(
                    self.session_id, self.branch_id, to_device
                ),
            )
        )

    def _info(self) -> Flow[contract.BranchInfo | None]:
        return (
            yield from self.session._server(
                self, lambda: self.session._flows.get_branch(self.session_id, self.branch_id)
            )
        )

    def _delete(self) -> Flow[None]:
        if self.branch_id == contract.DEFAULT_BRANCH:
            raise ValueError("the main branch cannot be deleted; delete the session")
        if (yield from self.session._flows.kvbranch_available()):
            try:
                yield from self.session._flows.delete_branch(self.session_id, self.branch_id)
            except NotFoundError:
                pass
        self.session.branches.pop(self.branch_id, None)
