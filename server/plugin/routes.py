"""The ``/v1/kvbranch`` HTTP routes (see :mod:`sdk.contract` for the wire contract).

Each route asks the connector one typed control op (a request model of
:mod:`server.connector.control.models`; the client parses the answer into the op's answer
model, strictly, so a field that drifted between the engine and the API process fails there)
and answers through the contract's response model (:func:`_answer`: for most routes the
answer model *is* that model). Errors are :func:`server.common.errors.error_response`.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from fastapi import APIRouter, Body, Path, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from sdk.contract import (
    API_PREFIX,
    ID_PATTERN,
    PROTOCOL_VERSION,
    BranchInfo,
    ConnectorInfo,
    CreateSessionRequest,
    DeleteResult,
    ForkRequest,
    HealthInfo,
    PinRequest,
    PrefetchRequest,
    PrefetchResult,
    SessionInfo,
    Stats,
)
from server import __version__
from server.common.errors import error_response
from server.connector.control import models as ctl
from server.connector.control.transport import ControlError
from server.plugin.engine_stats import gather_stats
from server.plugin.engines import Engines
from server.plugin.state import PluginState
from server.plugin.tenancy import app_args_of, owner_of

__all__ = ["PluginState", "router"]

router = APIRouter(prefix=API_PREFIX, tags=["kvbranch"])

SessionId = Path(..., pattern=ID_PATTERN, description="session id")
BranchId = Path(..., pattern=ID_PATTERN, description="branch id")
NewSession = Body(default_factory=CreateSessionRequest)

Handler = TypeVar("Handler", bound=Callable[..., Awaitable[Response]])
A = TypeVar("A", bound=BaseModel)


def _answer(model: type[BaseModel], data: Any, status: int = 200) -> JSONResponse:
    """``data`` as the contract's ``model`` says (validated, then serialized; an answer model
    that adds engine-only fields, like ``EngineStats``, is cut down to the public ones)."""
    if isinstance(data, BaseModel) and type(data) is not model:
        data = data.model_dump()
    return JSONResponse(model.model_validate(data).model_dump(mode="json"), status_code=status)


def _kvb(request: Request) -> PluginState:
    state: PluginState = request.app.state.kvbranch
    return state


async def _call(request: Request, op: ctl.ControlRequest[A]) -> A:
    """``op`` on behalf of the caller's tenant, asked of the engine that holds its session
    (data parallel: :mod:`server.plugin.engines`; stats of every engine, merged; engine 0 for
    the other ops without a session)."""
    kvb = _kvb(request)
    if kvb.control is None:
        raise ControlError(
            503,
            "the kvbranch connector is not loaded on this server (started with --no-connector)",
        )
    owner = owner_of(request.headers.get("authorization"), app_args_of(request.app))
    op.owner = owner
    control = kvb.control
    engines = _engines(kvb)
    if engines is not None and isinstance(op, ctl.GetStats):
        return await gather_stats(engines.controls, op)  # type: ignore[no-any-return]
    if engines is not None:
        session_id = getattr(op, "session_id", None)
        if isinstance(op, ctl.CreateSession) and session_id is None:
            # The engine is chosen by the id, so the id is made here, as the engine would.
            session_id = op.session_id = f"sess_{secrets.token_urlsafe(16)}"
        control = engines.control_for(owner, session_id) or control
    return await control.call(op)


def _engines(kvb: PluginState) -> Engines | None:
    """The data-parallel engines when there are several (else None: engine 0 serves all)."""
    engines = getattr(kvb, "engines", None)
    return engines if isinstance(engines, Engines) and engines.several else None


def _routed(handler: Handler) -> Handler:
    """Map control errors to JSON error responses with the connector's message."""

    @functools.wraps(handler)
    async def wrapper(*args: Any, **kwargs: Any) -> Response:
        try:
            return await handler(*args, **kwargs)
        except ControlError as exc:
            return error_response(exc.status, exc.message)

    return wrapper  # type: ignore[return-value]


#: The engine's ``info`` fields that health reports of the connector under the same names.
_ENGINE_INFO_FIELDS = {"block_size", "store_capacity_bytes", "pin_budget_bytes", "platform"}


@router.get("/health", response_model=HealthInfo)
async def health(request: Request) -> Response:
    kvb = _kvb(request)
    connector = ConnectorInfo(loaded=False, name="KVBranchConnector")
    status: Literal["ok", "degraded"] = "ok"
    if kvb.control is not None:
        try:
            info = await kvb.control.call(ctl.Info())
            shared = info.model_dump(include=_ENGINE_INFO_FIELDS)
            connector = ConnectorInfo.model_validate(
                {"loaded": info.enabled, "name": connector.name, **shared}
            )
        except ControlError:
            status = "degraded"
    body = HealthInfo(
        status=status,
        kvbranch_version=__version__,
        protocol_version=PROTOCOL_VERSION,
        vllm_version=kvb.vllm_version,
        model=kvb.model_name,
        connector=connector,
        instance_id=kvb.instance_id,
        role=kvb.role,
    )
    return JSONResponse(body.model_dump(mode="json"))


@router.get("/stats", response_model=Stats)
@_routed
async def stats(request: Request) -> Response:
    return _answer(Stats, await _call(request, ctl.GetStats()))


@router.post("/sessions", response_model=SessionInfo, status_code=201)
@_routed
async def create_session(request: Request, body: CreateSessionRequest = NewSession) -> Response:
    op = ctl.CreateSession(
        session_id=body.session_id, auto_pin=body.auto_pin, pin_ttl_s=body.pin_ttl_s
    )
    return _answer(SessionInfo, await _call(request, op), 201)


@router.get("/sessions/{session_id}/branches", response_model=list[BranchInfo])
@_routed
async def list_branches(request: Request, session_id: str = SessionId) -> Response:
    branches = await _call(request, ctl.ListBranches(session_id=session_id))
    return JSONResponse(branches.model_dump(mode="json"))


@router.post("/sessions/{session_id}/branches", response_model=BranchInfo, status_code=201)
@_routed
async def fork_branch(request: Request, body: ForkRequest, session_id: str = SessionId) -> Response:
    token_prefix = None
    if body.messages is not None:
        if body.token_offset is not None:
            return error_response(400, "give either messages or token_offset, not both")
        rendered = await _render(request, body.messages)
        if isinstance(rendered, Response):
            return rendered
        token_prefix = rendered
    op = ctl.Fork(
        session_id=session_id,
        parent=body.parent,
        branch_id=body.branch_id,
        token_offset=body.token_offset,
        token_prefix=token_prefix,
    )
    return _answer(BranchInfo, await _call(request, op), 201)


async def _render(request: Request, messages: list[dict[str, Any]]) -> list[int] | Response:
    """Token ids of ``messages`` through the model's chat template (no generation prompt)."""
    kvb = _kvb(request)
    try:
        tokenizer = kvb.engine_client.get_tokenizer()
        if inspect.isawaitable(tokenizer):  # async in some vLLM releases
            tokenizer = await tokenizer
        # vLLM's chat path accepts content: null (assistant tool-call turns); templates
        # often do not, so render it as the empty string, as the chat path effectively does.
        messages = [
            dict(m, content="") if isinstance(m, dict) and m.get("content") is None else m
            for m in messages
        ]
        # In a thread: a long history's template and tokenizer run would stall the event
        # loop, and every request this API process serves with it.
        ids = await asyncio.to_thread(
            tokenizer.apply_chat_template, messages, tokenize=True, add_generation_prompt=False
        )
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
        return error_response(400, f"messages could not be rendered with the chat template: {exc}")


@router.post("/sessions/{session_id}/branches/{branch_id}/pin", response_model=BranchInfo)
@_routed
async def pin_branch(
    request: Request, body: PinRequest, session_id: str = SessionId, branch_id: str = BranchId
) -> Response:
    op = ctl.Pin(session_id=session_id, branch_id=branch_id, ttl_s=body.ttl_s)
    return _answer(BranchInfo, await _call(request, op))


@router.post(
    "/sessions/{session_id}/branches/{branch_id}/prefetch",
    response_model=PrefetchResult,
    status_code=202,
)
@_routed
async def prefetch_branch(
    request: Request,
    body: PrefetchRequest | None = None,
    session_id: str = SessionId,
    branch_id: str = BranchId,
) -> Response:
    """Make the branch's next turn start warm. When its blocks are already in the device cache
    or (unless ``to_device``) all in the host store, nothing runs; otherwise the engine runs its
    last sequence as a 1-token request in the background, so that its blocks come from the
    device cache or the host store (or are recomputed) and stay cached for the next turn."""
    to_device = body.to_device if body is not None else False
    op = ctl.PlanPrefetch(session_id=session_id, branch_id=branch_id, to_device=to_device)
    plan = await _call(request, op)
    tokens = plan.token_ids
    kvb = _kvb(request)
    limit = kvb.max_model_len - 1
    if len(tokens) > limit:
        tokens = tokens[:limit]
    status = "scheduled" if len(tokens) > 1 else "nothing_to_do"
    if status == "scheduled":
        if plan.location is not None:
            status = {"device": "already_resident", "host": "in_host_store"}[plan.location]
    if status == "scheduled":
        owner = owner_of(request.headers.get("authorization"), app_args_of(request.app))
        engines = _engines(kvb)
        if engines is not None:
            kvb.start_prefetch(tokens, plan.cache_salt, engines.engine_for(owner, session_id))
        else:
            kvb.start_prefetch(tokens, plan.cache_salt)
    result = {
        "session_id": session_id,
        "branch_id": branch_id,
        "status": status,
        "num_tokens": len(tokens),
    }
    return _answer(PrefetchResult, result, 202)


# --- the routes that are one control op answered by one model ------------------------------
def _session_op(
    op: type[ctl.SessionRequest[Any]], model: type[BaseModel]
) -> Callable[..., Awaitable[Response]]:
    async def handler(request: Request, session_id: str = SessionId) -> Response:
        return _answer(model, await _call(request, op(session_id=session_id)))

    return _routed(handler)


def _branch_op(
    op: type[ctl.BranchRequest[Any]], model: type[BaseModel]
) -> Callable[..., Awaitable[Response]]:
    async def handler(
        request: Request, session_id: str = SessionId, branch_id: str = BranchId
    ) -> Response:
        return _answer(model, await _call(request, op(session_id=session_id, branch_id=branch_id)))

    return _routed(handler)


_SESSION = "/sessions/{session_id}"
_BRANCH = _SESSION + "/branches/{branch_id}"
for _method, _path, _req, _model in (
    ("GET", _SESSION, ctl.GetSession, SessionInfo),
    ("DELETE", _SESSION, ctl.DeleteSession, DeleteResult),
    ("GET", _BRANCH, ctl.GetBranch, BranchInfo),
    ("DELETE", _BRANCH, ctl.DeleteBranch, DeleteResult),
    ("DELETE", _BRANCH + "/pin", ctl.Unpin, BranchInfo),
):
    _build = _branch_op if issubclass(_req, ctl.BranchRequest) else _session_op
    router.add_api_route(
        _path, _build(_req, _model), methods=[_method], response_model=_model, name=_req.op
    )
