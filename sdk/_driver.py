"""What a session needs of its client, defined below both: :mod:`sdk.session` depends on these
two interfaces, and :mod:`sdk.client`/:mod:`sdk.aclient` implement them (and import
:mod:`sdk.session` to open sessions), so neither side imports the other in a circle — not even
for a type. A session keeps its client as ``session.client`` (the very client object) and uses
only this much of it: the state and flows every client has (:class:`~sdk._core.ClientCore`), the
driver that runs a flow (``_run`` / ``await _arun``), and ``chat_stream``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

from typing_extensions import Unpack

from sdk._common import ChatArgs
from sdk._core import Callback, ClientCore, Flow
from sdk._stream import AsyncChatStream, ChatStream

__all__ = ["SyncDriver", "AsyncDriver"]

T = TypeVar("T")


class SyncDriver(ClientCore, ABC):
    """A synchronous client, as a :class:`~sdk.Session` sees it (:class:`~sdk.KVBranchClient`)."""

    @abstractmethod
    def _run(self, flow: Flow[T]) -> T:
        """Run a flow of :mod:`sdk._core` to its result, sending each request it yields."""

    @abstractmethod
    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        on_complete: Callback | None = None,
        **args: Unpack[ChatArgs],
    ) -> ChatStream:
        """A streamed chat completion (see :meth:`sdk.KVBranchClient.chat_stream`)."""


class AsyncDriver(ClientCore, ABC):
    """An asynchronous client, as an :class:`~sdk.AsyncSession` sees it
    (:class:`~sdk.AsyncKVBranchClient`)."""

    @abstractmethod
    async def _arun(self, flow: Flow[T]) -> T:
        """Run a flow of :mod:`sdk._core` to its result, sending each request it yields."""

    @abstractmethod
    async def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        on_complete: Callback | None = None,
        **args: Unpack[ChatArgs],
    ) -> AsyncChatStream:
        """A streamed chat completion (see :meth:`sdk.AsyncKVBranchClient.chat_stream`)."""
