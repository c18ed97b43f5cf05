"""``POST /v1/kvbranch/holds/claim`` (P/D decode instances): the router claims a held
conversation right before the prefill instance pulls it, so that the decode instance does not
release those blocks for new work while they are being read (see
:mod:`server.connector.pd.transfer_auth`). 410 when the hold is already gone: the turn recomputes.

With several data-parallel engines the claim goes to the engine that issued the handle: the one
whose NIXL side channel it names (vLLM offsets the side-channel port by the engine's rank; the
handle is sealed, and an engine checks it again before anything is held).

Body :class:`~sdk.contract.HoldClaimRequest`, answer :class:`~sdk.contract.HoldClaimResult`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, Response

from sdk.contract import CLAIM_HANDLE_FIELD, HOLD_CLAIM_PATH
from server.common.env import nixl_side_channel_port
from server.common.errors import error_response
from server.connector.control.models import ClaimHold
from server.connector.control.transport import ControlError

router = APIRouter(tags=["kvbranch"])

_BAD_BODY = f'body must be {{"{CLAIM_HANDLE_FIELD}": <transfer params a decode instance issued>}}'


def issuing_engine(handle: dict[str, Any], engines: int) -> int:
    """The data-parallel engine whose side channel ``handle`` names (0 when it names none of
    them: that engine then refuses a handle it did not issue)."""
    base = nixl_side_channel_port()
    port = handle.get("remote_port")
    if engines <= 1 or base is None or type(port) is not int:
        return 0
    engine = port - base
    return engine if 0 <= engine < engines else 0


@router.post(HOLD_CLAIM_PATH)
async def claim_hold(request: Request, body: Any = Body(...)) -> Response:  # noqa: B008
    kvb = request.app.state.kvbranch
    if not isinstance(body, dict) or not isinstance(body.get(CLAIM_HANDLE_FIELD), dict):
        return error_response(400, _BAD_BODY)
    if kvb.control is None:
        return error_response(503, "the kvbranch connector is not loaded on this server")
    handle = body[CLAIM_HANDLE_FIELD]
    controls = kvb.engines.controls or [kvb.control]
    control = controls[min(issuing_engine(handle, kvb.engines.count), len(controls) - 1)]
    try:
        result = await control.call(ClaimHold(handle=handle))
    except ControlError as exc:
        return error_response(exc.status, exc.message)
    return JSONResponse(result.model_dump(mode="json"))  # a HoldClaimResult, parsed already
