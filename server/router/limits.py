"""How long and how many: the router's bounds on slow or numerous clients.

uvicorn bounds neither the time a client takes to send its request headers (a connection that
trickles one header byte at a time, or sends nothing, stays open for good: "slowloris") nor,
by default, how many requests run at once. The router is the cluster's one public door, so:

* :class:`HeaderDeadlineProtocol` closes a connection whose next request's headers are not
  complete :data:`HEADER_TIMEOUT_S` after it opened or after its previous response ended;
* :data:`BODY_TIMEOUT_S` bounds reading a request body (:func:`server.router.edge.read_body`
  answers 408 past it);
* :data:`MAX_CONCURRENCY` connections and requests at once (uvicorn's ``limit_concurrency``
  answers 503 beyond it).
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 60.0
MAX_CONCURRENCY = 2048


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers."""

    header_timeout_s = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def _arm_header_deadline(self) -> None:
        self.loop.call_later(self.header_timeout_s, self._header_deadline, self.cycle)

    def _header_deadline(self, cycle_then: Any) -> None:
        """No new request since the deadline was set (``cycle`` is made when a request's
        headers are complete): the client is too slow, close the connection."""
        if self.cycle is cycle_then and not self.transport.is_closing():
            if cycle_then is None or cycle_then.response_complete:
                self.transport.close()
