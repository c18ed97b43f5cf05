"""ASGI middleware around vLLM's completion routes.

On the way in, on every generating route (:data:`server.contract.GENERATE_PATHS`), it drops
kvbranch's internal fields from the client's extension args (:data:`INTERNAL_XARGS`: only the
server sets them), stamps a server-made tag (to find the request's accounting afterwards),
copies the ``X-KVBranch-Branch`` header into the extension args, and, when the server has API
keys, stamps the caller's tenant (``owner``) and salts the prefix cache per tenant (vLLM's
``cache_salt``: the tenant's id combined with the client's own salt, if any). The extension
args are ``vllm_xargs`` on the OpenAI/Anthropic routes and ``sampling_params.extra_args`` on
``/inference/v1/generate``; ``/v1/systemone`` and ``/generative_scoring`` take none from
clients, so only their salt is set.

On the way out it adds the top-level ``kvbranch`` object (:class:`PromptSourceSplit`) to the
JSON body, or to the usage chunk of a stream — vLLM returns ``kv_transfer_params`` only on
non-streaming responses, so a side channel is the only way a streaming client learns it.
"""

from __future__ import annotations

import json
import logging
import uuid
from typing import Any

from server.contract import (
    BRANCH_HEADER,
    BRANCH_XARG,
    COMPLETION_PATHS,
    GENERATE_PATHS,
    INTERNAL_XARGS,
    MAX_BODY_BYTES,
    NESTED_XARGS_PATH,
    OWNER_XARG,
    RESPONSE_FIELD,
    TAG_XARG,
    TRANSFER_PARAMS_FIELD,
)
from server.plugin.tenancy import app_args_of, owner_of, tenant_salt

logger = logging.getLogger("kvbranch.middleware")



#: Generating routes whose bodies take no extension args from clients (nothing to strip).
_NO_XARGS_PATHS = ("/v1/systemone", "/generative_scoring")


def route_path(scope: dict) -> str:
    """The request path without the app's ``root_path``, as vLLM's key check matches it."""
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


def xargs_of(payload: dict, path: str) -> Any:
    """The client's extension args on this route (``None`` when absent or not accepted)."""
    if path in _NO_XARGS_PATHS:
        return None
    if path == NESTED_XARGS_PATH:
        params = payload.get("sampling_params")
        return params.get("extra_args") if isinstance(params, dict) else None
    return payload.get("vllm_xargs")


def header(scope: dict, name: str) -> str | None:
    """An ASGI request header by case-insensitive name."""
    key = name.lower().encode()
    for k, v in scope.get("headers", []):
        if k.lower() == key:
            return v.decode("latin-1")
    return None


def attach_split(target: dict, split: dict) -> None:
    """Put ``split`` into a response body or usage chunk; transfer params it carries (P/D)
    go where a non-streaming response has them, unless vLLM already put them there."""
    split = dict(split)
    params = split.pop(TRANSFER_PARAMS_FIELD, None)
    if params is not None and target.get(TRANSFER_PARAMS_FIELD) is None:
        target[TRANSFER_PARAMS_FIELD] = params
    target[RESPONSE_FIELD] = split


def rewrite_request(payload: dict, *, tag: str, branch_header: str | None,
                    owner: str | None, path: str = COMPLETION_PATHS[0]) -> dict:
    """Strip internal fields, add ours (tag, branch, owner) and the tenant salt. Pure."""
    if owner:
        payload["cache_salt"] = tenant_salt(owner, payload.get("cache_salt"))
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
        params = payload.get("sampling_params")
        if isinstance(params, dict):
            params["extra_args"] = xargs
        # else: vLLM refuses the body (sampling_params is required) with its own message
    else:
        payload["vllm_xargs"] = xargs
    return payload


def add_split_to_event(event: bytes, split: dict | None) -> bytes:
    """Put ``split`` into an SSE ``data:`` event that carries a non-null ``usage``."""
    if split is None or not event.startswith(b"data: {") or b'"usage"' not in event:
        return event
    try:
        chunk = json.loads(event[len(b"data: "):])
    except ValueError:
        return event
    if not isinstance(chunk, dict) or not chunk.get("usage"):
        return event
    attach_split(chunk, split)
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode()


class KVBranchMiddleware:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = route_path(scope) if scope["type"] == "http" else ""
        if scope.get("method") != "POST" or path not in GENERATE_PATHS:
            await self.app(scope, receive, send)
            return
        body = b""
        more = False  # True when we stopped buffering a body larger than MAX_BODY_BYTES
        while True:
            message = await receive()
            if message["type"] != "http.request":
                more = False  # client gone: nothing more will come
                break
            body += message.get("body", b"")
            more = bool(message.get("more_body"))
            if len(body) > MAX_BODY_BYTES or not more:
                break
        tag = f"kvb-{uuid.uuid4().hex}"
        try:
            payload = None if more else json.loads(body)
        except ValueError:
            payload = None
        if isinstance(payload, dict):
            payload = rewrite_request(
                payload, tag=tag, branch_header=header(scope, BRANCH_HEADER),
                owner=owner_of(header(scope, "authorization"), app_args_of(scope)), path=path)
            body = json.dumps(payload).encode()
            if path in _NO_XARGS_PATHS:
                tag = ""  # it could not be carried: no split to look up
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            scope = dict(scope, headers=headers)
        else:
            tag = ""

        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": more}
            return await receive()

        state = _ResponseRewriter(scope, send, tag)
        await self.app(scope, replay, state.send)


class _ResponseRewriter:
    def __init__(self, scope: dict, send: Any, tag: str) -> None:
        self._send = send
        self._tag = tag
        self._start: dict | None = None
        self._mode = "pass"
        self._buffer = b""
        self._split: dict | None = None
        self._split_fetched = False
        self._app_state = scope.get("app").state if scope.get("app") is not None else None

    async def _fetch_split(self) -> dict | None:
        if self._split_fetched or not self._tag:
            return self._split
        self._split_fetched = True
        kvb = getattr(self._app_state, "kvbranch", None) if self._app_state else None
        if kvb is None or kvb.control is None:
            return None
        try:
            self._split = await kvb.control.call("split", tag=self._tag)
        except Exception as exc:  # noqa: BLE001 - accounting must never break a response
            logger.debug("kvbranch: no split for %s: %s", self._tag, exc)
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
        self._buffer += message.get("body", b"")
        if self._mode == "json":
            if more:
                return
            await self._flush_json()
            return
        out = []
        while b"\n\n" in self._buffer:
            event, self._buffer = self._buffer.split(b"\n\n", 1)
            if b'"usage"' in event:
                event = add_split_to_event(event, await self._fetch_split())
            out.append(event + b"\n\n")
        if not more and self._buffer:
            out.append(self._buffer)
            self._buffer = b""
        await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": more})

    async def _flush_json(self) -> None:
        body = self._buffer
        try:
            payload = json.loads(body)
            if isinstance(payload, dict) and "usage" in payload:
                split = await self._fetch_split()
                if split is not None:
                    attach_split(payload, split)
                    body = json.dumps(payload).encode()
        except ValueError:
            pass
        assert self._start is not None
        headers = [(k, v) for k, v in self._start.get("headers", [])
                   if k.lower() != b"content-length"]
        headers.append((b"content-length", str(len(body)).encode()))
        await self._send(dict(self._start, headers=headers))
        await self._send({"type": "http.response.body", "body": body, "more_body": False})
