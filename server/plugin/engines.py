"""Data-parallel engines behind one API server: which engine serves a session, and the control
socket of each.

Why: with ``--data-parallel-size N`` vLLM runs N engine cores behind one API server and its
load balancer sends each request to whichever engine is least busy. Each engine core has its
own connector, so its own session registry and host store: a session whose turns land on
different engines finds its earlier turns in neither, and a session route sent to engine 0
does not see a session engine 1 holds. So every request of a session goes to one engine,
chosen from a digest of its owner and session id (never from anything the client names
directly), and the session routes ask that engine's control socket.

How the engine is chosen: vLLM's OpenAI routes read the engine from the
``X-data-parallel-rank`` request header (meant for a router in front). The guard drops that
header from every client request (:func:`strip_client_rank`: a client must not pick an engine,
nor land a session's turn on an engine that does not hold it), and the middleware sets it
again for a session's turn (:func:`rank_header`). A turn without a session keeps vLLM's load
balancing; its prompt-source split is asked of every engine (:meth:`Engines.split_controls`).

Standard library and the control transport only.
"""

from __future__ import annotations

from typing import Any

from server.common.engine_choice import engine_count, engine_of
from server.connector.control.transport import AsyncControlClient, engine_socket_path

__all__ = ["RANK_HEADER", "Engines", "engine_of", "rank_header", "strip_client_rank"]

#: vLLM's per-request engine choice (``OpenAIServing._get_data_parallel_rank``), lower case as
#: ASGI carries header names.
RANK_HEADER = b"x-data-parallel-rank"


def strip_client_rank(scope: dict) -> dict:
    """``scope`` without any ``X-data-parallel-rank`` header the client sent (a copy only when
    it had one)."""
    headers = scope.get("headers") or []
    if not any(k.lower() == RANK_HEADER for k, _ in headers):
        return scope
    return dict(scope, headers=[(k, v) for k, v in headers if k.lower() != RANK_HEADER])


def rank_header(engine: int) -> tuple[bytes, bytes]:
    return (RANK_HEADER, str(engine).encode())


class Engines:
    """The engine cores of this server and the control client of each (engine ``i`` binds
    :func:`engine_socket_path` ``(path, i)``)."""

    def __init__(self, control_path: str | None, count: int) -> None:
        self.count = max(1, int(count))
        self.controls: list[AsyncControlClient] = (
            [AsyncControlClient(engine_socket_path(control_path, i)) for i in range(self.count)]
            if control_path
            else []
        )

    @classmethod
    def of(cls, engine_client: Any, control_path: str | None) -> Engines:
        """The engines ``engine_client`` balances over (``data_parallel_size`` of its config)."""
        return cls(control_path, engine_count(engine_client))

    @property
    def several(self) -> bool:
        return self.count > 1

    def engine_for(self, owner: str | None, session_id: str) -> int:
        return engine_of(owner, session_id, self.count)

    def control_for(self, owner: str | None, session_id: str | None) -> AsyncControlClient | None:
        """The control client of the engine holding the session (engine 0's without one)."""
        if not self.controls:
            return None
        engine = self.engine_for(owner, session_id) if session_id else 0
        return self.controls[engine]
