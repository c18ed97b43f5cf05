"""A completion turn on aggregated replicas: one replica serves it, the router only chooses.

Each replica (``--role single --index URL``) prefills and decodes, files its branch's hold in
the index after every turn, and takes that hold itself when a turn arrives, pulling the history
from the peer that holds it (docs/cluster.md). So the router in front of replicas takes nothing:
it reads the hold (:meth:`~server.index.SessionStore.peek_hold`, which leaves it for the replica)
and the session's home (:meth:`~server.index.SessionStore.peek_home`), chooses the replica
(:mod:`server.router.replicas`), and relays the request as the client sent it — the edge's checks
and forwarded headers as for P/D (:mod:`server.router.edge`), no claim, no turn begun, no
transfer params (a client's, in the field or the extension args, are refused with 400 by the
edge, as for P/D). Transfer params in an answer are the cluster's, never the client's: they are
taken out as the P/D relay does.

What the router does write is where the session went: its home (when it changed) and the
replicas that have it, so its next turn finds it while the hold is taken or gone, and session
routes reach every replica that has its branches and pins (:mod:`server.router.admin`).

Faults: a replica that cannot be connected to (nothing was sent) is marked down and the turn
goes to the next choice. One that drops the connection before any answer (killed mid-turn: the
client has seen nothing) is marked down too and the turn is sent once more, to another replica:
losing KV costs a recompute there, losing the request would cost the client its turn. Only
once: a request that kills every replica it reaches must not take the cluster down. A stream
counts as unanswered until its first chunk (vLLM sends its headers at once, its first token
after the prefill): the router reads that chunk before it answers the client. A replica that
answers 5xx (alive: the turn may be what fails) is not sent again: 503; a stream that breaks
after its first chunk ends with an error event (:func:`server.router.relay.cut_short_event`).
Every answer's status counts toward ejection (:mod:`server.router.pool`).
``X-KVBranch-Route`` says ``replica`` when the turn went where the session's KV is (the holder,
else its home, or a new session's first replica) and ``replica-moved`` when it went elsewhere.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter

from sdk.contract import ROUTE_HEADER
from server.common.pin_follow import follow_pin
from server.index import IndexUnavailable, Key, SessionStore
from server.router import relay
from server.router.edge import FORWARD_HEADERS, Refused, read_turn, unavailable
from server.router.pool import ROUND_ROBIN, Instance, Pool
from server.router.turn import turn_key

logger = logging.getLogger("kvbranch.router")

#: Routes of a turn a replica served (``X-KVBranch-Route``).
STAYED, MOVED = "replica", "replica-moved"
#: Most (tenant, session, instance) placements this router remembers having written.
MAX_PLACED = 100_000


class _NotSent(Exception):
    """The replica could not be connected to: nothing was sent, another may take the turn."""


class _Dropped(Exception):
    """The replica took the request and dropped the connection before any answer: the client
    has seen nothing, another replica may take the turn once."""


#: Transport errors of a connection lost before the answer began (not a timeout: a slow
#: replica is alive, and sending its turn again would double the load that slowed it).
DROPPED = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


def _ignore(_: Any) -> None:
    """A replica's answer carries no params for the router to file: it files its own hold."""


async def first_chunk(resp: httpx.Response) -> AsyncIterator[bytes]:
    """A stream's body with its first chunk read before the client is answered: vLLM sends a
    stream's headers at once and its first token after the prefill, so a replica killed while
    queueing or prefilling drops a stream whose client has seen nothing yet (raised here, and
    the turn is sent once more like an unanswered one)."""
    chunks = resp.aiter_raw()
    head = await anext(chunks, b"")
    return relay.put_back(head, chunks)


class ReplicaFlow:
    """Routes completion turns to aggregated replicas. Counters are the P/D turn's own (one
    registry, one set of names): ``turns`` by route, ``retries`` by role, ``index_errors``,
    ``pins_followed``, ``resent``."""

    def __init__(
        self,
        pool: Pool,
        index: SessionStore,
        *,
        turns: Counter,
        retries: Counter,
        index_errors: Counter,
        pins_followed: Counter,
        resent: Counter,
    ) -> None:
        self.pool = pool
        self.index = index
        self.turns = turns
        self.retries = retries
        self.index_errors = index_errors
        self.pins_followed = pins_followed
        self.resent = resent
        #: (tenant, session, instance id) this router already recorded as having the session.
        self._placed: dict[tuple[str, str, str], None] = {}
        self._writes: set[asyncio.Task[None]] = set()

    async def completion(self, request: Request) -> Response:
        try:
            payload = await read_turn(request)
        except Refused as refused:
            return refused.response
        key = turn_key(payload, request)
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}
        holder, home = await self.where(key)
        content = json.dumps(payload).encode()
        stream = payload.get("stream") is True
        tried: set[str] = set()
        dropped = False
        while True:  # each pass leaves one more replica out: it ends
            chosen = await self.pool.choose_replica(key, holder=holder, home=home, skip=tried)
            if chosen is None:
                return unavailable("no replica is reachable")
            inst = chosen.replica
            route = MOVED if chosen.moved else STAYED
            moved_from = (holder or home) if chosen.moved else None
            answered = self.pin_follower(key, moved_from, inst, headers)
            try:
                answer = await self.send(
                    inst, request.url.path, content, headers, stream, route, answered
                )
            except _NotSent as exc:
                tried.add(inst.url)
                self.retries.labels(inst.role).inc()
                logger.warning("replica %s unreachable (%s): choosing another", inst.url, exc)
                continue
            except _Dropped as exc:
                if dropped:
                    return unavailable(f"the replica failed mid-turn: {exc}")
                dropped = True
                tried.add(inst.url)
                self.resent.inc()
                logger.warning("replica %s dropped a turn (%s): sent once more", inst.url, exc)
                continue
            self.place_soon(key, home, inst)
            return answer

    async def where(self, key: Key | None) -> tuple[str | None, str | None]:
        """The instance ids of the branch's holder and of the session's home, read without
        taking anything; (None, None) without a session or with the index unreachable."""
        if key is None or self.pool.policy == ROUND_ROBIN:
            return None, None
        try:
            hold, home = await asyncio.gather(
                self.index.peek_hold(key), self.index.peek_home(key[0], key[1])
            )
        except IndexUnavailable:
            self.index_errors.labels("peek").inc()
            return None, None
        return (hold.instance_id if hold is not None else None), home

    async def send(
        self,
        inst: Instance,
        path: str,
        content: bytes,
        headers: dict[str, str],
        stream: bool,
        route: str,
        answered: Callable[[], None] | None = None,
    ) -> Response:
        """The turn on ``inst``, its answer relayed; :class:`_NotSent` when no connection
        was made, :class:`_Dropped` when it was lost before the answer began. ``answered`` runs
        once a 200 answer is complete (the replica has the turn)."""
        client = self.pool.client
        out_headers = {ROUTE_HEADER: route}
        inst.inflight += 1
        inst.requests += 1
        resp: httpx.Response | None = None
        chunks: AsyncIterator[bytes] | None = None
        try:
            req = client.build_request(
                "POST",
                inst.url + path,
                content=content,
                headers={**headers, "content-type": "application/json"},
            )
            resp = await client.send(req, stream=stream)
            if stream and resp.status_code == 200:
                chunks = await first_chunk(resp)
        except BaseException as exc:  # before anything reached the client
            inst.inflight -= 1
            if resp is not None:
                await resp.aclose()
            if not isinstance(exc, httpx.HTTPError):
                raise  # the client left while the replica had not answered yet
            self.pool.failed(inst, reachable=False)
            if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
                raise _NotSent(f"{type(exc).__name__}: {exc}") from None
            if isinstance(exc, DROPPED):
                raise _Dropped(type(exc).__name__) from None
            return unavailable(f"the replica failed mid-turn: {type(exc).__name__}")
        if resp.status_code >= 500:
            self.pool.failed(inst)
        else:
            self.pool.succeeded(inst)
        self.turns.labels(route).inc()
        if not stream or resp.status_code != 200:
            if stream:
                await resp.aread()
                await resp.aclose()
            inst.inflight -= 1
            if resp.status_code == 200 and answered is not None:
                answered()
            return self.answer(resp, out_headers)

        def done() -> None:
            inst.inflight -= 1
            if answered is not None:
                answered()

        # want_usage: the client gets every chunk the replica sent (the router asked for none)
        return relay.relay_stream(resp, _ignore, None, True, done, out_headers, chunks=chunks)

    @staticmethod
    def answer(resp: httpx.Response, out_headers: dict[str, str]) -> Response:
        """A whole answer: 5xx as 503 (the turn may have run: it is not sent again), the
        client's own error as the replica said it, a completion without transfer params."""
        if resp.status_code >= 500:
            return unavailable(f"the replica failed mid-turn: HTTP {resp.status_code}")
        if resp.status_code != 200:
            return relay.passthrough(resp, out_headers)
        try:
            data = resp.json()
        except ValueError:
            return relay.passthrough(resp, out_headers)
        if not isinstance(data, dict):
            return relay.passthrough(resp, out_headers)
        return JSONResponse(relay.rewrite_json(data, _ignore, None), headers=out_headers)

    def pin_follower(
        self, key: Key | None, left: str | None, now_on: Instance, headers: dict[str, str]
    ) -> Callable[[], None] | None:
        """For a turn that moved: what carries the branch's pin from the replica it left to
        ``now_on`` once the turn is answered (:mod:`server.common.pin_follow`); None without a
        session or a replica it left."""
        was_on = self.pool.by_instance_id(left)
        if key is None or was_on is None or was_on is now_on:
            return None
        authorization = headers.get("authorization")

        def follow() -> None:
            self._background(self._follow_pin(key, was_on, now_on, authorization))

        return follow

    async def _follow_pin(
        self, key: Key, was_on: Instance, now_on: Instance, authorization: str | None
    ) -> None:
        if await follow_pin(self.pool.client, key, was_on.url, now_on.url, authorization):
            self.pins_followed.inc()

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._writes.add(task)
        task.add_done_callback(self._writes.discard)

    def place_soon(self, key: Key | None, home: str | None, inst: Instance) -> None:
        """:meth:`place` as a task: the turn need not wait for the index's write."""
        if key is None or inst.instance_id is None or self.pool.policy == ROUND_ROBIN:
            return
        if inst.instance_id == home and (key[0], key[1], inst.instance_id) in self._placed:
            return
        self._background(self.place(key, home, inst.instance_id))

    async def place(self, key: Key, home: str | None, iid: str) -> None:
        """Record that the session now lives on ``iid``: its home when it changed, and among
        the replicas that have the session."""
        tenant, session = key[0], key[1]
        try:
            if iid != home:
                await self.index.set_home(tenant, session, iid)
            if (tenant, session, iid) not in self._placed:
                await self.index.add_session_instances(tenant, session, [iid])
        except IndexUnavailable:
            self.index_errors.labels("place").inc()
            return
        self._placed[(tenant, session, iid)] = None
        while len(self._placed) > MAX_PLACED:  # bounded: the oldest are written again if needed
            del self._placed[next(iter(self._placed))]
