"""The ``/v1/kvbranch`` HTTP routes (see :mod:`server.contract` for the wire contract)."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import uuid
from typing import Any

from fastapi import APIRouter, Body, Path, Request
from fastapi.responses import JSONResponse

from server import __version__
from server.cli import ENV_ROLE
from server.connector.control import ControlError
from server.connector.planner import PREFETCH_XARG
from server.contract import (
    API_PREFIX,
    ID_PATTERN,
    PROTOCOL_VERSION,
    BranchInfo,
    CreateSessionRequest,
    DeleteResult,
    ForkRequest,
    HealthInfo,
    PinRequest,
    PrefetchResult,
    SessionInfo,
    Stats,
)
from server.plugin.tenancy import app_args_of, owner_of

logger = logging.getLogger("kvbranch.routes")

router = APIRouter(prefix=API_PREFIX, tags=["kvbranch"])

SessionId = Path(..., pattern=ID_PATTERN, description="session id")
BranchId = Path(..., pattern=ID_PATTERN, description="branch id")


def error(status: int, message: str) -> JSONResponse:
    kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
            409: "ConflictError", 422: "BadRequestError", 429: "RateLimitError",
            503: "ServiceUnavailableError"}.get(status, "ServerError")
    return JSONResponse({"error": {"message": message, "type": kind, "code": status}},
                        status_code=status)


def _kvb(request: Request) -> Any:
    return request.app.state.kvbranch


async def _call(request: Request, op: str, **args: Any) -> Any:
    kvb = _kvb(request)
    if kvb.control is None:
        raise ControlError(503, "the kvbranch connector is not loaded on this server "
                                "(started with --no-connector)")
    owner = owner_of(request.headers.get("authorization"), app_args_of(request.app))
    return await kvb.control.call(op, owner=owner, **args)


def _routed(handler):
    """Map control errors to JSON error responses with the connector's message."""
    import functools

    @functools.wraps(handler)
    async def wrapper(*args, **kwargs):
        try:
            return await handler(*args, **kwargs)
        except ControlError as exc:
            return error(exc.status, exc.message)

    return wrapper


@router.get("/health", response_model=HealthInfo)
async def health(request: Request) -> Any:
    kvb = _kvb(request)
    connector: dict[str, Any] = {"loaded": False, "name": "KVBranchConnector"}
    status = "ok"
    if kvb.control is not None:
        try:
            info = await kvb.control.call("info")
            connector.update(loaded=bool(info["enabled"]), block_size=info["block_size"],
                             store_capacity_bytes=info["store_capacity_bytes"],
                             pin_budget_bytes=info["pin_budget_bytes"],
                             platform=info["platform"])
        except ControlError:
            status = "degraded"
    return {"status": status, "kvbranch_version": __version__,
            "protocol_version": PROTOCOL_VERSION, "vllm_version": kvb.vllm_version,
            "model": kvb.model_name, "connector": connector,
            "instance_id": kvb.instance_id, "role": kvb.role}


@router.get("/stats", response_model=Stats)
@_routed
async def stats(request: Request) -> Any:
    return await _call(request, "stats")


@router.post("/sessions", response_model=SessionInfo, status_code=201)
@_routed
async def create_session(request: Request,
                         body: CreateSessionRequest = Body(default_factory=CreateSessionRequest)
                         ) -> Any:
    result = await _call(request, "create_session", session_id=body.session_id,
                         auto_pin=body.auto_pin, pin_ttl_s=body.pin_ttl_s)
    return JSONResponse(SessionInfo(**result).model_dump(), status_code=201)


@router.get("/sessions/{session_id}", response_model=SessionInfo)
@_routed
async def get_session(request: Request, session_id: str = SessionId) -> Any:
    return await _call(request, "get_session", session_id=session_id)


@router.delete("/sessions/{session_id}", response_model=DeleteResult)
@_routed
async def delete_session(request: Request, session_id: str = SessionId) -> Any:
    return await _call(request, "delete_session", session_id=session_id)


@router.get("/sessions/{session_id}/branches", response_model=list[BranchInfo])
@_routed
async def list_branches(request: Request, session_id: str = SessionId) -> Any:
    return await _call(request, "list_branches", session_id=session_id)


@router.post("/sessions/{session_id}/branches", response_model=BranchInfo, status_code=201)
@_routed
async def fork_branch(request: Request, body: ForkRequest, session_id: str = SessionId) -> Any:
    token_prefix = None
    if body.messages is not None:
        if body.token_offset is not None:
            return error(400, "give either messages or token_offset, not both")
        token_prefix = await _render(request, body.messages)
        if isinstance(token_prefix, JSONResponse):
            return token_prefix
    result = await _call(request, "fork", session_id=session_id, parent=body.parent,
                         branch_id=body.branch_id, token_offset=body.token_offset,
                         token_prefix=token_prefix)
    return JSONResponse(BranchInfo(**result).model_dump(), status_code=201)


async def _render(request: Request, messages: list[dict]) -> list[int] | JSONResponse:
    """Token ids of ``messages`` through the model's chat template (no generation prompt)."""
    kvb = _kvb(request)
    try:
        tokenizer = kvb.engine_client.get_tokenizer()
        if inspect.isawaitable(tokenizer):  # async in some vLLM releases
            tokenizer = await tokenizer
        # vLLM's chat path accepts content: null (assistant tool-call turns); templates
        # often do not, so render it as the empty string, as the chat path effectively does.
        messages = [dict(m, content="") if isinstance(m, dict) and m.get("content") is None
                    else m for m in messages]
        ids = tokenizer.apply_chat_template(messages, tokenize=True,
                                            add_generation_prompt=False)
        if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]
    except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
        return error(400, f"messages could not be rendered with the chat template: {exc}")


@router.get("/sessions/{session_id}/branches/{branch_id}", response_model=BranchInfo)
@_routed
async def get_branch(request: Request, session_id: str = SessionId,
                     branch_id: str = BranchId) -> Any:
    return await _call(request, "get_branch", session_id=session_id, branch_id=branch_id)


@router.delete("/sessions/{session_id}/branches/{branch_id}", response_model=DeleteResult)
@_routed
async def delete_branch(request: Request, session_id: str = SessionId,
                        branch_id: str = BranchId) -> Any:
    return await _call(request, "delete_branch", session_id=session_id, branch_id=branch_id)


@router.post("/sessions/{session_id}/branches/{branch_id}/pin", response_model=BranchInfo)
@_routed
async def pin_branch(request: Request, body: PinRequest, session_id: str = SessionId,
                     branch_id: str = BranchId) -> Any:
    return await _call(request, "pin", session_id=session_id, branch_id=branch_id,
                       ttl_s=body.ttl_s)


@router.delete("/sessions/{session_id}/branches/{branch_id}/pin", response_model=BranchInfo)
@_routed
async def unpin_branch(request: Request, session_id: str = SessionId,
                       branch_id: str = BranchId) -> Any:
    return await _call(request, "unpin", session_id=session_id, branch_id=branch_id)


@router.post("/sessions/{session_id}/branches/{branch_id}/prefetch",
             response_model=PrefetchResult, status_code=202)
@_routed
async def prefetch_branch(request: Request, session_id: str = SessionId,
                          branch_id: str = BranchId) -> Any:
    """Warm the device prefix cache with the branch's last sequence, in the background: the
    engine runs it as a 1-token request, so its blocks come from the device cache or the host
    store (or are recomputed), and stay cached for the branch's next turn."""
    plan = await _call(request, "prefetch_plan", session_id=session_id, branch_id=branch_id)
    tokens: list[int] = plan["token_ids"]
    kvb = _kvb(request)
    limit = kvb.max_model_len - 1
    if len(tokens) > limit:
        tokens = tokens[:limit]
    status = "scheduled" if len(tokens) > 1 else "nothing_to_do"
    if status == "scheduled" and plan.get("device_resident"):
        status = "already_resident"
    if status == "scheduled":
        kvb.start_prefetch(tokens, plan.get("cache_salt"))
    body = PrefetchResult(session_id=session_id, branch_id=branch_id, status=status,
                          num_tokens=len(tokens))
    return JSONResponse(body.model_dump(), status_code=202)


class PluginState:
    """Per-app state: the engine client, the control socket client, background prefetches."""

    def __init__(self, engine_client: Any, control: Any, model_name: str,
                 max_model_len: int) -> None:
        import vllm

        self.engine_client = engine_client
        self.control = control
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vllm_version = getattr(vllm, "__version__", "unknown")
        self.instance_id = uuid.uuid4().hex
        self.role = os.environ.get(ENV_ROLE, "single")
        self._tasks: set[asyncio.Task] = set()

    def start_prefetch(self, tokens: list[int], cache_salt: str | None) -> None:
        task = asyncio.create_task(self._prefetch(tokens, cache_salt))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prefetch(self, tokens: list[int], cache_salt: str | None) -> None:
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input

        params = SamplingParams(max_tokens=1, temperature=0.0,
                                extra_args={PREFETCH_XARG: True})
        request_id = f"kvbranch-prefetch-{uuid.uuid4().hex}"
        try:
            async for _ in self.engine_client.generate(
                    tokens_input(tokens, cache_salt=cache_salt), params, request_id):
                pass
        except Exception:  # noqa: BLE001 - a failed prefetch only costs a recompute later
            logger.exception("kvbranch prefetch %s failed", request_id)
