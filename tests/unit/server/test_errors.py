"""One error shape for the plugin, the guard and the router."""

from __future__ import annotations

import asyncio
import json

from sdk.contract import ErrorBody, error_body, error_type
from server.common.errors import asgi_error, error_response, send_error


def test_the_one_shape():
    body = error_body(413, "too big")
    assert body == {
        "error": {"message": "too big", "type": "RequestTooLargeError", "param": None, "code": 413}
    }
    assert ErrorBody.model_validate(body).error.code == 413
    assert error_type(418) == "Error" and error_type(504) == "ServerError"
    assert error_body(502, "x", instances=[1])["error"]["instances"] == [1]


def test_response_and_asgi_forms_agree():
    response = error_response(404, "gone", param="session_id", headers={"Retry-After": "1"})
    assert response.status_code == 404 and response.headers["retry-after"] == "1"
    start, body = asgi_error(404, "gone", "session_id")
    assert json.loads(response.body) == json.loads(body) == error_body(404, "gone", "session_id")
    assert start["status"] == 404
    assert dict(start["headers"])[b"content-length"] == str(len(body)).encode()
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(send_error(send, 404, "gone", "session_id"))
    assert sent == [start, {"type": "http.response.body", "body": body, "more_body": False}]
