"""How long and how many: the router's bounds on slow, idle or numerous clients.

uvicorn bounds neither the time a client takes to send its request headers (a connection that
trickles one header byte at a time, or sends nothing, stays open for good: "slowloris") nor
how many idle connections it keeps, and its ``limit_concurrency`` counts *connections*: 2,100
idle sockets that never sent a byte made it answer 503 to every real request. The router is the
cluster's one public door, so:

* :class:`HeaderDeadlineProtocol` closes a connection whose next request's headers are not
  complete ``header_timeout_s`` after it opened or after its previous response ended (the
  router's ``--header-timeout-s``, :data:`HEADER_TIMEOUT_S` by default, set through
  :func:`client_protocol`), and keeps the open connections bounded: past
  :data:`MAX_CONNECTIONS` in all, or :data:`MAX_PEER_CONNECTIONS` from one address, a new
  connection makes room by closing the longest-idle connection without a request in progress
  (that peer's first) — so idle sockets give way to clients that send requests, and only when
  every connection is busy is the new one refused;
* :data:`BODY_TIMEOUT_S` bounds reading a request body (:func:`server.router.edge.read_body`
  answers 408 past it);
* :data:`MAX_INFLIGHT` requests at once in all, :data:`TENANT_INFLIGHT` per API key
  (:class:`server.router.edge.Edge` answers 503 / 429 with ``Retry-After`` beyond them), and
  :data:`SEND_TIMEOUT_S` for one write to a client that does not read.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

#: Default of ``--header-timeout-s``: a connection's next request headers must be complete
#: this long after it opened or after its previous response ended.
HEADER_TIMEOUT_S = 30.0
BODY_TIMEOUT_S = 60.0
#: Requests in flight through one router (streams included).
MAX_INFLIGHT = 1024
#: Requests in flight for one tenant (API key): a quarter of the upstream pool
#: (``server.router.app.MAX_CONNECTIONS``), so no one tenant can take it all.
TENANT_INFLIGHT = 128
#: One write to a client (an SSE chunk, a body) may wait this long for the client to read.
SEND_TIMEOUT_S = 30.0
#: Open client connections before idle ones are closed to make room.
MAX_CONNECTIONS = 1024
MAX_PEER_CONNECTIONS = 512


def _idle(conn: Any) -> bool:
    cycle = conn.cycle
    return cycle is None or bool(cycle.response_complete)


class HeaderDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request's headers and a bound on the
    open connections (the idle ones give way)."""

    header_timeout_s = HEADER_TIMEOUT_S
    max_connections = MAX_CONNECTIONS
    max_peer_connections = MAX_PEER_CONNECTIONS

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.idle_since = time.monotonic()
        self._arm_header_deadline()
        self._make_room()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self.idle_since = time.monotonic()
        self._arm_header_deadline()

    def _make_room(self) -> None:
        """Over a bound, close the longest-idle connection (this peer's first); when none is
        idle and the whole bound is passed, close this new one."""
        conns = [c for c in self.connections if c is not self and not c.transport.is_closing()]
        peer = self.client[0] if self.client else None
        mine = [c for c in conns if c.client and c.client[0] == peer]
        over_peer = len(mine) >= self.max_peer_connections
        over_all = len(conns) >= self.max_connections
        if not over_peer and not over_all:
            return
        pool = mine if over_peer else conns
        idle = [c for c in pool if _idle(c)] or ([c for c in conns if _idle(c)] if over_all else [])
        if idle:
            oldest = min(idle, key=lambda c: getattr(c, "idle_since", 0.0))
            oldest.transport.close()
        elif over_all:
            self.transport.close()

    def _arm_header_deadline(self) -> None:
        self.loop.call_later(self.header_timeout_s, self._header_deadline, self.cycle)

    def _header_deadline(self, cycle_then: Any) -> None:
        """No new request since the deadline was set (``cycle`` is made when a request's
        headers are complete): the client is too slow, close the connection."""
        if self.cycle is cycle_then and not self.transport.is_closing():
            if cycle_then is None or cycle_then.response_complete:
                self.transport.close()


def client_protocol(header_timeout_s: float = HEADER_TIMEOUT_S) -> type[HeaderDeadlineProtocol]:
    """The protocol class uvicorn serves the router's clients with, its header deadline
    ``header_timeout_s``: uvicorn makes one protocol per connection from a class, so the
    configured bound is that class's attribute."""
    if not 0 < header_timeout_s < float("inf"):  # nan too: a deadline that never fires
        raise ValueError(f"header_timeout_s must be finite and > 0, not {header_timeout_s!r}")
    bound = float(header_timeout_s)

    class ConfiguredHeaderDeadline(HeaderDeadlineProtocol):
        header_timeout_s = bound

    return ConfiguredHeaderDeadline
