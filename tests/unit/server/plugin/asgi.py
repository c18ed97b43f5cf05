"""Drive one ASGI layer of the plugin (the guard, the tenancy layer, the responses scope) with
one request, in process, and read back what it sent: the tests of those layers share this one
copy of the receive/send plumbing."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Sent:
    """What the layer sent back: its messages, the status and the body."""

    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def status(self) -> int | None:
        starts = [m["status"] for m in self.messages if m["type"] == "http.response.start"]
        return starts[0] if starts else None

    @property
    def body(self) -> bytes:
        parts = [m.get("body", b"") for m in self.messages if m["type"] == "http.response.body"]
        return b"".join(parts)


def run_asgi(layer: Any, scope: dict[str, Any], body: bytes = b"") -> Sent:
    """Run ``layer`` on one request: ``body`` in one message, then a disconnect."""
    sent = Sent()
    queue = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        return queue.pop(0) if queue else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.messages.append(message)

    asyncio.run(layer(scope, receive, send))
    return sent
