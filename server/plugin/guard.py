"""ASGI guard in front of the kvbranch routes and every generating route (outermost of ours;
vLLM's own key check, where it applies, runs before it).

* **Keys**: when the server has API keys, a generating route (:data:`GENERATE_PATHS`) needs
  one of them, else 401 — vLLM checks keys only under ``/v1``, ``/v2``, ``/inference`` and
  ``/cohere``, and ``/invocations`` and ``/generative_scoring`` generate outside them. A
  generating route that cannot carry a cache salt (:data:`UNSALTABLE_PATHS`) is refused (403).
* **Body size**: a request body over :data:`MAX_BODY_BYTES` bytes on a guarded path is answered 413
  with a JSON error (checked on ``Content-Length`` first, then while reading a chunked body);
  the rest of the body is read and dropped, never buffered.
* **Ids on generating requests**: the session id (``session_id`` in the body, the
  ``X-Session-ID`` header, or ``session_id`` in the extension args — vLLM's own three sources)
  and the branch id (``kvbranch_branch`` in the extension args or the ``X-KVBranch-Branch``
  header) must be :func:`sdk.contract.check_id` ids, else 400 naming the field. Without
  this, a request with a session id that no route can address (``../x``, a space, 10 000
  characters) would create a session — and auto-pin its blocks — that nobody could ever get
  or delete.
* **Hostile JSON**: a body nested deeper than :data:`sdk.contract.wire.MAX_JSON_DEPTH`, or
  with a lone UTF-16 surrogate in any string, is a 400 naming where
  (:mod:`server.checks.json_body`): past this layer both would raise (``RecursionError``,
  ``UnicodeEncodeError``): a 500, and a dropped keep-alive connection.
* **What only the cluster sends** (:mod:`server.plugin.cluster_gate`): transfer params and
  hold claims without the router's proof get 403; with API keys, vLLM's dev routes need a key
  (401).
* **Field types on the routes a router also serves** (chat and completions): ``"stream": 1``
  and the other fields :func:`server.checks.fields.field_problem` checks get the router's 400
  here too, so a replica behind a plain balancer answers a hostile body as our router does
  (vLLM's lax mode would stream ``"stream": 1``).
* **Engine choice**: an ``X-data-parallel-rank`` header (vLLM's per-request engine choice) is
  dropped from every request: with data parallel the middleware picks the session's engine
  (:mod:`server.plugin.engines`); a client never does.
* **Client salt**: with keys, a ``cache_salt`` vLLM would refuse gets vLLM's 400 here, since
  the middleware turns any client salt into a valid tenant salt.

Errors use the contract's shape (:func:`server.common.errors.send_error`): ``{"error": {"message",
"type", "param", "code"}}``. The body it reads is kept for the middleware inside it
(:func:`server.plugin.request.read_body`), so a request's body is read once.
"""

from __future__ import annotations

from typing import Any

from sdk.contract import (
    API_PREFIX,
    BRANCH_HEADER,
    CACHE_SALT_FIELD,
    COMPLETION_PATHS,
    GENERATE_PATHS,
    MAX_BODY_BYTES,
    SESSION_HEADER,
    UNSALTABLE_PATHS,
    check_cache_salt,
)
from server import dialects
from server.checks import json_body
from server.checks.fields import field_problem
from server.checks.ids import id_problem
from server.common.errors import send_error
from server.plugin import cluster_gate
from server.plugin.engines import strip_client_rank
from server.plugin.request import drain, header, read_body, route_path
from server.plugin.tenancy import app_args_of, owner_of, tenancy_on


def _guarded(path: str) -> bool:
    return (
        path in GENERATE_PATHS
        or path in UNSALTABLE_PATHS
        or path == API_PREFIX
        or path.startswith(API_PREFIX + "/")
    )


class KVBranchGuard:
    def __init__(self, app: Any, max_body: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body = max_body

    async def _reply(self, send: Any, status: int, message: str, param: str | None) -> None:
        await send_error(send, status, message, param)

    async def _drain(self, receive: Any) -> None:
        await drain(receive)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = route_path(scope) if scope["type"] == "http" else ""
        if scope["type"] == "http":
            scope = strip_client_rank(scope)  # only the middleware picks an engine
        if cluster_gate.is_dev_path(path):
            dev_args = app_args_of(scope)
            if tenancy_on(dev_args) and owner_of(header(scope, "authorization"), dev_args) is None:
                await self._drain(receive)
                await self._reply(send, 401, "dev routes need one of this server's API keys", None)
                return
        if scope.get("method") not in ("POST", "PUT", "PATCH") or not _guarded(path):
            await self.app(scope, receive, send)
            return
        app_args = app_args_of(scope)
        keys = tenancy_on(app_args)
        generating = path in GENERATE_PATHS or path in UNSALTABLE_PATHS
        if keys and generating:
            if owner_of(header(scope, "authorization"), app_args) is None:
                await self._drain(receive)
                await self._reply(
                    send,
                    401,
                    "this server requires an API key: send "
                    "'Authorization: Bearer <key>' with one of its keys",
                    None,
                )
                return
            if path in UNSALTABLE_PATHS:
                await self._drain(receive)
                await self._reply(
                    send,
                    403,
                    f"{path} is not served with API keys: its "
                    "requests cannot carry a per-tenant cache_salt",
                    None,
                )
                return
        too_big = f"request body larger than {self.max_body} bytes"
        length = header(scope, "content-length")
        digits = length.strip() if length is not None else ""
        if digits.isascii() and digits.isdigit() and int(digits) > self.max_body:  # not "²"
            await self._drain(receive)
            await self._reply(send, 413, too_big, None)
            return
        # Read once for every layer of ours (the middleware gets it from the scope).
        request_body, receive = await read_body(scope, receive, self.max_body)
        if request_body.disconnected:  # client gone
            return
        if request_body.over_limit:
            if request_body.more:
                await self._drain(receive)
            await self._reply(send, 413, too_big, None)
            return
        body = request_body.data
        # Parsed once, here: too deep or a lone surrogate is a 400 (json_body.py); a body that
        # is not JSON is answered by its route.
        payload, problem = json_body.parse(body)
        if problem is not None:
            await self._reply(send, 400, problem[1], problem[0])
            return
        proof = header(scope, cluster_gate.ROUTER_PROOF_HEADER)
        refused = cluster_gate.claim_refusal(proof, scope["method"], path, body)
        if refused is not None:
            await self._reply(send, 403, refused, None)
            return

        if path in GENERATE_PATHS:
            if isinstance(payload, dict):
                problem = id_problem(
                    payload, header(scope, SESSION_HEADER), header(scope, BRANCH_HEADER), path
                )
                if problem is None:  # transfer params: the cluster's router only (403)
                    refusal = cluster_gate.transfer_refusal(
                        payload, proof, scope["method"], path, body
                    )
                    if refusal is not None:
                        await self._reply(send, 403, refusal[1], refusal[0])
                        return
                if problem is None:  # cache hints (prompt_cache_*, cache_control): the registry
                    problem = dialects.problem(payload, path)
                if problem is None and path in COMPLETION_PATHS:  # as the router refuses them
                    problem = field_problem(payload)
                if problem is None and keys:
                    try:
                        check_cache_salt(payload.get(CACHE_SALT_FIELD))
                    except ValueError as exc:
                        problem = (CACHE_SALT_FIELD, str(exc))
                if problem is not None:
                    await self._reply(send, 400, problem[1], problem[0])
                    return

        await self.app(scope, receive, send)
