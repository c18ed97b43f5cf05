"""The instance's outermost layer: the headers the cluster reads, checked as the router's edge
checks them (:func:`server.checks.headers.header_problem`), before vLLM's own key check.

Why a layer of its own, outside vLLM's middleware: vLLM adds its middleware (the API-key
check among them) after the endpoint plugins attached theirs, so the kvbranch guard runs
*inside* vLLM's key check, and a key that is not printable ASCII got vLLM's bare 401 at an
instance where the router answers 400 naming the header. Behind a plain balancer each replica
is a door of its own and must answer a hostile request as the router does. The launcher names
this class in vLLM's ``--middleware`` (applied after vLLM's own, so outermost); under ``vllm
serve`` without it the guard still refuses the other bad headers it reads, only this one
answer differs (docs/security.md).
"""

from __future__ import annotations

from typing import Any

from server.checks.headers import header_problem
from server.common.errors import send_error


class HeaderGate:
    """ASGI: a request whose checked headers are repeated or not printable ASCII gets 400
    naming the header; everything else passes untouched."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            problem = header_problem(scope.get("headers", []))
            if problem is not None:
                await send_error(send, 400, problem[1], problem[0])
                return
        await self.app(scope, receive, send)


__all__ = ["HeaderGate"]
