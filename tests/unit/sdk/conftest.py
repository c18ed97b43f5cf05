"""One test, both drivers: the ``driver`` fixture runs each sdk test against the sync client and
again against the async one.

Tests are written once, in sync style, against ``driver.client(...)``. For the async run the
client is wrapped in :class:`Blocking`, which awaits what the async sdk returns on a private
event loop, drains ``async for`` streams as plain iteration, and wraps the async objects it
hands out (sessions, branches, streams) the same way, so ``session.main.chat("x").text`` reads
the same for both clients.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from sdk import (
    AsyncBranch,
    AsyncChatStream,
    AsyncKVBranchClient,
    AsyncSession,
    KVBranchClient,
    RetryPolicy,
)

_ASYNC_TYPES = (AsyncKVBranchClient, AsyncChatStream, AsyncSession, AsyncBranch)
_SYNC_NAMES = {AsyncChatStream: {"close": "aclose"}}


class Blocking:
    """A sync view of an async sdk object (see the module docs)."""

    def __init__(self, target: Any, driver: Driver) -> None:
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_driver", driver)

    def __getattr__(self, name: str) -> Any:
        name = _SYNC_NAMES.get(type(self._target), {}).get(name, name)
        value = getattr(self._target, name)
        if inspect.ismethod(value) or inspect.isfunction(value):

            def call(*args: Any, **kwargs: Any) -> Any:
                return self._driver.wrap(value(*args, **kwargs))

            return call
        return self._driver.wrap(value)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._target, name, value)

    def __iter__(self) -> Iterator[Any]:
        chunks = self._target.__aiter__()
        while True:
            try:
                yield self._driver.loop.run_until_complete(chunks.__anext__())
            except StopAsyncIteration:
                return

    def __len__(self) -> int:
        return len(self._target)

    def __enter__(self) -> Blocking:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._driver.loop.run_until_complete(self._target.__aexit__(*exc))

    def __repr__(self) -> str:
        return f"Blocking({self._target!r})"


class Driver:
    """Makes sdk clients of one kind (``"sync"`` or ``"async"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.loop = asyncio.new_event_loop()
        self._views: dict[int, Blocking] = {}

    def client(self, *args: Any, **kwargs: Any) -> Any:
        """``KVBranchClient(*args, **kwargs)``, or the async client behind :class:`Blocking`."""
        if self.kind == "sync":
            return KVBranchClient(*args, **kwargs)
        return self.wrap(AsyncKVBranchClient(*args, **kwargs))

    def retry(self, *, wait: Callable[[float], None], **policy: Any) -> RetryPolicy:
        """A :class:`RetryPolicy` whose waits go to ``wait``; the other kind of sleep fails
        the test (each client must wait its own way: ``time.sleep`` would block a loop)."""

        def wrong_sleep(seconds: float) -> None:
            pytest.fail(f"the {self.kind} client used the other driver's sleep")

        async def async_wait(seconds: float) -> None:
            wait(seconds)

        async def wrong_async_sleep(seconds: float) -> None:
            wrong_sleep(seconds)

        if self.kind == "sync":
            return RetryPolicy(sleep=wait, async_sleep=wrong_async_sleep, **policy)
        return RetryPolicy(sleep=wrong_sleep, async_sleep=async_wait, **policy)

    def wrap(self, value: Any) -> Any:
        if inspect.isawaitable(value):
            value = self.loop.run_until_complete(value)
        if isinstance(value, _ASYNC_TYPES):
            return self._views.setdefault(id(value), Blocking(value, self))
        if isinstance(value, dict) and any(isinstance(v, AsyncBranch) for v in value.values()):
            return {k: self.wrap(v) for k, v in value.items()}
        return value

    def close(self) -> None:
        self.loop.close()


@pytest.fixture(params=["sync", "async"])
def driver(request: pytest.FixtureRequest) -> Iterator[Driver]:
    made = Driver(request.param)
    yield made
    made.close()
