"""ASGI guard in front of the kvbranch routes and the completion routes (outermost middleware).

* **Body size**: a request body over :data:`MAX_BODY_BYTES` bytes on a guarded path is answered 413
  with a JSON error (checked on ``Content-Length`` first, then while reading a chunked body);
  the rest of the body is read and dropped, never buffered.
* **Ids on chat/completion requests**: the session id (``session_id`` in the body, the
  ``X-Session-ID`` header, or ``vllm_xargs.session_id`` — vLLM's own three sources) and the
  branch id (``vllm_xargs.kvbranch_branch`` or the ``X-KVBranch-Branch`` header) must be
  :func:`server.contract.check_id` ids, else 400 naming the field. Without this, a chat request
  with a session id that no route can address (``../x``, a space, 10 000 characters) would
  create a session — and auto-pin its blocks — that nobody could ever get or delete.

Errors use the contract's shape: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import json
from typing import Any

from server.contract import (
    API_PREFIX,
    BRANCH_HEADER,
    BRANCH_XARG,
    COMPLETION_PATHS,
    MAX_BODY_BYTES,
    SESSION_HEADER,
    check_id,
)
from server.plugin.middleware import header


def _guarded(path: str) -> bool:
    return path in COMPLETION_PATHS or path == API_PREFIX or path.startswith(API_PREFIX + "/")


def id_problem(payload: dict, session_header: str | None,
               branch_header: str | None) -> tuple[str, str] | None:
    """(param, message) for the first malformed session/branch id of a completion body, or
    None. Empty or absent ids mean "none" (as in vLLM and the planner). Pure, for tests."""
    xargs = payload.get("vllm_xargs")
    xargs = xargs if isinstance(xargs, dict) else {}
    candidates = [
        ("session_id", payload.get("session_id")),
        (SESSION_HEADER, session_header),
        ("vllm_xargs.session_id", xargs.get("session_id")),
        (f"vllm_xargs.{BRANCH_XARG}", xargs.get(BRANCH_XARG)),
        (BRANCH_HEADER, branch_header),
    ]
    for param, value in candidates:
        if value is None or value == "":
            continue
        if param == "session_id" and not isinstance(value, str):
            continue  # vLLM's own request model rejects it with its message
        if param == "vllm_xargs.session_id" and not isinstance(value, str):
            continue  # vLLM ignores a non-string one
        try:
            check_id(value, param)
        except ValueError as exc:
            return param, str(exc)[:300]
    return None


def _error_response(status: int, message: str, param: str | None) -> tuple[dict, bytes]:
    kind = {400: "BadRequestError", 413: "RequestTooLargeError"}.get(status, "Error")
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
        if (scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH")
                or not _guarded(scope.get("path", ""))):
            await self.app(scope, receive, send)
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

        if scope["path"] in COMPLETION_PATHS:
            try:
                payload = json.loads(body)
            except ValueError:
                payload = None  # vLLM answers malformed JSON itself
            if isinstance(payload, dict):
                problem = id_problem(payload, header(scope, SESSION_HEADER),
                                     header(scope, BRANCH_HEADER))
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
