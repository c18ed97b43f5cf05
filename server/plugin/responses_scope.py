"""vLLM's stored responses, scoped by API key (ASGI, innermost of kvbranch's layers).

vLLM keeps the responses of ``POST /v1/responses`` in one store for the whole server and
serves them to anyone by id: ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``,
and ``previous_response_id`` (which continues a stored conversation — its whole history) in a
new request. With API keys each key is a tenant (:mod:`server.plugin.tenancy`), so this layer
remembers which tenant made each response id and answers another tenant exactly as vLLM
answers an unknown id (404, vLLM's own body), so a tenant cannot even tell the id exists.

How it knows the id without reading responses (streams, background runs): the id of a stored
response is its request's ``request_id`` (a vLLM field of the body), so on ``POST
/v1/responses`` the layer sets a fresh one (vLLM's own format, ``resp_<hex>``) when the
client sent none, and records it for the caller before the request runs. A client-chosen
``request_id`` is recorded the same way; one that another tenant already holds is refused
(409) — else the new response would replace the other tenant's in vLLM's store.

Memory is bounded: at most :data:`MAX_SCOPED_RESPONSES` ids, least recently used dropped
first. A dropped id (or one from before a restart) is nobody's: 404 for every tenant
(vLLM's store itself is in memory, so a restart loses its responses too). Without API keys
nothing changes: the layer passes every request through untouched.
"""

from __future__ import annotations

import json
import uuid
from collections import OrderedDict
from typing import Any

from sdk.contract import MAX_BODY_BYTES, RESPONSES_PATH
from server.common.errors import safe_text, send_error
from server.plugin.request import header, read_body, route_path
from server.plugin.tenancy import app_args_of, owner_of, tenancy_on

__all__ = ["MAX_SCOPED_RESPONSES", "ResponseOwners", "ResponsesScope"]

#: Response ids remembered (about 200 bytes each: some 20 MB at most).
MAX_SCOPED_RESPONSES = 100_000
REQUEST_ID_FIELD = "request_id"
PREVIOUS_RESPONSE_FIELD = "previous_response_id"


class ResponseOwners:
    """response id -> tenant, least recently used dropped past ``cap``."""

    def __init__(self, cap: int = MAX_SCOPED_RESPONSES) -> None:
        self.cap = cap
        self._owners: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def get(self, response_id: str) -> str | None:
        owner = self._owners.get(response_id)
        if owner is not None:
            self._owners.move_to_end(response_id)
        return owner

    def claim(self, response_id: str, owner: str) -> bool:
        """Record ``owner`` for the id; False when another tenant holds it."""
        held = self.get(response_id)
        if held is not None and held != owner:
            return False
        self._owners[response_id] = owner
        self._owners.move_to_end(response_id)
        while len(self._owners) > self.cap:
            self._owners.popitem(last=False)
        return True


async def _not_found(send: Any, response_id: str) -> None:
    """vLLM's answer for an unknown response id, byte for byte (``_make_not_found_error``)."""
    body = {
        "error": {
            "message": safe_text(f"Response with id '{response_id}' not found."),
            "type": "invalid_request_error",
            "param": "response_id",
            "code": 404,
        }
    }
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    await send({"type": "http.response.start", "status": 404, "headers": headers})
    await send({"type": "http.response.body", "body": data, "more_body": False})


def _response_id(path: str) -> str | None:
    """``abc`` for ``/v1/responses/abc`` and ``/v1/responses/abc/cancel``; None elsewhere."""
    if not path.startswith(RESPONSES_PATH + "/"):
        return None
    return path[len(RESPONSES_PATH) + 1 :].split("/", 1)[0]


class ResponsesScope:
    def __init__(self, app: Any, cap: int = MAX_SCOPED_RESPONSES) -> None:
        self.app = app
        self.owners = ResponseOwners(cap)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = route_path(scope) if scope["type"] == "http" else ""
        response_id = _response_id(path)
        creating = path == RESPONSES_PATH and scope.get("method") == "POST"
        app_args = app_args_of(scope) if (creating or response_id is not None) else None
        if not (creating or response_id is not None) or not tenancy_on(app_args):
            await self.app(scope, receive, send)
            return
        owner = owner_of(header(scope, "authorization"), app_args)
        if response_id is not None:
            if owner is None or self.owners.get(response_id) != owner:
                await _not_found(send, response_id)
                return
            await self.app(scope, receive, send)
            return
        await self._create(scope, receive, send, owner)

    async def _create(self, scope: dict, receive: Any, send: Any, owner: str | None) -> None:
        request_body, receive = await read_body(scope, receive, MAX_BODY_BYTES)
        try:
            payload = None if request_body.more else json.loads(request_body.data)
        except (ValueError, RecursionError):
            payload = None  # vLLM answers it (the guard refused what it could not parse)
        if owner is None or not isinstance(payload, dict):
            await self.app(scope, receive, send)
            return
        previous = payload.get(PREVIOUS_RESPONSE_FIELD)
        if isinstance(previous, str) and previous and self.owners.get(previous) != owner:
            await _not_found(send, previous)
            return
        request_id = payload.get(REQUEST_ID_FIELD)
        if request_id is None:
            request_id = payload[REQUEST_ID_FIELD] = f"resp_{uuid.uuid4().hex}"
            request_body.data = json.dumps(payload).encode()
            headers = [(k, v) for k, v in scope["headers"] if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(request_body.data)).encode()))
            scope = dict(scope, headers=headers)
        if isinstance(request_id, str) and not self.owners.claim(request_id, owner):
            await send_error(
                send,
                409,
                f"{REQUEST_ID_FIELD} {request_id!r} is in use; leave it out and the server "
                "picks a fresh one",
                REQUEST_ID_FIELD,
            )
            return
        await self.app(scope, receive, send)
