"""The pieces every conversation operation is made of: where a call goes (:class:`BranchRef`),
and operations written once as generators of client calls, run by a sync and an async driver.

Why generators: the sync and async clients have the same method names and differ only in
whether a call must be awaited. An operation therefore *yields* :data:`Op`\\ s (a function of a
client: ``lambda c: c.fork_branch(...)``), is *sent* their results or has their errors thrown
in, and returns its result; :func:`run_flow` drives it on a :class:`~sdk.KVBranchClient`,
:func:`arun_flow` on an :class:`~sdk.AsyncKVBranchClient`. This is how httpx writes its
``auth_flow``\\ s once for ``Client`` and ``AsyncClient``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from sdk import DEFAULT_BRANCH, AsyncKVBranchClient, ChatResult, KVBranchClient
from sdk.contract import check_id

__all__ = [
    "BranchRef",
    "SessionSettings",
    "coerce_id",
    "answer_message",
    "Op",
    "Flow",
    "run_flow",
    "arun_flow",
    "available",
]

T = TypeVar("T")
Op = Callable[[Any], Any]
"""One call on a client: given the sync or the async client, returns the value or an
awaitable of it."""
Flow = Generator[Op, Any, T]
"""An operation written once: yields client calls, is sent their results (or has their errors
thrown in), returns a ``T``."""

# the characters of sdk.contract's ID_PATTERN (check_id has the last word)
_ID_OK = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._:-")


def coerce_id(value: Any, prefix: str = "") -> str | None:
    """A valid kvbranch id made from ``value`` (a framework's thread or checkpoint id): other
    characters become ``-``, a leading non-alphanumeric gets an ``x``, at most 128 characters.
    ``None`` for ``None`` or ``""``."""
    if value is None or value == "":
        return None
    text = "".join(c if c in _ID_OK else "-" for c in prefix + str(value))
    if not text[0].isalnum():
        text = "x" + text
    return check_id(text[:128])


@dataclass(frozen=True)
class BranchRef:
    """Where a call goes: a session (``None``: no kvbranch session, a plain request), a branch
    (``None``: the server's default, ``main``, without naming it) and, for a branch forked
    lazily, the branch it forks from at its first call."""

    session_id: str | None = None
    branch_id: str | None = None
    fork_parent: str | None = None

    @property
    def branch(self) -> str:
        return self.branch_id or DEFAULT_BRANCH

    def ids(self) -> dict[str, str]:
        """The ids a request names (``session_id``, and ``branch_id`` when set)."""
        if self.session_id is None:
            return {}
        if self.branch_id is None:
            return {"session_id": self.session_id}
        return {"session_id": self.session_id, "branch_id": self.branch_id}


@dataclass(frozen=True)
class SessionSettings:
    """An owned session: created (or attached to) on first use with these pin settings."""

    session_id: str
    auto_pin: bool = True
    pin_ttl_s: float | None = None


def answer_message(result: ChatResult) -> dict[str, Any]:
    """The assistant message of ``result`` as it goes back to the server: content ``""``
    rather than ``null`` beside tool calls (chat templates that concatenate the content, such
    as SmolLM2's, cannot render ``null`` when the server forks at these messages), and every
    tool call with an id."""
    message: dict[str, Any] = {"role": "assistant", "content": result.text}
    if result.tool_calls:
        message["tool_calls"] = [
            {
                "id": tc.id or f"call_{i}",
                "type": tc.type or "function",
                "function": {"name": tc.name, "arguments": tc.arguments},
            }
            for i, tc in enumerate(result.tool_calls)
        ]
    return message


def available(client: Any) -> Any:
    """Op: whether the server has the kvbranch routes (probed once per client)."""
    return client.kvbranch_available()


@dataclass
class _Step:
    op: Op | None
    value: Any = None


def _advance(flow: Flow[Any], value: Any = None, error: BaseException | None = None) -> _Step:
    try:
        op = flow.throw(error) if error is not None else flow.send(value)
    except StopIteration as stop:
        return _Step(None, stop.value)
    return _Step(op)


def _attempt(op: Op, client: Any) -> tuple[Any, BaseException | None]:
    try:
        return op(client), None
    except Exception as exc:  # thrown into the flow, which re-raises what it does not handle
        return None, exc


async def _aattempt(op: Op, client: Any) -> tuple[Any, BaseException | None]:
    try:
        value = op(client)
        return (await value if inspect.isawaitable(value) else value), None
    except Exception as exc:
        return None, exc


def run_flow(flow: Flow[T], client: KVBranchClient) -> T:
    """Run a flow on the sync client."""
    step = _advance(flow)
    while step.op is not None:
        step = _advance(flow, *_attempt(step.op, client))
    return step.value  # type: ignore[no-any-return]


async def arun_flow(flow: Flow[T], client: AsyncKVBranchClient) -> T:
    """Run a flow on the async client."""
    step = _advance(flow)
    while step.op is not None:
        step = _advance(flow, *(await _aattempt(step.op, client)))
    return step.value  # type: ignore[no-any-return]
