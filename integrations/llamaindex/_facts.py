"""What :class:`~integrations.llamaindex.KVBranchLLM`'s metadata reports about the server:
the served model and its context length (``max_model_len`` of ``GET /v1/models``)."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from llama_index.core.constants import DEFAULT_CONTEXT_WINDOW

from sdk import NO_RETRY, ChatResult, KVBranchClient, KVBranchError

__all__ = ["ServerFacts"]

logger = logging.getLogger("kvbranch.llamaindex")

_PROBE_RETRY_S = 30.0


class ServerFacts:
    """What the LLM's metadata reports about the server: the served model and its context
    length, read once from ``GET /v1/models`` (a failure is retried after 30 s; meanwhile the
    caller uses its default)."""

    def __init__(self, model: str | None, headers: dict[str, str] | None, transport: Any) -> None:
        self._headers, self._transport = headers, transport
        self.model_name = model
        self.context_window: int | None = None
        self._probed_at: float | None = None
        self._lock = threading.Lock()

    def saw(self, result: ChatResult) -> None:
        self.model_name = self.model_name or result.model

    def probe(self, base_url: str, api_key: str | None) -> int | None:
        with self._lock:
            now = time.monotonic()
            if self.context_window is not None or (
                self._probed_at is not None and now - self._probed_at < _PROBE_RETRY_S
            ):
                return self.context_window
            self._probed_at = now
            try:
                with KVBranchClient(
                    base_url,
                    api_key=api_key,
                    model=self.model_name,
                    timeout=10.0,
                    retry=NO_RETRY,
                    kvbranch=False,
                    default_headers=self._headers,
                    transport=self._transport,
                ) as client:
                    self.model_name = client.resolve_model(self.model_name)
                    self.context_window = client.max_model_len(self.model_name)
            except KVBranchError as exc:
                logger.warning(
                    "kvbranch: could not read the context window from %s (%s); using %d",
                    base_url,
                    exc,
                    DEFAULT_CONTEXT_WINDOW,
                )
            return self.context_window
