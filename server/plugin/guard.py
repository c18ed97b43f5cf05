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
  header) must be :func:`server.contract.check_id` ids, else 400 naming the field. Without
  this, a request with a session id that no route can address (``../x``, a space, 10 000
  characters) would create a session — and auto-pin its blocks — that nobody could ever get
  or delete.
* **Client salt**: with keys, a ``cache_salt`` vLLM would refuse gets vLLM's 400 here, since
  the middleware turns any client salt into a valid tenant salt.

Errors use the contract's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from typing import Any

from server.contract import (
    API_PREFIX,
    BRANCH_HEADER,
    BRANCH_XARG,
    GENERATE_PATHS,
    MAX_BODY_BYTES,
    NESTED_XARGS_PATH,
    SESSION_HEADER,
    UNSALTABLE_PATHS,
    check_cache_salt,
    check_id,
)
from server.plugin.middleware import header, route_path, xargs_of
from server.plugin.tenancy import app_args_of, owner_of, tenancy_on


def _guarded(path: str) -> bool:
    return (path in GENERATE_PATHS or path in UNSALTABLE_PATHS or path == API_PREFIX
            or path.startswith(API_PREFIX + "/"))


def id_problem(payload: dict, session_header: str | None,
               branch_header: str | None, path: str = GENERATE_PATHS[0]
               ) -> tuple[str, str] | None:
    """(param, message) for the first malformed session/branch id of a generating request, or
    None. Empty or absent ids mean "none" (as in vLLM and the planner). Pure, for tests."""
    xargs = xargs_of(payload, path)
    xargs = xargs if isinstance(xargs, dict) else {}
    where = "sampling_params.extra_args" if path == NESTED_XARGS_PATH else "vllm_xargs"
    candidates = [
        ("session_id", payload.get("session_id")),
        (SESSION_HEADER, session_header),
        (f"{where}.session_id", xargs.get("session_id")),
        (f"{where}.{BRANCH_XARG}", xargs.get(BRANCH_XARG)),
        (BRANCH_HEADER, branch_header),
    ]
    for param, value in candidates:
        if value is None or value == "":
            continue
        if param == "session_id" and not isinstance(value, str):
            continue  # vLLM's own request model rejects it with its message
        if param == f"{where}.session_id" and not isinstance(value, str):
            continue  # vLLM ignores a non-string one
        try:
            check_id(value, param)
        except ValueError as exc:
            return param, str(exc)[:300]
    return None


def _error_response(status: int, message: str, param: str | None) -> tuple[dict, bytes]:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
            413: "RequestTooLargeError"}.get(status, "Error")
    body = json.dumps({"error": {"message": message, "type": kind, "param": param,
                                 "code": status}}).encode()
    start = {"type": "http.response.start", "status": status,
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}
    return start, body


class KVBranchGuard:
    def __init__(self, app: Any, max_body: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.max_body = max_body

    async def _reply(self, send: Any, status: int, message: str, param: str | None) -> None:
        start, body = _error_response(status, message, param)
        await send(start)
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _drain(self, receive: Any) -> None:
        while True:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body"):
                return

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = route_path(scope) if scope["type"] == "http" else ""
        if scope.get("method") not in ("POST", "PUT", "PATCH") or not _guarded(path):
            await self.app(scope, receive, send)
            return
        app_args = app_args_of(scope)
        keys = tenancy_on(app_args)
        generating = path in GENERATE_PATHS or path in UNSALTABLE_PATHS
        if keys and generating:
            if owner_of(header(scope, "authorization"), app_args) is None:
                await self._drain(receive)
                await self._reply(send, 401, "this server requires an API key: send "
                                  "'Authorization: Bearer <key>' with one of its keys", None)
                return
            if path in UNSALTABLE_PATHS:
                await self._drain(receive)
                await self._reply(send, 403, f"{path} is not served with API keys: its "
                                  "requests cannot carry a per-tenant cache_salt", None)
                return
        too_big = f"request body larger than {self.max_body} bytes"
        length = header(scope, "content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body:
            await self._drain(receive)
            await self._reply(send, 413, too_big, None)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # client gone
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                if message.get("more_body"):
                    await self._drain(receive)
                await self._reply(send, 413, too_big, None)
                return
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body = b"".join(chunks)

        if path in GENERATE_PATHS:
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None  # vLLM answers malformed JSON itself
            if isinstance(payload, dict):
                problem = id_problem(payload, header(scope, SESSION_HEADER),
                                     header(scope, BRANCH_HEADER), path)
                if problem is None and keys:
                    try:
                        check_cache_salt(payload.get("cache_salt"))
                    except ValueError as exc:
                        problem = ("cache_salt", str(exc))
                if problem is not None:
                    await self._reply(send, 400, problem[1], problem[0])
                    return

        sent = False

        async def replay() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
