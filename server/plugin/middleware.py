"""ASGI middleware around vLLM's completion routes.

On the way in, on every generating route (:data:`sdk.contract.GENERATE_PATHS`), it drops
kvbranch's internal fields from the client's extension args (:data:`INTERNAL_XARGS`: only the
server sets them), stamps a server-made tag (to find the request's accounting afterwards),
copies the ``X-KVBranch-Branch`` header into the extension args, sends a session's turn to the
engine that holds the session when the server runs several data-parallel engines
(:mod:`server.plugin.engines`), and, when the server has API
keys, stamps the caller's tenant (``owner``) and salts the prefix cache per tenant (vLLM's
``cache_salt``: the tenant's id combined with the client's own salt, if any). Function tools
the client did not mark ``strict`` are marked ``strict: true``, so vLLM constrains every tool
call's arguments by the tool's JSON schema for every client (:mod:`server.plugin.tool_schema`
says why, and why not vLLM's ``--tool-strict-level``). The extension
args are ``vllm_xargs`` on the OpenAI/Anthropic routes and ``sampling_params.extra_args`` on
``/inference/v1/generate``; ``/v1/systemone`` and ``/generative_scoring`` take none from
clients, so only their salt is set.

On the way out it adds the top-level ``kvbranch`` object (:class:`PromptSourceSplit`) to the
JSON body, or to the usage chunk of a stream — vLLM returns ``kv_transfer_params`` only on
non-streaming responses, so a side channel is the only way a streaming client learns it.

The request body is the one the guard already read (:func:`server.plugin.request.read_body`:
read once per request); stream events are cut and re-encoded by :mod:`server.common.sse`, as the
P/D router's relay does.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from sdk.contract import (
    BRANCH_HEADER,
    BRANCH_XARG,
    CACHE_SALT_FIELD,
    COMPLETION_PATHS,
    DEFAULT_BRANCH,
    EXTRA_ARGS_FIELD,
    GENERATE_PATHS,
    INTERNAL_XARGS,
    MAX_BODY_BYTES,
    NESTED_XARGS_PATH,
    NO_XARGS_PATHS,
    OWNER_XARG,
    RESPONSE_FIELD,
    SAMPLING_PARAMS_FIELD,
    SESSION_HEADER,
    TAG_XARG,
    TRANSFER_PARAMS_FIELD,
    USAGE_FIELD,
    XARGS_FIELD,
)
from server import dialects
from server.checks.ids import xargs_of
from server.common.sse import EVENT_END, EventSplitter, encode_event, json_event
from server.common.tenants import scope_of
from server.connector.control.models import Split
from server.connector.control.transport import AsyncControlClient
from server.plugin.engine_tokens import VllmEngine
from server.plugin.engines import Engines, rank_header
from server.plugin.peer_pull import PEER_PULL_PATHS, PeerPulls, PeerTurn
from server.plugin.priority import policy_from_env
from server.plugin.request import header, read_body, route_path
from server.plugin.tenancy import app_args_of, owner_of, tenant_salt
from server.plugin.tool_schema import default_strict_tools
from server.plugin.turn_log import SPLIT_SCOPE_KEY

__all__ = [
    "KVBranchMiddleware",
    "add_split_to_event",
    "attach_split",
    "header",
    "rewrite_request",
    "route_path",
    "xargs_of",
]

logger = logging.getLogger("kvbranch.middleware")

_NO_XARGS_PATHS = NO_XARGS_PATHS  # nothing to strip there
_USAGE_MARKER = f'"{USAGE_FIELD}"'.encode()


def attach_split(target: dict, split: dict, *, keep_params: bool = True) -> None:
    """Put ``split`` into a response body or usage chunk; transfer params it carries (P/D)
    go where a non-streaming response has them, unless vLLM already put them there.
    ``keep_params=False`` (an aggregated replica's turn, which files them itself): none stay."""
    split = dict(split)
    params = split.pop(TRANSFER_PARAMS_FIELD, None)
    if not keep_params:
        target.pop(TRANSFER_PARAMS_FIELD, None)
    elif params is not None and target.get(TRANSFER_PARAMS_FIELD) is None:
        target[TRANSFER_PARAMS_FIELD] = params
    target[RESPONSE_FIELD] = split


def rewrite_request(
    payload: dict,
    *,
    tag: str,
    branch_header: str | None,
    owner: str | None,
    path: str = COMPLETION_PATHS[0],
) -> dict:
    """Strip internal fields, add ours (tag, branch, owner) and the tenant salt; mark the
    function tools ``strict`` where the client did not say (:func:`default_strict_tools`).
    Pure (rewrites ``payload`` in place and returns it)."""
    default_strict_tools(payload, path)
    if owner:
        payload[CACHE_SALT_FIELD] = tenant_salt(owner, payload.get(CACHE_SALT_FIELD))
    if path in _NO_XARGS_PATHS:
        return payload
    xargs = xargs_of(payload, path)
    if xargs is None:
        xargs = {}
    if not isinstance(xargs, dict):
        return payload  # vLLM rejects it with its own message
    xargs = {k: v for k, v in xargs.items() if k not in INTERNAL_XARGS}
    xargs[TAG_XARG] = tag
    if branch_header and BRANCH_XARG not in xargs:
        xargs[BRANCH_XARG] = branch_header
    if owner:
        xargs[OWNER_XARG] = owner
    if path == NESTED_XARGS_PATH:
        params = payload.get(SAMPLING_PARAMS_FIELD)
        if isinstance(params, dict):
            params[EXTRA_ARGS_FIELD] = xargs
        # else: vLLM refuses the body (sampling_params is required) with its own message
    else:
        payload[XARGS_FIELD] = xargs
    return payload


def add_split_to_event(event: bytes, split: dict | None, *, keep_params: bool = True) -> bytes:
    """Put ``split`` into an SSE ``data:`` event that carries a non-null ``usage``."""
    if split is None:
        return event
    chunk = json_event(event, _USAGE_MARKER)
    if chunk is None or not chunk.get(USAGE_FIELD):
        return event
    attach_split(chunk, split, keep_params=keep_params)
    return encode_event(chunk)


class KVBranchMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app
        # Agent-aware priority (server/plugin/priority.py), when the launcher turned it on.
        self.priority = policy_from_env()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = route_path(scope) if scope["type"] == "http" else ""
        if scope.get("method") != "POST" or path not in GENERATE_PATHS:
            await self.app(scope, receive, send)
            return
        # Read once (the guard outside us usually did already); past MAX_BODY_BYTES reading
        # stops and the body is forwarded whole, untouched.
        request_body, receive = await read_body(scope, receive, MAX_BODY_BYTES)
        body = request_body.data
        tag = f"kvb-{uuid.uuid4().hex}"
        try:
            payload = None if request_body.more else json.loads(body)
        except ValueError:
            payload = None
        usage_rewrite = None  # cache-hint dialects (server/dialects/): session, pin, usage
        control: AsyncControlClient | None = None  # the session's engine (data parallel)
        if isinstance(payload, dict):
            owner = owner_of(header(scope, "authorization"), app_args_of(scope))
            payload = rewrite_request(
                payload,
                tag=tag,
                branch_header=header(scope, BRANCH_HEADER),
                owner=owner,
                path=path,
            )
            usage_rewrite = dialects.apply(payload, path, header(scope, SESSION_HEADER)).usage
            engines = _engines(scope)
            engine = _session_engine(engines, scope, payload, path, owner)
            peer_turn = await _begin_peer_turn(scope, payload, path, engine or 0)
            if self.priority is not None:
                # After the peer pull's claim: the history it brings is no prefill here.
                held = peer_turn.held_tokens if peer_turn is not None else 0
                self.priority.assign(payload, path, owner, held_tokens=held)
            body = request_body.data = json.dumps(payload).encode()
            if path in _NO_XARGS_PATHS:
                tag = ""  # it could not be carried: no split to look up
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            if engine is not None and engines is not None:
                control = engines.controls[engine] if engines.controls else None
                headers.append(rank_header(engine))
            scope = dict(scope, headers=headers)
        else:
            tag = ""
            peer_turn = None

        state = _ResponseRewriter(scope, send, tag, control)
        state.usage_rewrite = usage_rewrite
        state.peer_turn = peer_turn if tag else None
        if tag:  # the agent page's turn log (turn_log.py) takes the split from this one lookup
            scope[SPLIT_SCOPE_KEY] = state.fetch_split
        await self.app(scope, receive, state.send)


def _engines(scope: dict) -> Engines | None:
    app = scope.get("app")
    kvb = getattr(getattr(app, "state", None), "kvbranch", None)
    engines = getattr(kvb, "engines", None)
    return engines if isinstance(engines, Engines) else None


def _session_engine(
    engines: Engines | None, scope: dict, payload: dict, path: str, owner: str | None
) -> int | None:
    """The data-parallel engine of ``engines`` that keeps this request's session (None: one
    engine, or a turn without a session, which vLLM's balancer places)."""
    if engines is None or not engines.several:
        return None
    session = dialects.session_of(payload, path, header(scope, SESSION_HEADER))
    return engines.engine_for(owner, session) if session is not None else None


def _peer_pulls(scope: dict) -> PeerPulls | None:
    app = scope.get("app")
    kvb = getattr(getattr(app, "state", None), "kvbranch", None)
    peers = getattr(kvb, "peer_pulls", None)
    return peers if isinstance(peers, PeerPulls) else None


async def _begin_peer_turn(
    scope: dict, payload: dict, path: str, engine: int = 0
) -> PeerTurn | None:
    """An aggregated replica's session turn (on data-parallel engine ``engine``): its branch's
    hold taken from the index and, when a peer holds the branch, the claimed pull put in the
    request (:mod:`server.plugin.peer_pull`); None elsewhere. After the guard, which refused
    any client transfer params."""
    peers = _peer_pulls(scope)
    if peers is None or path not in PEER_PULL_PATHS:
        return None
    session = dialects.session_of(payload, path, header(scope, SESSION_HEADER))
    if session is None:
        return None
    xargs = xargs_of(payload, path)
    branch = xargs.get(BRANCH_XARG) if isinstance(xargs, dict) else None
    authorization = header(scope, "authorization")
    key = (scope_of(authorization), session, str(branch or DEFAULT_BRANCH))
    return await peers.begin(payload, key, authorization, path, engine)


class _ResponseRewriter:
    def __init__(
        self, scope: dict, send: Any, tag: str, control: AsyncControlClient | None = None
    ) -> None:
        self._send = send
        self._tag = tag
        #: The engine that served the request when the middleware chose it (a session's turn
        #: with data parallel); else the split is asked of every engine.
        self._control = control
        self.usage_rewrite: dialects.UsageRewrite | None = None  # a dialect's, per request
        #: An aggregated replica's session turn: its handle is filed, never shown to the client.
        self.peer_turn: PeerTurn | None = None
        self._filed = False
        self._start: dict | None = None
        self._mode = "pass"
        self._buffer = b""  # a JSON body until it is whole
        self._events = EventSplitter()  # a stream's events
        self._split: dict | None = None
        self._split_fetched = False
        self._app_state = scope.get("app").state if scope.get("app") is not None else None
        self._engine = VllmEngine(self._app_state)  # what a usage rewrite asks of vLLM

    async def fetch_split(self) -> dict | None:
        if self._split_fetched or not self._tag:
            return self._split
        self._split_fetched = True
        kvb = getattr(self._app_state, "kvbranch", None) if self._app_state else None
        if kvb is None or kvb.control is None:
            return None
        if self._control is not None:
            controls = [self._control]
        elif isinstance(getattr(kvb, "engines", None), Engines) and kvb.engines.several:
            controls = kvb.engines.controls  # vLLM chose the engine: whichever has the tag
        else:
            controls = [kvb.control]
        for control in controls:
            try:
                answer = await control.call(Split(tag=self._tag))
            except Exception as exc:  # noqa: BLE001 - accounting must never break a response
                logger.debug("kvbranch: no split for %s: %s", self._tag, exc)
                continue
            if answer.root is not None:
                self._split = answer.root.model_dump(mode="json")
                break
        return self._split

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.start":
            headers = dict((k.lower(), v) for k, v in message.get("headers", []))
            ctype = headers.get(b"content-type", b"")
            if message.get("status") == 200 and self._tag:
                if ctype.startswith(b"application/json"):
                    self._mode = "json"
                    self._start = message
                    return
                if ctype.startswith(b"text/event-stream"):
                    self._mode = "sse"
            await self._send(message)
            return
        if message["type"] != "http.response.body" or self._mode == "pass":
            await self._send(message)
            return
        more = message.get("more_body", False)
        if self._mode == "json":
            self._buffer += message.get("body", b"")
            if more:
                return
            await self._flush_json()
            return
        events = []
        for event in self._events.feed(message.get("body", b"")):
            if _USAGE_MARKER in event:
                event = add_split_to_event(
                    event, await self.fetch_split(), keep_params=self.peer_turn is None
                )
                if self.usage_rewrite is not None:
                    event = await self.usage_rewrite.rewrite_event(
                        event, await self.fetch_split(), self._engine
                    )
            events.append(event)
        out = b"".join(event + EVENT_END for event in events)
        if out and self.peer_turn is not None and self.peer_turn.first_token_at is None:
            self.peer_turn.first_token_at = time.monotonic()  # a stream's first event
        if not more:
            out += self._events.rest()
            if self.peer_turn is not None:
                await self._file_peer_turn()
        await self._send({"type": "http.response.body", "body": out, "more_body": more})

    async def _file_peer_turn(self) -> None:
        """File the replica's handle for the branch's next turn, before the client has the
        answer's end (so its next turn, wherever it lands, finds it)."""
        if self._filed or self.peer_turn is None:
            return
        self._filed = True
        split = await self.fetch_split()
        params = split.get(TRANSFER_PARAMS_FIELD) if isinstance(split, dict) else None
        kvb = getattr(self._app_state, "kvbranch", None)
        pulls = getattr(kvb, "peer_pulls", None)
        if isinstance(pulls, PeerPulls):
            await pulls.file(self.peer_turn, params)
            pulls.observe(self.peer_turn, split)

    async def _flush_json(self) -> None:
        body = self._buffer
        try:
            payload = json.loads(body)
            if isinstance(payload, dict) and USAGE_FIELD in payload:
                split = await self.fetch_split()
                if split is not None:
                    attach_split(payload, split)
                    body = json.dumps(payload).encode()
                if self.peer_turn is not None:
                    await self._file_peer_turn()
                    payload.pop(TRANSFER_PARAMS_FIELD, None)
                    body = json.dumps(payload).encode()
                if self.usage_rewrite is not None and await self.usage_rewrite.rewrite(
                    payload, split, self._engine
                ):
                    body = json.dumps(payload).encode()
        except ValueError:
            pass
        assert self._start is not None
        headers = [
            (k, v) for k, v in self._start.get("headers", []) if k.lower() != b"content-length"
        ]
        headers.append((b"content-length", str(len(body)).encode()))
        await self._send(dict(self._start, headers=headers))
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
