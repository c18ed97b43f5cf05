"""The P/D router: OpenAI-compatible to clients, prefill on P and decode on D behind it.

A turn (chat or completion, streamed or not):

1. **Prefill on P** with ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``.
   When the index holds D's params for this (tenant, session, branch), they go along, so P
   pulls the conversation back from D — P's connector checks the token prefix first and pulls
   only what matches (:mod:`server.connector.pd`), so a re-rendered history costs a
   recompute, never a wrong answer.
2. **Decode on D** with P's returned params (D reads the prompt's blocks from P). D's own
   returned params — on a stream they arrive in the usage chunk, put there by the kvbranch
   middleware because vLLM streams do not carry them — go into the index for the next turn.

Faults never reach the user as errors: P down → D computes the prompt itself; D down → P
serves the whole turn; a peer restarted or a hold expired → no pull, P recomputes. Every
response says which way it went in the ``X-KVBranch-Route`` header.

Session routes (``/v1/kvbranch/...``) fan out to every instance (each keeps its own pins and
host store); reads go to a prefill instance; ``stats`` adds the cluster index. A fan-out never
answers with just the first instance's reply: all must agree, or the client gets 502 with each
instance's status, and a retry with the same id converges (an instance that already has the
session counts as created, one that no longer has it as deleted).

Bounded state: request bodies are refused (413) before they are read whole, and the cluster
index is swept on a timer and capped (:mod:`server.router.index`).
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import logging
import time
import zlib
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from typing import Any, AsyncIterator, Literal

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from server.contract import (
    ALREADY_EXISTS,
    API_PREFIX,
    BRANCH_HEADER,
    BRANCH_XARG,
    COMPLETION_PATHS,
    HEALTH_PATH,
    HOLD_CLAIM_PATH,
    MAX_BODY_BYTES,
    PROTOCOL_VERSION,
    RESPONSE_FIELD,
    SESSION_HEADER,
    STATS_PATH,
    TRANSFER_PARAMS_FIELD,
)
from server.connector.sessions import new_id
from server.connector.transfer_auth import CLAIM_FIELD
from server.router.index import ClusterIndex, Key

logger = logging.getLogger("kvbranch.router")

ROUTE_HEADER = "X-KVBranch-Route"
#: When the current turn started: its answer must not replace a newer turn's index entry.
_TURN_STARTED: contextvars.ContextVar[float] = contextvars.ContextVar("kvbranch_turn_started")
FORWARD_HEADERS = ("authorization", SESSION_HEADER.lower(), BRANCH_HEADER.lower())
PROBE_MAX_AGE_S = 1.0


def error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = {400: "BadRequestError", 404: "NotFoundError", 413: "BadRequestError",
            502: "BadGatewayError", 503: "ServiceUnavailableError"}.get(status, "ServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status, headers=headers)


def tenant_of(authorization: str | None) -> str:
    """Scopes the index per API key (the instances scope sessions the same way)."""
    if not authorization:
        return "-"
    return hashlib.sha256(b"kvbranch-router\0" + authorization.encode()).hexdigest()[:24]


@dataclass
class Instance:
    url: str
    role: str
    alive: bool = False
    instance_id: str | None = None
    checked_at: float = 0.0
    inflight: int = 0
    requests: int = 0
    failures: int = 0

    def info(self) -> dict[str, Any]:
        return {"url": self.url, "role": self.role, "alive": self.alive,
                "instance_id": self.instance_id, "inflight": self.inflight,
                "requests": self.requests, "failures": self.failures}


class _Fallback(Exception):
    """This leg failed in a way the other instance can cover."""


class _Refused(Exception):
    """The request is refused before any instance sees it; ``response`` says why."""

    def __init__(self, response: Response) -> None:
        super().__init__(response.status_code)
        self.response = response


async def read_body(request: Request) -> bytes:
    """The request body, bounded *before* it is read: a declared Content-Length over
    ``MAX_BODY_BYTES`` is refused unread, and a chunked (or understated) body as soon as the
    bytes read pass the bound — a client cannot make the router buffer an unbounded body."""
    limit = MAX_BODY_BYTES  # read at call time (tests lower it)
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            size = int(declared)
        except ValueError:
            raise _Refused(error(400, "Content-Length is not a number")) from None
        if size > limit:
            raise _Refused(error(413, f"request body over {limit} bytes"))
    chunks: list[bytes] = []
    total = 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > limit:
            raise _Refused(error(413, f"request body over {limit} bytes"))
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass
class _Answer:
    """One instance's reply to a fanned-out session route (``status`` None: no reply)."""

    inst: Instance
    status: int | None
    content: bytes = b""
    content_type: str | None = None
    error: str | None = None

    def message(self) -> str:
        if self.error is not None:
            return self.error
        try:
            return str(json.loads(self.content)["error"]["message"])[:200]
        except (ValueError, KeyError, TypeError):
            return self.content[:200].decode(errors="replace")


FanKind = Literal["create", "delete", "other"]


def _fan_kind(method: str, path: str) -> FanKind:
    parts = path.split("/")
    if method == "POST" and (path == "sessions" or (len(parts) == 3 and parts[2] == "branches")):
        return "create"
    if method == "DELETE" and len(parts) in (2, 4) and parts[0] == "sessions":
        return "delete"
    return "other"


def _already_done(kind: FanKind, answer: _Answer) -> bool:
    """A retry's answer meaning "this instance already did it": the create found the id
    there, the delete found it gone — so a retry after a partial failure converges."""
    if kind == "create":
        return answer.status == 409 and ALREADY_EXISTS in answer.message()
    if kind == "delete":
        return answer.status == 404
    return False


class Router:
    def __init__(self, prefill_urls: list[str], decode_urls: list[str], *,
                 hold_ttl_s: float, api_key: str | None = None,
                 request_timeout_s: float = 600.0, index_max_entries: int | None = None,
                 fanout_timeout_s: float = 60.0) -> None:
        if not prefill_urls or not decode_urls:
            raise ValueError("a router needs at least one prefill and one decode instance")
        self.prefills = [Instance(u.rstrip("/"), "prefill") for u in prefill_urls]
        self.decodes = [Instance(u.rstrip("/"), "decode") for u in decode_urls]
        self.index = (ClusterIndex(hold_ttl_s) if index_max_entries is None
                      else ClusterIndex(hold_ttl_s, index_max_entries))
        self.fanout_timeout_s = fanout_timeout_s
        self.api_key = api_key
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(request_timeout_s, connect=5.0),
                                        limits=httpx.Limits(max_connections=512))
        self.registry = CollectorRegistry()
        self.turns = Counter("kvbranch_router_turns", "Completion turns by route taken",
                             ["route"], registry=self.registry)
        self.claims_refused = Counter("kvbranch_router_claims_refused",
                                      "Pulls dropped because D no longer held the blocks",
                                      registry=self.registry)
        self.pulled_tokens = Counter("kvbranch_router_pull_offered_tokens",
                                     "Tokens D held that P was offered to pull",
                                     registry=self.registry)

    # --- instances -------------------------------------------------------------------------
    async def probe(self, inst: Instance, max_age: float = PROBE_MAX_AGE_S) -> bool:
        now = time.monotonic()
        if now - inst.checked_at < max_age:
            return inst.alive
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            r = await self.client.get(inst.url + HEALTH_PATH, headers=headers, timeout=3.0)
            alive = r.status_code == 200
            reported = r.json().get("instance_id") if alive else inst.instance_id
        except (httpx.HTTPError, ValueError):
            alive, reported = False, inst.instance_id
        if alive and inst.instance_id and reported != inst.instance_id:
            dropped = self.index.drop_instance(inst.url)  # a restart lost D's blocks
            logger.warning("%s %s restarted; dropped %d index entries", inst.role, inst.url,
                           dropped)
        if alive != inst.alive:
            logger.warning("%s %s is %s", inst.role, inst.url, "up" if alive else "DOWN")
        inst.alive, inst.instance_id, inst.checked_at = alive, reported, time.monotonic()
        return alive

    def mark_down(self, inst: Instance) -> None:
        inst.alive, inst.checked_at = False, time.monotonic()
        inst.failures += 1

    async def probe_all(self) -> None:
        await asyncio.gather(*(self.probe(i, 0.0) for i in self.prefills + self.decodes))

    async def _live(self, pool: list[Instance]) -> list[Instance]:
        alive = await asyncio.gather(*(self.probe(i) for i in pool))
        return [i for i, ok in zip(pool, alive) if ok]

    async def choose_prefill(self, key: Key | None) -> Instance | None:
        """Session affinity: a session's turns (and forks) go to the same P, where its local
        prefix cache and host store are."""
        live = await self._live(self.prefills)
        if not live:
            return None
        if key is None:
            return min(live, key=lambda i: i.inflight)
        return live[zlib.crc32(f"{key[0]}/{key[1]}".encode()) % len(live)]

    async def choose_decode(self, held_on: str | None) -> Instance | None:
        live = await self._live(self.decodes)
        if not live:
            return None
        for inst in live:
            if inst.url == held_on:
                return inst  # the D that holds this branch's KV
        return min(live, key=lambda i: i.inflight)

    # --- a completion turn -----------------------------------------------------------------
    async def sweep_forever(self) -> None:
        """Drop expired index entries on a timer (started by the app's lifespan)."""
        while True:
            await asyncio.sleep(self.index.sweep_interval_s)
            dropped = self.index.sweep()
            if dropped:
                logger.debug("index sweep dropped %d expired entries", dropped)

    async def completion(self, request: Request) -> Response:
        try:
            raw = await read_body(request)
        except _Refused as refused:
            return refused.response
        try:
            payload = json.loads(raw)
        except ValueError:
            return error(400, "request body is not valid JSON")
        if not isinstance(payload, dict):
            return error(400, "request body must be a JSON object")
        if TRANSFER_PARAMS_FIELD in payload:
            return error(400, "kv_transfer_params is set by the router; remove it")
        headers = {k: v for k, v in request.headers.items() if k.lower() in FORWARD_HEADERS}
        key = self._key(payload, request)
        path = request.url.path
        _TURN_STARTED.set(time.monotonic())
        holding = self.index.take(key) if key else None
        prefill = await self.choose_prefill(key)
        decode = await self.choose_decode(holding.decode_url if holding else None)
        if prefill is None and decode is None:
            return error(503, "no prefill or decode instance is reachable",
                         headers={"Retry-After": "5"})
        if decode is None:
            return await self._single(prefill, path, payload, headers, "prefill-only")
        if prefill is None:
            return await self._single(decode, path, payload, headers, "decode-only", key=key,
                                      hold=True)
        pull = (holding if holding is not None and holding.decode_url == decode.url
                and holding.instance_id == decode.instance_id else None)
        if pull is not None:
            pull = await self._claim(decode, pull, headers)
        try:
            prefilled = await self._prefill(prefill, path, payload, headers, pull)
        except _Fallback as exc:
            logger.warning("prefill on %s failed (%s): decode instance computes the prompt",
                           prefill.url, exc)
            return await self._single(decode, path, payload, headers, "decode-only", key=key,
                                      hold=True)
        if isinstance(prefilled, Response):
            return prefilled  # the client's own error (4xx), as P said it
        p_params, split = prefilled
        route = "pd+pull" if pull is not None else "pd"
        try:
            return await self._decode(decode, path, payload, headers, p_params, split, key,
                                      route)
        except _Fallback as exc:
            logger.warning("decode on %s failed (%s): prefill instance serves the turn",
                           decode.url, exc)
            return await self._single(prefill, path, payload, headers, "prefill-only")

    def _key(self, payload: dict, request: Request) -> Key | None:
        session = payload.get("session_id") or request.headers.get(SESSION_HEADER)
        if not isinstance(session, str) or not session:
            return None
        xargs = payload.get("vllm_xargs")
        branch = xargs.get(BRANCH_XARG) if isinstance(xargs, dict) else None
        branch = branch or request.headers.get(BRANCH_HEADER) or "main"
        return (tenant_of(request.headers.get("authorization")), session, str(branch))

    async def _post(self, inst: Instance, path: str, body: dict,
                    headers: dict[str, str]) -> httpx.Response:
        inst.inflight += 1
        inst.requests += 1
        try:
            return await self.client.post(inst.url + path, json=body, headers=headers)
        except httpx.HTTPError as exc:
            self.mark_down(inst)
            raise _Fallback(f"{type(exc).__name__}: {exc}") from None
        finally:
            inst.inflight -= 1

    async def _claim(self, inst: Instance, holding: Any,
                     headers: dict[str, str]) -> Any:
        """Ask D to claim its held blocks for this pull (D then keeps them until the claim
        ends instead of releasing them for new work); None when D no longer holds them."""
        auth = {k: v for k, v in headers.items() if k.lower() == "authorization"}
        if self.api_key:
            auth = {"authorization": f"Bearer {self.api_key}"}
        try:
            r = await self.client.post(inst.url + HOLD_CLAIM_PATH, json={"handle": holding.params},
                                       headers=auth, timeout=5.0)
            claim = r.json().get(CLAIM_FIELD) if r.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            claim = None
        if not isinstance(claim, dict):
            self.claims_refused.inc()
            return None
        holding.params = dict(holding.params, **{CLAIM_FIELD: claim})
        return holding

    async def _prefill(self, inst: Instance, path: str, payload: dict,
                       headers: dict[str, str], pull: Any) -> Response | tuple[dict, Any]:
        params: dict[str, Any] = {"do_remote_decode": True}
        if pull is not None:
            params = dict(pull.params, do_remote_decode=True, do_remote_prefill=False)
            self.pulled_tokens.inc(pull.num_tokens)
        body = dict(payload, max_tokens=1, stream=False, n=1)
        body.pop("max_completion_tokens", None)
        body.pop("stream_options", None)
        body[TRANSFER_PARAMS_FIELD] = params
        r = await self._post(inst, path, body, headers)
        if 400 <= r.status_code < 500:
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        if r.status_code != 200:
            raise _Fallback(f"HTTP {r.status_code}")
        try:
            data = r.json()
        except ValueError:
            raise _Fallback("response is not JSON") from None
        p_params = data.get(TRANSFER_PARAMS_FIELD)
        if not isinstance(p_params, dict) or not p_params.get("do_remote_prefill"):
            raise _Fallback("the prefill instance returned no transfer params")
        return p_params, data.get(RESPONSE_FIELD)

    async def _decode(self, inst: Instance, path: str, payload: dict, headers: dict[str, str],
                      p_params: dict, split: Any, key: Key | None, route: str) -> Response:
        body = dict(payload)
        body[TRANSFER_PARAMS_FIELD] = {k: v for k, v in p_params.items() if k != RESPONSE_FIELD}
        return await self._run_final(inst, path, body, headers, key, route, split)

    async def _single(self, inst: Instance, path: str, payload: dict, headers: dict[str, str],
                      route: str, key: Key | None = None, hold: bool = False) -> Response:
        """One instance serves the whole turn (the other one is down)."""
        body = dict(payload)
        if hold and key is not None:
            # An empty request for D's connector: hold the blocks for the next turn's pull.
            body[TRANSFER_PARAMS_FIELD] = {"do_remote_prefill": False}
        try:
            return await self._run_final(inst, path, body, headers, key if hold else None,
                                         route, None)
        except _Fallback as exc:
            return error(503, f"the {inst.role} instance failed mid-turn: {exc}",
                         headers={"Retry-After": "5"})

    async def _run_final(self, inst: Instance, path: str, body: dict, headers: dict[str, str],
                         key: Key | None, route: str, split: Any) -> Response:
        """Send the generating request; file D's returned params; relay the answer."""
        self.turns.labels(route).inc()
        out_headers = {ROUTE_HEADER: route}
        if body.get("stream") is True:
            return await self._stream(inst, path, body, headers, key, split, out_headers)
        r = await self._post(inst, path, body, headers)
        if r.status_code >= 500:
            raise _Fallback(f"HTTP {r.status_code}")
        if r.status_code != 200:
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"), headers=out_headers)
        try:
            data = r.json()
        except ValueError:
            raise _Fallback("response is not JSON") from None
        self._file(key, inst, data.pop(TRANSFER_PARAMS_FIELD, None))
        if split is not None:
            data[RESPONSE_FIELD] = split
        return JSONResponse(data, headers=out_headers)

    async def _stream(self, inst: Instance, path: str, body: dict, headers: dict[str, str],
                      key: Key | None, split: Any, out_headers: dict[str, str]) -> Response:
        options = body.get("stream_options")
        want_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        body["stream_options"] = dict(options if isinstance(options, dict) else {},
                                      include_usage=True)
        inst.inflight += 1
        inst.requests += 1
        try:
            req = self.client.build_request("POST", inst.url + path, json=body, headers=headers)
            resp = await self.client.send(req, stream=True)
        except httpx.HTTPError as exc:
            inst.inflight -= 1
            self.mark_down(inst)
            raise _Fallback(f"{type(exc).__name__}: {exc}") from None
        if resp.status_code != 200:
            content = await resp.aread()
            await resp.aclose()
            inst.inflight -= 1
            if resp.status_code >= 500:
                raise _Fallback(f"HTTP {resp.status_code}")
            return Response(content, status_code=resp.status_code,
                            media_type=resp.headers.get("content-type"), headers=out_headers)

        async def relay() -> AsyncIterator[bytes]:
            buffer = b""
            try:
                async for data in resp.aiter_raw():
                    buffer += data
                    out = []
                    while b"\n\n" in buffer:
                        event, buffer = buffer.split(b"\n\n", 1)
                        event = self._rewrite_event(event, key, inst, split, want_usage)
                        if event is not None:
                            out.append(event + b"\n\n")
                    if out:
                        yield b"".join(out)
                if buffer:
                    yield buffer
            finally:
                inst.inflight -= 1
                await resp.aclose()  # a client that left: D sees the disconnect and aborts

        return StreamingResponse(relay(), media_type="text/event-stream", headers=out_headers)

    def _rewrite_event(self, event: bytes, key: Key | None, inst: Instance, split: Any,
                       want_usage: bool) -> bytes | None:
        if not event.startswith(b"data: {") or (b'"usage"' not in event
                                               and TRANSFER_PARAMS_FIELD.encode() not in event):
            return event
        try:
            chunk = json.loads(event[len(b"data: "):])
        except ValueError:
            return event
        if not isinstance(chunk, dict):
            return event
        self._file(key, inst, chunk.pop(TRANSFER_PARAMS_FIELD, None))
        if chunk.get("usage") and not chunk.get("choices") and not want_usage:
            return None  # the client did not ask for the usage chunk; we did
        if split is not None and RESPONSE_FIELD in chunk:
            chunk[RESPONSE_FIELD] = split
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode()

    def _file(self, key: Key | None, inst: Instance, params: Any) -> None:
        if (key is not None and isinstance(params, dict) and params.get("do_remote_decode")
                and params.get("remote_block_ids")):
            self.index.put(key, inst.url, inst.instance_id, params,
                           started=_TURN_STARTED.get(None))

    # --- session routes, stats, models -----------------------------------------------------
    async def forward(self, request: Request, inst: Instance, path: str,
                      body: bytes | None, timeout: float | None = None) -> httpx.Response:
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type")}
        extra: dict[str, Any] = {} if timeout is None else {"timeout": timeout}
        return await self.client.request(request.method, inst.url + path, content=body,
                                         headers=headers, params=request.query_params, **extra)

    async def _fan_one(self, request: Request, inst: Instance, path: str,
                       body: bytes | None) -> _Answer:
        try:
            r = await self.forward(request, inst, path, body, timeout=self.fanout_timeout_s)
        except httpx.HTTPError as exc:
            self.mark_down(inst)
            return _Answer(inst, None, error=f"{type(exc).__name__}: {exc}"[:200])
        return _Answer(inst, r.status_code, r.content, r.headers.get("content-type"))

    def _merge(self, kind: FanKind, answers: list[_Answer], body: bytes | None) -> Response:
        """One reply for a fan-out: the instances' common answer when they agree (an
        "already done" counts as done), else 502 naming each instance and its status."""
        ok = [a for a in answers if a.status is not None and 200 <= a.status < 300]
        failed = [a for a in answers
                  if not any(a is o for o in ok) and not _already_done(kind, a)]
        if not failed or (not ok and len({a.status for a in answers}) == 1
                          and answers[0].status is not None and answers[0].status < 500):
            # all done, or all refused alike (the client's own error, e.g. 404 or 400)
            best = ok[0] if ok else answers[0]
            return Response(best.content, status_code=best.status or 502,
                            media_type=best.content_type)
        names = "; ".join(f"{a.inst.role} {a.inst.url} "
                          f"{'unreachable' if a.status is None else f'answered {a.status}'}: "
                          f"{a.message()}" for a in failed)
        data: dict[str, Any] = {
            "error": {"message": f"{len(failed)} of {len(answers)} instances failed ({names}); "
                                 "the others applied it — retry the same request (same id) "
                                 "to converge",
                      "type": "BadGatewayError", "code": 502},
            "instances": [{"url": a.inst.url, "role": a.inst.role, "status": a.status,
                           "ok": not any(a is f for f in failed),
                           **({} if not any(a is f for f in failed)
                              else {"error": a.message()})}
                          for a in answers],
        }
        try:
            sent = json.loads(body) if body else None
        except ValueError:
            sent = None
        if isinstance(sent, dict):  # the id the router chose, so the retry can name it
            data.update({k: sent[k] for k in ("session_id", "branch_id") if sent.get(k)})
        return JSONResponse(data, status_code=502)

    async def session_route(self, request: Request, path: str) -> Response:
        try:
            body = await read_body(request)
        except _Refused as refused:
            return refused.response
        prefills = await self._live(self.prefills)
        if not prefills:
            return error(503, "no prefill instance is reachable", headers={"Retry-After": "5"})
        tenant = tenant_of(request.headers.get("authorization"))
        full = f"{API_PREFIX}/{path}"
        if request.method == "POST" and (path == "sessions" or path.endswith("/branches")):
            # Every instance must create the same id: choose it here when the client did not.
            body = _with_id(body, "session_id" if path == "sessions" else "branch_id",
                            "sess" if path == "sessions" else "br")
        if path.endswith("/prefetch") or request.method == "GET":
            if path.endswith("/prefetch"):  # warms the session's own prefill instance
                parts = path.split("/")
                chosen = await self.choose_prefill((tenant, parts[1], parts[3])
                                                   if len(parts) > 3 else None)
                targets = [chosen or prefills[0]]
            else:  # a read: every instance has the session; the first that answers
                targets = prefills
            return await self._first_answer(request, targets, full, body or None,
                                            "no prefill instance answered")
        # A change: every instance, the ones seen down included — the answer must say which
        # instance missed it, and a retry must reach it.
        targets = self.prefills + self.decodes
        answers = await asyncio.gather(*(self._fan_one(request, t, full, body or None)
                                         for t in targets))
        kind = _fan_kind(request.method, path)
        if (kind == "delete" and path.count("/") == 1
                and any(a.status == 200 or _already_done(kind, a) for a in answers)):
            self.index.drop_session(tenant, path.split("/")[1])
        return self._merge(kind, answers, body)

    async def stats(self, request: Request) -> Response:
        prefills = await self._live(self.prefills)
        if not prefills:
            return error(503, "no prefill instance is reachable", headers={"Retry-After": "5"})
        r = await self.forward(request, prefills[0], STATS_PATH, None)
        if r.status_code != 200:
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        data = r.json()
        tenant = tenant_of(request.headers.get("authorization"))
        data["cluster"] = {
            "instances": [i.info() for i in self.prefills + self.decodes],
            "index": self.index.snapshot(tenant),
            "index_counters": self.index.counters(),
            "hold_ttl_s": self.index.ttl_s,
        }
        return JSONResponse(data)

    async def health(self) -> Response:
        """A prefill instance's health (the sdk reads it) plus the router's view of all."""
        await self.probe_all()
        ok = any(i.alive for i in self.prefills) and any(i.alive for i in self.decodes)
        body: dict[str, Any] = {}
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        for inst in self.prefills:
            if inst.alive:
                try:
                    r = await self.client.get(inst.url + HEALTH_PATH, headers=headers,
                                              timeout=5.0)
                    body = r.json() if r.status_code == 200 else {}
                except (httpx.HTTPError, ValueError):
                    body = {}
                break
        body.update(status="ok" if ok else "degraded", role="router",
                    protocol_version=PROTOCOL_VERSION,
                    instances=[i.info() for i in self.prefills + self.decodes])
        serving = any(i.alive for i in self.prefills + self.decodes)  # fallbacks still serve
        return JSONResponse(body, status_code=200 if serving else 503)

    async def passthrough_get(self, request: Request, path: str) -> Response:
        return await self._first_answer(
            request, await self._live(self.prefills) + await self._live(self.decodes), path,
            None, "no instance is reachable")

    async def _first_answer(self, request: Request, targets: list[Instance], path: str,
                            body: bytes | None, none_message: str) -> Response:
        """The first of ``targets`` that answers, as it answered; an instance that cannot be
        reached is marked down and the next one tried; 503 when none answers."""
        for inst in targets:
            try:
                r = await self.forward(request, inst, path, body)
            except httpx.HTTPError:
                self.mark_down(inst)
                continue
            return Response(r.content, status_code=r.status_code,
                            media_type=r.headers.get("content-type"))
        return error(503, none_message, headers={"Retry-After": "5"})


def _with_id(body: bytes, field: str, prefix: str) -> bytes:
    try:
        data = json.loads(body) if body else {}
    except ValueError:
        return body  # the instances answer with their own 400
    if isinstance(data, dict) and not data.get(field):
        data[field] = new_id(prefix)
        return json.dumps(data).encode()
    return body


def build_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.probe_all()
        sweeper = asyncio.create_task(router.sweep_forever())
        try:
            yield
        finally:
            sweeper.cancel()
            with suppress(asyncio.CancelledError):
                await sweeper
            await router.client.aclose()

    app = FastAPI(title="kvbranch router", version=PROTOCOL_VERSION, lifespan=lifespan)
    app.state.router = router

    for path in COMPLETION_PATHS:
        app.add_api_route(path, router.completion, methods=["POST"])

    @app.get("/health")
    async def health() -> Response:
        return await router.health()

    @app.get(HEALTH_PATH)
    async def kvbranch_health() -> Response:
        return await router.health()

    @app.get(STATS_PATH)
    async def stats(request: Request) -> Response:
        return await router.stats(request)

    @app.api_route(API_PREFIX + "/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def session_route(request: Request, path: str) -> Response:
        return await router.session_route(request, path)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        return await router.passthrough_get(request, "/v1/models")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app
