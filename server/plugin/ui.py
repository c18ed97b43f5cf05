"""The agent page on an instance: its static files (:mod:`server.common.ui_page`, served
without a key — they carry no data) and its data route, :data:`UI_DATA_PATH`.

The data route answers the caller's tenant only: its sessions as ``/v1/kvbranch/stats`` lists
them (the connector filters them by the key's tenant) and the last turns of their branches from
:class:`~server.plugin.turn_log.TurnLog` (kept per tenant). It is under ``/v1``, so vLLM's own
key check refuses it without a key (401) before it runs; it also refuses a request whose key
names no tenant on a server with keys, in case that check is ever off.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from server.common.errors import error_response
from server.common.ui_page import UI_DATA_PATH, add_page_routes
from server.connector.control.models import GetStats
from server.connector.control.transport import ControlError
from server.plugin.engine_stats import gather_stats
from server.plugin.engines import Engines
from server.plugin.tenancy import app_args_of, owner_of, tenancy_on
from server.plugin.turn_log import TurnLog

__all__ = ["REFRESH_S", "UI_DATA_PATH", "install", "page_data", "router"]

#: How often the page asks again (it reads this from every answer).
REFRESH_S = 3
#: Where the app keeps its turn log.
TURN_LOG_STATE = "kvbranch_turns"

router = APIRouter(tags=["kvbranch"])


def install(app: FastAPI) -> TurnLog:
    """Add the page's routes to ``app`` and give it a turn log (returned, for the recorder)."""
    log = TurnLog()
    setattr(app.state, TURN_LOG_STATE, log)
    add_page_routes(app)
    app.include_router(router)
    return log


def page_data(stats: Any, turns: TurnLog, owner: str | None, role: str | None) -> dict[str, Any]:
    """The page's data for ``owner`` from its ``stats`` (already the owner's: the connector
    lists only the caller's sessions) and the owner's turns of the branches listed there."""
    sessions = [s.model_dump(mode="json") for s in stats.sessions]
    branches = [(s["session_id"], b["branch_id"]) for s in sessions for b in s["branches"]]
    return {
        "time": stats.time,
        "refresh_s": REFRESH_S,
        "role": role,
        "sessions": sessions,
        "num_own_sessions": stats.num_own_sessions,
        "turns": [t.as_json() for t in turns.turns_of(owner, branches)],
        "store": {
            "used_blocks": stats.store.used_blocks,
            "capacity_blocks": stats.store.capacity_blocks,
        },
    }


@router.get(UI_DATA_PATH, include_in_schema=False)
async def ui_data(request: Request) -> Response:
    args = app_args_of(request.app)
    owner = owner_of(request.headers.get("authorization"), args)
    if owner is None and tenancy_on(args):
        return error_response(401, "the page's data needs one of this server's API keys")
    kvb = request.app.state.kvbranch
    if kvb.control is None:
        return error_response(
            503, "the kvbranch connector is not loaded on this server (started with --no-connector)"
        )
    try:
        engines = getattr(kvb, "engines", None)
        if isinstance(engines, Engines) and engines.several:
            stats = await gather_stats(engines.controls, GetStats(owner=owner))
        else:
            stats = await kvb.control.call(GetStats(owner=owner))
    except ControlError as exc:
        return error_response(exc.status, exc.message)
    turns: TurnLog = getattr(request.app.state, TURN_LOG_STATE)
    return JSONResponse(
        page_data(stats, turns, owner, kvb.role), headers={"Cache-Control": "no-store"}
    )
