"""The router's edge with its clients: everything a client sends is checked here, before any
index read or write and before any instance sees it.

Two halves:

* :class:`Edge`, the outermost ASGI layer, runs on headers alone, before a route reads a byte
  of the body: the headers the cluster reads are checked (:mod:`server.checks.headers`: once
  each, printable ASCII), the API key is checked (with keys, a request without one of them gets
  401 on every route but ``/health`` and ``/metrics`` — so an unauthenticated request never
  reaches the index, and Redis gains nothing from it), and the request is counted against the
  router's in-flight bounds (503 past :data:`~server.router.limits.MAX_INFLIGHT`, 429 past a
  tenant's share, both with ``Retry-After``). It also bounds how long one write to a client
  may wait: a client that stops reading its stream is cut off after
  :data:`~server.router.limits.SEND_TIMEOUT_S` and the upstream stream released, so a slow
  reader never pins an instance's connection for long.
* :func:`read_turn` and :func:`read_session_body` read a route's body, bounded before it is
  read (:func:`read_body`: 413, 408), and apply the instances' own rules to it
  (:mod:`server.checks`: JSON depth and lone surrogates, session and branch ids from every
  place a dialect reads them, strict types of the fields the router reads): a 400 that names
  the field.

A request's tenant — the digest of its API key (:mod:`server.common.tenants`) — scopes the cluster
index the way the instances scope sessions; :class:`Edge` decides it once and the routes read
it with :func:`tenant_of`. The router's own error replies come from the server's one error
builder (:mod:`server.common.errors`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Gauge

from sdk.contract import BRANCH_HEADER, MAX_BODY_BYTES, SESSION_HEADER, check_id
from server import dialects
from server.checks import json_body
from server.checks.fields import field_problem
from server.checks.headers import header, header_problem
from server.checks.ids import MESSAGE_CHARS, id_problem
from server.checks.transfer import transfer_problem
from server.common.errors import error_response, send_error
from server.common.tenants import KeyTable, scope_of
from server.common.ui_page import PAGE_PATHS
from server.router.limits import BODY_TIMEOUT_S, MAX_INFLIGHT, SEND_TIMEOUT_S, TENANT_INFLIGHT

logger = logging.getLogger("kvbranch.router")

#: Request headers a completion turn forwards to the instances.
FORWARD_HEADERS = ("authorization", SESSION_HEADER.lower(), BRANCH_HEADER.lower())
#: Request headers a session route forwards.
SESSION_ROUTE_HEADERS = ("authorization", "content-type")
#: How long a client should wait before retrying when no instance answers.
RETRY_AFTER = {"Retry-After": "5"}
#: Routes served without a key: a load balancer's liveness check and Prometheus' scrape (as
#: vLLM serves its own ``/health`` and ``/metrics``), and the agent page's static files (its
#: data route needs a key). Everything else needs one, with keys.
PUBLIC_PATHS = frozenset({"/health", "/metrics", *PAGE_PATHS})
#: Where :class:`Edge` leaves the request's tenant in the ASGI scope's state.
TENANT_STATE = "kvbranch_tenant"
#: What the edge answers each refusal it counts with (``kvbranch_router_refused``'s reason):
#: the status and the headers; the message says the particulars.
REFUSALS: dict[str, tuple[int, dict[str, str] | None]] = {
    "header": (400, None),
    "key": (401, {"WWW-Authenticate": "Bearer"}),
    "busy": (503, {"Retry-After": "1"}),
    "tenant_inflight": (429, {"Retry-After": "1"}),
}

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class Refused(Exception):
    """The request is refused before any instance sees it; ``response`` says why."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


class SlowClient(Exception):
    """A write to the client did not complete within the send deadline."""


def unavailable(message: str) -> JSONResponse:
    """503 with Retry-After: no instance could take the request."""
    return error_response(503, message, headers=RETRY_AFTER)


def tenant_of(request: Request) -> str:
    """Whose request this is: the tenant :class:`Edge` decided (the digest of its API key —
    :func:`server.common.tenants.scope_of`, the same tenant id the instances give a key they have).
    It scopes the cluster index."""
    tenant = request.scope.get("state", {}).get(TENANT_STATE)
    return tenant if isinstance(tenant, str) else scope_of(request.headers.get("authorization"))


class EdgeState:
    """What the edge counts, owned by the router (one per router, however often its app is
    built): requests in flight, per tenant and in all, and the refusals by reason."""

    def __init__(
        self,
        keys: KeyTable,
        registry: CollectorRegistry,
        *,
        max_inflight: int = MAX_INFLIGHT,
        tenant_inflight: int = TENANT_INFLIGHT,
        send_timeout_s: float = SEND_TIMEOUT_S,
    ) -> None:
        self.keys = keys
        self.max_inflight = max_inflight
        self.tenant_inflight = tenant_inflight
        self.send_timeout_s = send_timeout_s
        #: tenant → requests in flight (only tenants with one: bounded by the requests)
        self.inflight: dict[str, int] = {}
        self.total = 0
        self.refused = Counter(
            "kvbranch_router_refused",
            "Requests the router's edge answered itself, by reason",
            ["reason"],
            registry=registry,
        )
        self.slow_clients = Counter(
            "kvbranch_router_slow_clients",
            "Responses cut off because the client did not read them within the send deadline",
            registry=registry,
        )
        Gauge(
            "kvbranch_router_inflight",
            "Requests in flight through the router's edge",
            registry=registry,
        ).set_function(lambda: self.total)


class Edge:
    """The outermost ASGI layer of the router: header checks, API keys, in-flight bounds and a
    deadline on each write to the client — before any route runs."""

    def __init__(self, app: ASGIApp, state: EdgeState) -> None:
        self.app = app
        self.state = state

    async def _refuse(
        self, send: Send, reason: str, message: str, param: str | None = None
    ) -> None:
        """Answer with the error :data:`REFUSALS` gives ``reason``, counted by that reason."""
        status, headers = REFUSALS[reason]
        self.state.refused.labels(reason).inc()
        await send_error(send, status, message, param, headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        problem = header_problem(scope["headers"])
        if problem is not None:
            await self._refuse(send, "header", problem[1], problem[0])
            return
        authorization = header(scope, "authorization")  # printable ASCII: checked above
        if self.state.keys:
            tenant = self.state.keys.owner(authorization)
            if tenant is None and path not in PUBLIC_PATHS:
                await self._refuse(
                    send,
                    "key",
                    "this router requires an API key: send 'Authorization: Bearer <key>' "
                    "with one of the cluster's keys",
                )
                return
        else:
            tenant = scope_of(authorization)
        if path in PUBLIC_PATHS or tenant is None:
            await self.app(scope, receive, send)
            return
        if self.state.total >= self.state.max_inflight:
            await self._refuse(
                send,
                "busy",
                f"the router has {self.state.max_inflight} requests in flight; retry shortly",
            )
            return
        if self.state.inflight.get(tenant, 0) >= self.state.tenant_inflight:
            await self._refuse(
                send,
                "tenant_inflight",
                f"this API key has {self.state.tenant_inflight} requests in flight through this "
                "router, its share; retry when one has finished",
            )
            return
        scope.setdefault("state", {})[TENANT_STATE] = tenant
        self.state.total += 1
        self.state.inflight[tenant] = self.state.inflight.get(tenant, 0) + 1
        try:
            await self.app(scope, receive, self._deadline(send))
        except SlowClient:
            self.state.slow_clients.inc()
            logger.info(
                "a client did not read within %gs: response cut off", self.state.send_timeout_s
            )
        finally:
            self.state.total -= 1
            left = self.state.inflight[tenant] - 1
            if left:
                self.state.inflight[tenant] = left
            else:
                del self.state.inflight[tenant]

    def _deadline(self, send: Send) -> Send:
        timeout = self.state.send_timeout_s

        async def timed(message: dict[str, Any]) -> None:
            try:
                await asyncio.wait_for(send(message), timeout)
            except asyncio.TimeoutError:
                raise SlowClient from None

        return timed


async def read_body(request: Request) -> bytes:
    """The request body, bounded *before* it is read: a declared Content-Length over
    ``MAX_BODY_BYTES`` is refused unread, and a chunked (or understated) body as soon as the
    bytes read pass the bound — a client cannot make the router buffer an unbounded body."""
    limit = MAX_BODY_BYTES  # read at call time (tests lower it)
    declared = request.headers.get("content-length")
    if declared is not None:
        digits = declared.strip()
        if not (digits.isascii() and digits.isdigit()):
            raise Refused(error_response(400, "Content-Length is not a number"))
        if int(digits) > limit:
            raise Refused(error_response(413, f"request body over {limit} bytes"))
    chunks: list[bytes] = []

    async def read() -> None:
        total = 0
        async for chunk in request.stream():
            total += len(chunk)
            if total > limit:
                raise Refused(error_response(413, f"request body over {limit} bytes"))
            chunks.append(chunk)

    try:
        await asyncio.wait_for(read(), BODY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise Refused(
            error_response(408, f"request body not received within {BODY_TIMEOUT_S:g} s")
        ) from None
    return b"".join(chunks)


def parse_object(raw: bytes) -> dict[str, Any]:
    """A body that must be a JSON object, with the instances' rules on JSON itself (depth,
    lone surrogates: :mod:`server.checks.json_body`)."""
    payload, problem = json_body.parse(raw)
    if problem is not None:
        raise Refused(error_response(400, problem[1], param=problem[0]))
    if payload is None:
        try:
            json.loads(raw)
        except (ValueError, RecursionError):
            raise Refused(error_response(400, "request body is not valid JSON")) from None
    if not isinstance(payload, dict):
        raise Refused(error_response(400, "request body must be a JSON object"))
    return payload


async def read_turn(request: Request) -> dict[str, Any]:
    """A completion turn's body, checked as the instances check it — and more strictly where the
    router acts on a field itself — so that a request an instance would refuse is refused here,
    before any index write and before P prefills a token of it. A client's transfer params,
    in the field or smuggled in the extension args, are refused here in every topology: the
    router never relays them (:mod:`server.checks.transfer`)."""
    payload = parse_object(await read_body(request))
    path = request.url.path
    problem = (
        id_problem(
            payload, request.headers.get(SESSION_HEADER), request.headers.get(BRANCH_HEADER), path
        )
        or dialects.problem(payload, path)
        or field_problem(payload)
        or transfer_problem(payload, path)
    )
    if problem is not None:
        raise Refused(error_response(400, problem[1], param=problem[0]))
    return payload


#: The id fields of a session route's body (create a session, create a branch).
SESSION_ROUTE_IDS = ("session_id", "branch_id", "parent")


async def read_session_body(request: Request) -> bytes:
    """A session route's body, as the client sent it (the instances parse it with their own
    models), refused here when the router could not act on it: bad JSON (depth, lone
    surrogates) or an id field that is not an id — the router keys the index with them."""
    raw = await read_body(request)
    if not raw:
        return raw
    payload = parse_object(raw)
    for field in SESSION_ROUTE_IDS:
        value = payload.get(field)
        if value is None or value == "":
            continue
        try:
            check_id(value, field)
        except ValueError as exc:
            raise Refused(error_response(400, str(exc)[:MESSAGE_CHARS], param=field)) from None
    return raw
