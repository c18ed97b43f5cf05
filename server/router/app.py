"""The router: OpenAI-compatible to clients, prefill on P and decode on D behind it — or, in
front of aggregated replicas, each turn on the replica that holds its session.

This module only assembles the parts, each in its own module:

* :mod:`server.router.pool` — the instances, their health, which one a turn goes to;
* :mod:`server.router.turn` — a completion turn: claim D's hold, prefill (and pull) on P,
  decode on D, fall back to one instance when the other fails;
* :mod:`server.router.replica_turn` — a completion turn on one aggregated replica (the router
  knows replicas and no P or D): chosen by :mod:`server.router.replicas`, relayed unchanged;
* :mod:`server.router.relay` — the answer back to the client, D's transfer params filed;
* :mod:`server.router.admin` — session routes fanned out to every instance, stats, health;
* :mod:`server.router.edge` — bounded request bodies, 503 replies, the request's tenant;
* :mod:`server.router.choice` — which P is cheapest for a turn;
* :mod:`server.index` — the cluster index: which D holds which branch's KV, turn order, where
  each session lives, which instances are up and what blocks they hold. The embedded backend
  (bounded: swept on a timer started by the lifespan below, and capped) or a Redis every router
  shares, which makes routers stateless replicas.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from sdk.contract import (
    API_PREFIX,
    COMPLETION_PATHS,
    HEALTH_PATH,
    MODELS_PATH,
    PROTOCOL_VERSION,
    STATS_PATH,
)
from server.common.tenants import KeyTable
from server.common.ui_page import UI_DATA_PATH, add_page_routes
from server.index import IndexStore, MemoryIndexStore
from server.router.admin import Admin
from server.router.edge import Edge, EdgeState
from server.router.limits import TENANT_INFLIGHT
from server.router.pool import CACHE_AWARE, PROBE_MAX_CONNECTIONS, PROBE_TIMEOUT_S, Pool
from server.router.replica_turn import ReplicaFlow
from server.router.turn import TurnFlow

logger = logging.getLogger("kvbranch.router")

CONNECT_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 512
#: How long the router keeps an idle connection to an instance for reuse. Below the instances'
#: own keep-alive (vLLM's uvicorn closes an idle connection after VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
#: 5 s by default), or a request sent on a connection the instance is closing at that moment
#: fails with ReadError; httpx's default expiry is also 5 s. Seen in a P/D benchmark
#: (docs/pd_notes.md): a fork fanned out to P failed that way, P was marked down until its
#: next probe, and the requests routed meanwhile got 502/503.
KEEPALIVE_EXPIRY_S = 2.0


class Router:
    """The router's parts, wired together: one pool (and HTTP client), one index, one registry."""

    def __init__(
        self,
        prefill_urls: list[str],
        decode_urls: list[str],
        *,
        hold_ttl_s: float,
        api_key: str | None = None,
        request_timeout_s: float = 600.0,
        index_max_entries: int | None = None,
        fanout_timeout_s: float = 60.0,
        secret: bytes | None = None,
        index: IndexStore | None = None,
        policy: str = CACHE_AWARE,
        api_keys: Sequence[str] = (),
        tenant_inflight: int = TENANT_INFLIGHT,
        replica_urls: Sequence[str] = (),
    ) -> None:
        #: The cluster's API keys (digests only): the edge refuses a request without one of
        #: them (401) before any route runs; none configured, every request is let through.
        keys = KeyTable(api_keys)
        if index is None:
            index = (
                MemoryIndexStore(hold_ttl_s)
                if index_max_entries is None
                else MemoryIndexStore(hold_ttl_s, index_max_entries)
            )
        self.index = index
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout_s, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(
                max_connections=MAX_CONNECTIONS, keepalive_expiry=KEEPALIVE_EXPIRY_S
            ),
        )
        # Health probes get their own client and connections: a tenant that holds all of the
        # turns' MAX_CONNECTIONS must not make probes time out (instances marked down, 503s).
        probe_client = httpx.AsyncClient(
            timeout=httpx.Timeout(PROBE_TIMEOUT_S, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(
                max_connections=PROBE_MAX_CONNECTIONS, keepalive_expiry=KEEPALIVE_EXPIRY_S
            ),
        )
        self.registry = CollectorRegistry()
        self.pool = Pool(
            prefill_urls,
            decode_urls,
            client=client,
            probe_client=probe_client,
            api_key=api_key,
            on_restart=self._drop_holds_of,
            secret=secret,
            store=index,
            policy=policy,
            registry=self.registry,
            replica_urls=replica_urls,
        )
        self._tasks: set[asyncio.Task[int]] = set()
        self.edge = EdgeState(keys, self.registry, tenant_inflight=tenant_inflight)
        self.turn_flow = TurnFlow(self.pool, self.index, self.registry)
        self.replica_flow = ReplicaFlow(
            self.pool,
            self.index,
            turns=self.turn_flow.turns,
            retries=self.turn_flow.retries,
            index_errors=self.turn_flow.index_errors,
            pins_followed=self.turn_flow.pins_followed,
            resent=self.turn_flow.resent,
        )
        self.admin = Admin(self.pool, self.index, fanout_timeout_s)

    def _drop_holds_of(self, decode_url: str) -> None:
        """A D restarted: its holds are void (readers also compare instance ids, so a backend
        that cannot list them loses nothing)."""
        with suppress(RuntimeError):  # no running loop: nothing to drop from
            task = asyncio.get_running_loop().create_task(
                self.index.drop_instance_holds(decode_url)
            )
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def completion(self, request: Request) -> Response:
        """A completion turn: on one replica when the router serves replicas (membership read
        first: a router that knows its instances only from the index learns them there), else
        through P and D."""
        await self.pool.refresh_members()
        if self.pool.aggregated:
            return await self.replica_flow.completion(request)
        return await self.turn_flow.completion(request)

    @property
    def client(self) -> httpx.AsyncClient:
        """The HTTP client every part talks to the instances with (the probes have their own:
        ``pool.probe_client``). Tests swap it: setting it sets the probes' one too."""
        return self.pool.client

    @client.setter
    def client(self, client: httpx.AsyncClient) -> None:
        self.pool.client = self.pool.probe_client = client

    async def sweep_forever(self) -> None:
        """Drop expired index entries on a timer (started by the app's lifespan)."""
        while True:
            await asyncio.sleep(self.index.sweep_interval_s)
            dropped = await self.index.sweep()
            if dropped:
                logger.debug("index sweep dropped %d expired entries", dropped)


def build_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.pool.probe_all()
        tasks = [
            asyncio.create_task(router.sweep_forever()),
            asyncio.create_task(router.pool.keep_fresh()),
        ]
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with suppress(asyncio.CancelledError):
                    await task
            await router.client.aclose()
            await router.pool.probe_client.aclose()
            await router.index.close()

    app = FastAPI(title="kvbranch router", version=PROTOCOL_VERSION, lifespan=lifespan)
    app.state.router = router
    # Outermost of ours: headers, keys and in-flight bounds before any route reads the body.
    app.add_middleware(Edge, state=router.edge)  # type: ignore[arg-type]
    admin = router.admin

    for path in COMPLETION_PATHS:
        app.add_api_route(path, router.completion, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        return await admin.health()

    @app.get(HEALTH_PATH)
    async def kvbranch_health() -> Response:
        return await admin.health()

    @app.get(STATS_PATH)
    async def stats(request: Request) -> Response:
        return await admin.stats(request)

    # The agent page: its static files (open: they carry no data) and its data (keyed).
    add_page_routes(app)

    @app.get(UI_DATA_PATH)
    async def ui_data(request: Request) -> Response:
        return await admin.ui_data(request)

    @app.api_route(API_PREFIX + "/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def session_route(request: Request, path: str) -> Response:
        return await admin.session_route(request, path)

    @app.get(MODELS_PATH)
    async def models(request: Request) -> Response:
        return await admin.passthrough_get(request, MODELS_PATH)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app
