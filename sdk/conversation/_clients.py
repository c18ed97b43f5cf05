"""The sdk clients a framework model and all its copies share."""

from __future__ import annotations

import asyncio
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import httpx

from sdk import AsyncKVBranchClient, KVBranchClient, RetryPolicy

__all__ = ["ClientSet"]

# keyword arguments of both clients, as ClientSet takes them
_SETTINGS = ("api_key", "model", "timeout", "retry", "default_headers", "kvbranch")


class ClientSet:
    """The sdk clients of a model and all its copies: one sync client, and one async client per
    event loop (httpx async connections belong to the loop that opened them). Clients are made
    on first use; those of closed loops are dropped (their connections died with the loop)."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float | None = 600.0,
        retry: RetryPolicy | None = None,
        default_headers: Mapping[str, str] | None = None,
        kvbranch: bool | None = None,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url
        values = (api_key, model, timeout, retry, default_headers, kvbranch)
        self._settings: dict[str, Any] = dict(zip(_SETTINGS, values, strict=True))
        self._transport = transport
        self._async_transport = async_transport
        self._lock = threading.Lock()
        self._sync: KVBranchClient | None = None
        # keyed by the loop object, weakly: id(loop) values are reused after a loop is gone
        self._async: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncKVBranchClient] = (
            weakref.WeakKeyDictionary()
        )

    @property
    def sync(self) -> KVBranchClient:
        with self._lock:
            if self._sync is None:
                self._sync = KVBranchClient(
                    self.base_url, transport=self._transport, **self._settings
                )
            return self._sync

    def current(self) -> AsyncKVBranchClient:
        """The async client of the running event loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            client = self._async.get(loop)
            if client is None:
                for stale in [other for other in list(self._async) if other.is_closed()]:
                    self._async.pop(stale, None)
                client = AsyncKVBranchClient(
                    self.base_url, transport=self._async_transport, **self._settings
                )
                self._async[loop] = client
            return client

    def loops(self) -> list[asyncio.AbstractEventLoop]:
        """The event loops that have an async client."""
        return list(self._async)

    def close(self) -> None:
        """Close the sync client (a later call makes a new one)."""
        with self._lock:
            client, self._sync = self._sync, None
        if client is not None:
            client.close()

    async def aclose(self) -> None:
        """Close the running loop's async client, then the sync one."""
        with self._lock:
            client = self._async.pop(asyncio.get_running_loop(), None)
        if client is not None:
            await client.close()
        self.close()
