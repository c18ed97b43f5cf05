"""A completion turn through prefill and decode (chat or completion, streamed or not).

1. **Prefill on P** with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``.
   When the index holds D's params for this (tenant, session, branch), the router first claims
   that hold on D (``HOLD_CLAIM_PATH``: D then keeps the blocks until the claim ends instead of
   releasing them for new work) and sends the claimed params along, so P pulls the conversation
   back from D — P's connector checks the token prefix first and pulls only what matches
   (:mod:`server.connector.pd`), so a re-rendered history costs a recompute, never a wrong
   answer. A hold D no longer has cannot be claimed: that turn recomputes on P.
2. **Decode on D** with P's returned params (D reads the prompt's blocks from P). D's own
   returned params go into the index for the next turn (:mod:`server.router.relay`).

Faults never reach the user as errors: P down → D computes the prompt itself; D down → P
serves the whole turn; a peer restarted or a hold expired → no pull, P recomputes. A leg that
could not even connect goes to another live instance of the same role first (nothing was sent,
so nothing runs twice); a leg that may have run is never re-sent. Every answer's status counts
toward ejecting an instance that keeps failing (:mod:`server.router.pool`). Every response
says which way it went in the ``X-KVBranch-Route`` header.
(Over 400 lines on purpose: one turn's flow — claim, prefill, decode, each fallback and the
stream — is one class whose steps share the turn's state; the pure parts live in relay, edge,
index and pool.)
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CollectorRegistry, Counter, Histogram

from sdk.contract import (
    BRANCH_HEADER,
    BRANCH_XARG,
    CLAIM_FIELD,
    DEFAULT_BRANCH,
    DO_REMOTE_DECODE,
    DO_REMOTE_PREFILL,
    HOLD_CLAIM_PATH,
    REMOTE_BLOCK_IDS,
    RESPONSE_FIELD,
    ROUTE_HEADER,
    SESSION_HEADER,
    TRANSFER_PARAMS_FIELD,
    HoldClaimRequest,
    HoldClaimResult,
)
from server import dialects
from server.checks.ids import xargs_of
from server.index import Hold, IndexUnavailable, Key, SessionStore, TurnStart
from server.router import relay
from server.router.edge import FORWARD_HEADERS, Refused, read_turn, tenant_of, unavailable
from server.router.pool import ROUND_ROBIN, Instance, Pool

logger = logging.getLogger("kvbranch.router")

_T = TypeVar("_T")

CLAIM_TIMEOUT_S = 5.0
#: The route of a resumed turn the D holding its branch serves alone (``Pool.serves_locally``).
LOCAL_ROUTE = "decode-local"
#: The routes where D decodes a prompt P computed (its KV comes over NIXL).
SPLIT_ROUTES = ("pd", "pd+pull")
JSON_HEADERS = {"content-type": "application/json"}


class _Fallback(Exception):
    """This leg failed in a way the other instance can cover. ``sent``: the request may have
    reached the instance; when it surely did not (no connection), another instance of the same
    role can take the same leg."""

    def __init__(self, message: str, *, sent: bool = True) -> None:
        super().__init__(message)
        self.sent = sent


#: Transport errors that mean nothing was sent: the connection was never made.
_NOT_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


def _transport_failure(exc: httpx.HTTPError) -> _Fallback:
    return _Fallback(f"{type(exc).__name__}: {exc}", sent=not isinstance(exc, _NOT_SENT))


def turn_key(payload: dict[str, Any], request: Request) -> Key | None:
    """(tenant, session, branch) of a turn; None without a session (such a turn is routed,
    but nothing is held for it). The session is the one the instance gives the request
    (:func:`server.dialects.session_of`): the one it names (body, ``X-Session-ID``,
    ``vllm_xargs``), else the one its cache hints derive (``prompt_cache_key``, Anthropic
    breakpoints) — so affinity and the D→P pull follow the instance's own session."""
    session = dialects.session_of(payload, request.url.path, request.headers.get(SESSION_HEADER))
    if session is None:
        return None
    xargs = xargs_of(payload, request.url.path)
    branch = xargs.get(BRANCH_XARG) if isinstance(xargs, dict) else None
    branch = branch or request.headers.get(BRANCH_HEADER) or DEFAULT_BRANCH
    return (tenant_of(request), session, str(branch))


def _counter(registry: CollectorRegistry, name: str, doc: str, *labels: str) -> Counter:
    """One of the turn counters: ``kvbranch_router_<name>`` in the router's registry."""
    return Counter(f"kvbranch_router_{name}", doc, list(labels), registry=registry)


class TurnFlow:
    """Routes completion turns: P then D, a fallback to one instance when the other fails."""

    def __init__(self, pool: Pool, index: SessionStore, registry: CollectorRegistry) -> None:
        self.pool = pool
        self.index = index
        #: Filing tasks of streamed answers (kept so they are not garbage-collected mid-way).
        self._filing: set[asyncio.Task[None]] = set()
        #: (tenant, session, instance id) this router already recorded in the index: a
        #: session's placement is written when it changes, not on every turn.
        self._placed: dict[tuple[str, str, str], None] = {}
        counter = functools.partial(_counter, registry)
        self.index_errors = counter(
            "index_errors",
            "Index reads or writes that failed (the turn went on without them)",
            "op",
        )
        self.turns = counter("turns", "Completion turns by route taken", "route")
        self.claims_refused = counter(
            "claims_refused", "Pulls dropped because D no longer held the blocks"
        )
        self.retries = counter(
            "retries",
            "Legs sent to another instance of the role after the first could not be reached",
            "role",
        )
        self.pins_followed = counter(
            "pins_followed", "Pins carried to the replica a moved session's turn went to"
        )
        self.resent = counter(
            "turns_resent",
            "Turns sent to another replica after the first dropped the connection unanswered",
        )
        self.pulled_tokens = counter(
            "pull_offered_tokens", "Tokens D held that P was offered to pull"
        )
        self.prefill_seconds = Histogram(
            "kvbranch_router_prefill_leg_seconds",
            "P's leg of a P/D turn: from the router's request to P's answer (the claim before "
            "it excluded)",
            registry=registry,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128),
        )

    @property
    def client(self) -> httpx.AsyncClient:
        return self.pool.client

    async def completion(self, request: Request) -> Response:
        try:
            payload = await read_turn(request)
        except Refused as refused:
            return refused.response
        turn = _Turn(
            self,
            request.url.path,
            payload,
            {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS},
            turn_key(payload, request),
        )
        return await turn.run()

    async def claim(self, inst: Instance, holding: Hold, headers: dict[str, str]) -> Hold | None:
        """Ask D to claim its held blocks for this pull (D then keeps them until the claim
        ends instead of releasing them for new work); None when D no longer holds them."""
        auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        if self.pool.api_key:
            auth = self.pool.auth_headers()
        content = json.dumps(HoldClaimRequest(handle=holding.params).model_dump()).encode()
        auth.update(JSON_HEADERS)
        auth.update(self.pool.proof("POST", HOLD_CLAIM_PATH, content))
        try:
            r = await self.client.post(
                inst.url + HOLD_CLAIM_PATH,
                content=content,
                headers=auth,
                timeout=CLAIM_TIMEOUT_S,
            )
            claim = r.json().get(CLAIM_FIELD) if r.status_code == 200 else None
            if claim is not None:
                HoldClaimResult.model_validate({CLAIM_FIELD: claim})  # drift fails here
        except (httpx.HTTPError, ValueError, AttributeError):  # ValidationError is a ValueError
            claim = None
        if not isinstance(claim, dict):
            self.claims_refused.inc()
            return None
        # D's claim as D sent it: P checks its seal over these very values.
        holding.params = dict(holding.params, **{CLAIM_FIELD: claim})
        return holding

    async def begin(self, key: Key | None) -> TurnStart:
        """The turn's number, D's hold (taken) and the session's home; with the index
        unreachable, a turn with nothing known (it recomputes; it is never refused)."""
        if key is None or self.pool.policy == ROUND_ROBIN:
            return TurnStart(turn=0, hold=None, home=None)
        try:
            return await self.index.begin_turn(key)
        except IndexUnavailable:
            self.index_errors.labels("begin_turn").inc()
            return TurnStart(turn=0, hold=None, home=None)

    async def choose_decode(
        self, key: Key | None, start: TurnStart
    ) -> tuple[Instance | None, Hold | None]:
        """D for a turn, and the hold to pull from: the turn's hold when the chosen D is the
        one that holds it (same URL, same instance id), else none. One place for the turn and
        for the index simulation (benchmarks/history/index_sim.py), so that both decide alike."""
        holding = start.hold
        decode = await self.pool.choose_decode(
            holding.decode_url if holding else None,
            holding.instance_id if holding else None,
            key,
        )
        pull = (
            holding
            if holding is not None
            and decode is not None
            and holding.decode_url == decode.url
            and holding.instance_id == decode.instance_id
            else None
        )
        return decode, pull

    @staticmethod
    def is_hold(params: Any) -> bool:
        """Params D returned for a hold it made: a remote decode with block ids."""
        return (
            isinstance(params, dict)
            and bool(params.get(DO_REMOTE_DECODE))
            and bool(params.get(REMOTE_BLOCK_IDS))
        )

    async def file_hold(self, key: Key, inst: Instance, turn: int, params: dict[str, Any]) -> None:
        """File D's returned params for the next turn's pull."""
        if self.pool.policy == ROUND_ROBIN:
            return
        try:
            await self.index.put_hold(key, Hold(inst.url, inst.instance_id, params, turn=turn))
        except IndexUnavailable:
            self.index_errors.labels("put_hold").inc()

    def file(self, key: Key | None, inst: Instance, turn: int, params: Any) -> None:
        """File D's params from inside a stream's relay (a callback that cannot wait): as a
        task, done before the client has read the stream's end."""
        if key is None or not self.is_hold(params):
            return
        task = asyncio.get_running_loop().create_task(self.file_hold(key, inst, turn, params))
        self._filing.add(task)
        task.add_done_callback(self._filing.discard)

    def place_soon(self, key: Key | None, start: TurnStart, *instances: Instance) -> None:
        """:meth:`place` as a task: the turn's legs need not wait for the index's write."""
        if key is None or self.pool.policy == ROUND_ROBIN:
            return
        task = asyncio.get_running_loop().create_task(self.place(key, start, *instances))
        self._filing.add(task)
        task.add_done_callback(self._filing.discard)

    async def place(self, key: Key | None, start: TurnStart, *instances: Instance) -> None:
        """Record where the session now lives (its home P, the instances that have it), when
        that changed: session routes go there (:mod:`server.router.admin`)."""
        if key is None or self.pool.policy == ROUND_ROBIN:
            return
        tenant, session = key[0], key[1]
        new = [
            i.instance_id
            for i in instances
            if i.instance_id and (tenant, session, i.instance_id) not in self._placed
        ]
        home = next((i.instance_id for i in instances if i.role == "prefill"), None)
        try:
            if home is not None and home != start.home:
                await self.index.set_home(tenant, session, home)
            if new:
                await self.index.add_session_instances(tenant, session, new)
        except IndexUnavailable:
            self.index_errors.labels("place").inc()
            return
        for iid in new:
            self._placed[(tenant, session, iid)] = None
        while len(self._placed) > 100_000:  # bounded: the oldest are written again if needed
            del self._placed[next(iter(self._placed))]


class _Turn:
    """One turn's state: the request as the client sent it, its key and its number (an
    answer must not replace a newer turn's hold)."""

    def __init__(
        self,
        flow: TurnFlow,
        path: str,
        payload: dict[str, Any],
        headers: dict[str, str],
        key: Key | None,
    ) -> None:
        self.flow = flow
        self.pool = flow.pool
        self.path = path
        self.payload = payload
        self.headers = headers
        self.key = key
        self.turn = 0
        #: The turn's phases in ms, for the ``Server-Timing`` header (W3C Server Timing):
        #: ``route`` (index, choice of P and D, D's claim), ``prefill`` (P's leg: none when one
        #: instance serves the turn alone), ``decode`` (D's leg up to its answer's headers).
        self.timings: dict[str, float] = {}
        self._t0 = time.perf_counter()

    def timed(self, name: str, since: float) -> float:
        """Record the phase ``name`` as lasting from ``since`` to now; returns now."""
        now = time.perf_counter()
        self.timings[name] = (now - since) * 1000
        return now

    async def run(self) -> Response:
        flow, key = self.flow, self.key
        start = await flow.begin(key)
        self.turn = start.turn
        decode, pull = await flow.choose_decode(key, start)
        prefill: Instance | None = None
        if pull is not None and decode is not None:
            prefill = await self.pool.choose_prefill(key, start, pulled=True)
            if self.pool.serves_locally(decode, prefill):
                served = await self.local(decode)
                if served is not None:
                    return served
                decode, pull = None, None  # D failed before answering: P serves the turn
            else:
                pull = await flow.claim(decode, pull, self.headers)
        if pull is None:  # no hold, or D refused the claim: P chosen by what it has cached
            prefill = await self.pool.choose_prefill(key, start, pulled=False)
        if prefill is None and decode is None:
            return unavailable("no prefill or decode instance is reachable")
        if decode is None:
            assert prefill is not None
            return await self.single(prefill, "prefill-only")
        if prefill is None:
            return await self.single(decode, "decode-only", hold=True)
        flow.place_soon(key, start, prefill, decode)
        if pull is not None:
            flow.pulled_tokens.inc(pull.num_tokens)
        leg_started = self.timed("route", self._t0)
        try:
            prefilled = await self.on_any(prefill, lambda inst: self.prefill(inst, pull))
        except _Fallback as exc:
            logger.warning(
                "prefill on %s failed (%s): decode instance computes the prompt", prefill.url, exc
            )
            return await self.single(decode, "decode-only", hold=True)
        if isinstance(prefilled, Response):
            return prefilled  # the client's own error (4xx), as P said it
        p_params, split = prefilled
        self.timed("prefill", leg_started)
        flow.prefill_seconds.observe(self.timings["prefill"] / 1000)
        route = "pd+pull" if pull is not None else "pd"
        try:
            return await self.on_any(decode, lambda inst: self.decode(inst, p_params, split, route))
        except _Fallback as exc:
            logger.warning(
                "decode on %s failed (%s): prefill instance serves the turn", decode.url, exc
            )
            return await self.single(prefill, "prefill-only")

    async def local(self, decode: Instance) -> Response | None:
        """The turn served alone by the D holding its branch (``decode-local``); None when D
        failed before answering (unreachable, or a 5xx): nothing reached the client, and the
        turn goes on through P."""
        self.timed("route", self._t0)
        body, key = self.alone(hold=True)
        try:
            return await self.final(decode, body, key, LOCAL_ROUTE, None)
        except _Fallback as exc:
            logger.warning("the turn on %s alone failed (%s): P serves it", decode.url, exc)
            return None

    async def on_any(self, inst: Instance, leg: Callable[[Instance], Awaitable[_T]]) -> _T:
        """``leg(inst)``; when ``inst`` could not be reached (nothing was sent), the same leg on
        another live instance of its role — the unreachable one is marked down, so each is
        tried at most once."""
        for _ in range(len(self.pool.all)):
            try:
                return await leg(inst)
            except _Fallback as exc:
                if exc.sent:
                    raise
                other = await self.choose_like(inst)
                if other is None:
                    raise
                logger.warning(
                    "%s %s unreachable (%s): trying %s", inst.role, inst.url, exc, other.url
                )
                self.flow.retries.labels(inst.role).inc()
                inst = other
        return await leg(inst)

    async def choose_like(self, inst: Instance) -> Instance | None:
        """Another live instance of ``inst``'s role for this turn."""
        if inst.role == "prefill":
            return await self.pool.choose_prefill(self.key)
        return await self.pool.choose_decode(None, None, self.key)

    def encode(self, body: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
        """The leg's body bytes and headers: the client's own, and the router's proof when the
        leg carries transfer params (an instance accepts them from the router only)."""
        content = json.dumps(body).encode()
        headers = {**self.headers, **JSON_HEADERS}
        if TRANSFER_PARAMS_FIELD in body:
            headers.update(self.pool.proof("POST", self.path, content))
        return content, headers

    async def post(self, inst: Instance, body: dict[str, Any], prompt: bool) -> httpx.Response:
        """``prompt``: the instance computes the request's prompt (``Instance.prefilling``)."""
        content, headers = self.encode(body)
        inst.inflight += 1
        inst.prefilling += prompt
        inst.requests += 1
        try:
            r = await self.flow.client.post(inst.url + self.path, content=content, headers=headers)
        except httpx.HTTPError as exc:
            self.pool.failed(inst, reachable=False)
            raise _transport_failure(exc) from None
        finally:
            inst.inflight -= 1
            inst.prefilling -= prompt
        self.record(inst, r.status_code)
        return r

    def record(self, inst: Instance, status: int) -> None:
        """An answer's status counts for ejection: 5xx is a failure, anything else a success."""
        if status >= 500:
            self.pool.failed(inst)
        else:
            self.pool.succeeded(inst)

    async def prefill(
        self, inst: Instance, pull: Hold | None
    ) -> Response | tuple[dict[str, Any], Any]:
        """P's leg: one token, transfer params out (and D's params in when pulling)."""
        params: dict[str, Any] = {DO_REMOTE_DECODE: True}
        if pull is not None:
            params = dict(pull.params, **{DO_REMOTE_DECODE: True, DO_REMOTE_PREFILL: False})
        body = dict(self.payload, max_tokens=1, stream=False, n=1)
        body.pop("max_completion_tokens", None)
        body.pop("stream_options", None)
        if body.get("min_tokens") is not None:  # an int: read_turn checked it
            # vLLM refuses min_tokens > max_tokens; D keeps the client's (checked against the
            # client's own max_tokens by read_turn, so D will not refuse it after P's prefill)
            body["min_tokens"] = min(body["min_tokens"], 1)
        body[TRANSFER_PARAMS_FIELD] = params
        r = await self.post(inst, body, prompt=True)
        if 400 <= r.status_code < 500:
            return relay.passthrough(r)
        if r.status_code != 200:
            raise _Fallback(f"HTTP {r.status_code}")
        try:
            data = r.json()
        except ValueError:
            raise _Fallback("response is not JSON") from None
        p_params = data.get(TRANSFER_PARAMS_FIELD)
        if not isinstance(p_params, dict) or not p_params.get(DO_REMOTE_PREFILL):
            raise _Fallback("the prefill instance returned no transfer params")
        return p_params, data.get(RESPONSE_FIELD)

    async def decode(
        self, inst: Instance, p_params: dict[str, Any], split: Any, route: str
    ) -> Response:
        body = dict(self.payload)
        body[TRANSFER_PARAMS_FIELD] = {k: v for k, v in p_params.items() if k != RESPONSE_FIELD}
        return await self.final(inst, body, self.key, route, split)

    def alone(self, hold: bool) -> tuple[dict[str, Any], Key | None]:
        """The body of a turn one instance serves whole, and the key its answer's params are
        filed under; ``hold``: it is a D, which keeps the blocks for the next turn's pull."""
        body = dict(self.payload)
        if hold and self.key is not None:
            # An empty request for D's connector: hold the blocks for the next turn's pull.
            body[TRANSFER_PARAMS_FIELD] = {DO_REMOTE_PREFILL: False}
        return body, (self.key if hold else None)

    async def single(self, inst: Instance, route: str, hold: bool = False) -> Response:
        """One instance serves the whole turn because the other role is down or failed
        (:meth:`alone`), tried on another instance of its role when it cannot be reached."""
        body, key = self.alone(hold)
        try:
            return await self.on_any(inst, lambda i: self.final(i, body, key, route, None))
        except _Fallback as exc:
            return unavailable(f"the {inst.role} instance failed mid-turn: {exc}")

    async def final(
        self, inst: Instance, body: dict[str, Any], key: Key | None, route: str, split: Any
    ) -> Response:
        """Send the generating request; file D's returned params; relay the answer."""
        self.flow.turns.labels(route).inc()
        out_headers = {ROUTE_HEADER: route}
        sent = time.perf_counter()
        prompt = route not in SPLIT_ROUTES  # a split turn's D got the prompt's KV from P

        if body.get("stream") is True:

            def file_params(params: Any) -> None:
                self.flow.file(key, inst, self.turn, params)

            return await self.stream(inst, body, file_params, split, out_headers, sent, prompt)
        r = await self.post(inst, body, prompt)
        self.set_timing(out_headers, sent)
        if r.status_code >= 500:
            raise _Fallback(f"HTTP {r.status_code}")
        if r.status_code != 200:
            return relay.passthrough(r, out_headers)
        try:
            data = r.json()
        except ValueError:
            raise _Fallback("response is not JSON") from None
        returned: list[Any] = []
        answer = relay.rewrite_json(data, returned.append, split)
        if key is not None and returned and self.flow.is_hold(returned[0]):
            await self.flow.file_hold(key, inst, self.turn, returned[0])
        return JSONResponse(answer, headers=out_headers)

    def set_timing(self, out_headers: dict[str, str], sent: float) -> None:
        """The ``Server-Timing`` header of a P/D turn (the standard header for a server's own
        timings, in ms): where the router's part of the time-to-first-token went. A turn one
        instance served alone has none."""
        if "prefill" not in self.timings:
            return
        self.timed("decode", sent)
        out_headers["Server-Timing"] = ", ".join(
            f"{name};dur={ms:.1f}" for name, ms in self.timings.items()
        )

    async def stream(
        self,
        inst: Instance,
        body: dict[str, Any],
        file_params: relay.FileParams,
        split: Any,
        out_headers: dict[str, str],
        sent: float,
        prompt: bool,
    ) -> Response:
        body = dict(body)  # a retry on another instance starts from the same body
        want_usage = relay.ask_for_usage(body)
        inst.inflight += 1
        inst.requests += 1
        counted = prompt

        def computed() -> None:
            """The prompt is computed (first bytes) or will not be: count it once."""
            nonlocal counted
            if counted:
                counted = False
                inst.prefilling -= 1

        inst.prefilling += prompt
        client = self.flow.client
        content, headers = self.encode(body)
        try:
            req = client.build_request(
                "POST", inst.url + self.path, content=content, headers=headers
            )
            resp = await client.send(req, stream=True)
        except httpx.HTTPError as exc:
            inst.inflight -= 1
            computed()
            self.pool.failed(inst, reachable=False)
            raise _transport_failure(exc) from None
        except BaseException:  # the client left while the instance had not answered yet
            inst.inflight -= 1
            computed()
            raise
        self.record(inst, resp.status_code)
        self.set_timing(out_headers, sent)
        if resp.status_code != 200:
            await resp.aread()
            await resp.aclose()
            inst.inflight -= 1
            computed()
            if resp.status_code >= 500:
                raise _Fallback(f"HTTP {resp.status_code}")
            return relay.passthrough(resp, out_headers)  # the client's own error, as D said it

        def done() -> None:
            inst.inflight -= 1

        return relay.relay_stream(
            resp, file_params, split, want_usage, done, out_headers, on_first=computed
        )
