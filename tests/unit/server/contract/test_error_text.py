"""server.common.errors with any text: an error quoting a lone surrogate still encodes (before, the
Starlette form raised UnicodeEncodeError while answering)."""

from __future__ import annotations

import asyncio
import json

from server.common.errors import asgi_error, error_response, safe_text, send_error


def test_safe_text():
    assert safe_text("plain") == "plain"
    assert safe_text("é😀") == "é😀"
    assert safe_text("a\ud800b") == "a\\ud800b"


def test_every_error_form_encodes_a_lone_surrogate():
    response = error_response(
        400, "bad key '\ud800'", param="p\udc00", detail={"k\ud800": ["v\udfff"]}
    )
    body = json.loads(response.body.decode("utf-8"))
    assert body["error"]["message"] == "bad key '\\ud800'"
    assert body["error"]["param"] == "p\\udc00"
    assert body["error"]["detail"] == {"k\\ud800": ["v\\udfff"]}
    start, raw = asgi_error(400, "x\ud800", "y\udfff")
    assert json.loads(raw.decode("utf-8"))["error"]["message"] == "x\\ud800"
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(send_error(send, 400, "\ud800"))
    assert sent[0]["status"] == 400
    assert json.loads(sent[1]["body"])["error"]["message"] == "\\ud800"
