"""``POST /v1/kvbranch/holds/claim`` (P/D decode instances): the router claims a held
conversation right before the prefill instance pulls it, so that the decode instance does not
release those blocks for new work while they are being read (see
:mod:`server.connector.transfer_auth`). 410 when the hold is already gone: the turn recomputes."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse

from server.connector.control import ControlError
from server.contract import HOLD_CLAIM_PATH

router = APIRouter(tags=["kvbranch"])


@router.post(HOLD_CLAIM_PATH)
async def claim_hold(request: Request, body: Any = Body(...)) -> Any:
    kvb = request.app.state.kvbranch
    if not isinstance(body, dict) or not isinstance(body.get("handle"), dict):
        return _error(400, "body must be {\"handle\": <transfer params a decode instance issued>}")
    if kvb.control is None:
        return _error(503, "the kvbranch connector is not loaded on this server")
    try:
        return await kvb.control.call("claim_hold", handle=body["handle"])
    except ControlError as exc:
        return _error(exc.status, exc.message)


def _error(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 410: "GoneError", 503: "ServiceUnavailableError"}.get(
        status, "Error")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)
