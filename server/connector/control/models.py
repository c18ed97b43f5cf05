"""The control socket's ops, typed: one pydantic model per request and per answer.

Why: the API process (routes, middleware, metrics, hold claims) and the engine core (the op
handlers in ``control/ops.py``) are two processes of one install that speak JSON lines to each
other. With bare op names, kwargs and hand-built dicts a renamed field only showed up as a
``KeyError`` (or a silent default) somewhere downstream. Here each op is a request class that
names its op and, through its type parameter, its answer model; both ends build and parse
through them (:func:`request_line`, :func:`parse_request`, :func:`parse_answer`), strictly
(unknown fields are errors, at every depth), so a drifted field fails at the boundary, naming it.

Where an answer *is* a public response (``SessionInfo``, ``BranchInfo``, ``DeleteResult``,
``HoldClaimResult``, ``Stats`` plus what only the engine reports) the contract's model is the
answer model: no second copy to keep in step. Pure pydantic + :mod:`sdk.contract` (no engine,
no torch): the API process imports it without the connector.
"""

from __future__ import annotations

from typing import Any, ClassVar, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError

from sdk.contract import (
    DEFAULT_BRANCH,
    TRANSFER_PARAMS_FIELD,
    BranchInfo,
    DeleteResult,
    HoldClaimResult,
    PromptSourceSplit,
    SessionInfo,
    Stats,
    StoreStats,
)


class ControlError(Exception):
    """A control op's failure with the HTTP status the routes answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


#: Both ends run from one install, so neither tolerates a field the other does not know.
STRICT: Literal["forbid"] = "forbid"

A = TypeVar("A", bound=BaseModel)


def describe(exc: ValidationError) -> str:
    """``field 'a.0.b': message; ...``: pydantic's errors, each naming its field."""
    parts = []
    for error in exc.errors():
        loc = ".".join(str(p) for p in error["loc"]) or "(root)"
        parts.append(f"field {loc!r}: {error['msg']}")
    return "; ".join(parts)


# --- answers only the engine gives ---------------------------------------------------------------
class _Internal(BaseModel):
    model_config = ConfigDict(extra="forbid")


class EngineInfo(_Internal):
    """``info``: what ``/v1/kvbranch/health`` reports of the connector."""

    block_size: int
    block_bytes: int
    num_slots: int
    enabled: bool
    store_capacity_bytes: int
    pin_budget_bytes: int
    platform: Literal["cuda", "cpu"]


BranchList = RootModel[list[BranchInfo]]


class PrefetchPlan(_Internal):
    """``prefetch_plan``: the branch's last sequence, and where its blocks already are
    (``None``: neither the device cache nor the host store holds all of them)."""

    token_ids: list[int]
    cache_salt: str | None = None
    location: Literal["device", "host"] | None = None


class RequestSplit(PromptSourceSplit):
    """A finished request's split as the engine keeps it: the public split, plus the transfer
    params a P/D transfer connector returned (the middleware moves them where vLLM puts them)."""

    kv_transfer_params: dict[str, Any] | None = None


assert TRANSFER_PARAMS_FIELD in RequestSplit.model_fields, "RequestSplit: TRANSFER_PARAMS_FIELD"

#: ``None`` when the engine has no split under that tag (yet, or any more).
SplitAnswer = RootModel[RequestSplit | None]


class EngineStoreStats(StoreStats):
    pin_budget_used_bytes: int


class SchedulerStats(_Internal):
    """The warm-first scheduler's counters (:mod:`server.engine.scheduler_counters`)."""

    preemptions: int
    backfills: int
    passed_requests: int
    paused_steps: int


class EngineStats(Stats):
    """``stats``: the public :class:`~sdk.contract.Stats` plus what only metrics read."""

    store: EngineStoreStats
    num_sessions: int
    remote_failed_tokens: int
    time: float
    #: ``None`` where the warm-first scheduler does not run (FCFS, CUDA).
    scheduler: SchedulerStats | None = None


class ResetResult(_Internal):
    dropped_blocks: int


class HostCoverageResult(_Internal):
    """``host_coverage``: how much of a turn's prefix the host store could load now."""

    #: Leading blocks of the asked hashes the host store holds.
    blocks: int
    #: Whether a request with the asked cache salt (no adapter, no media) on this engine has
    #: the asked identity, i.e. the same block hashes.
    identity_ok: bool


#: Most token ids one ``run_coverage`` hashes (a revive's size limit, ``revive_rules.py``).
RUN_COVERAGE_MAX_TOKENS = 65_536


class RunCoverageResult(_Internal):
    """``run_coverage``: a prompt's chained block hashes on this engine, and how many of its
    leading blocks the host store holds with the very same token ids."""

    #: The prompt's full blocks' hashes (hex), in order, as this engine hashes them.
    hashes: list[str]
    #: Leading blocks stored in the host store whose slots hold the prompt's token ids.
    blocks: int
    #: The identity a request with the asked cache salt (no adapter, no media) has here.
    identity: str


# --- requests ----------------------------------------------------------------------------------
class ControlRequest(BaseModel, Generic[A]):
    """One op's request. Subclasses set :attr:`op` and parametrize the base with their answer
    model (``class GetSession(ControlRequest[SessionInfo])``): the type checker then knows what
    ``await client.call(GetSession(...))`` returns, and :attr:`answer` is read from it."""

    model_config = ConfigDict(extra="forbid")

    op: ClassVar[str]
    answer: ClassVar[type[BaseModel]]
    #: The tenant the API process resolved from the caller's key (None without tenants).
    owner: str | None = None

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        for base in cls.__mro__:  # the first base parametrized with a model, not a TypeVar
            meta = getattr(base, "__pydantic_generic_metadata__", None) or {}
            args = meta.get("args") or ()
            if args and isinstance(args[0], type):
                cls.answer = args[0]
                return


class SessionRequest(ControlRequest[A], Generic[A]):
    """An op on one session: the fields every such op names, declared once."""

    session_id: str


class BranchRequest(SessionRequest[A], Generic[A]):
    """An op on one branch of a session."""

    branch_id: str


class Info(ControlRequest[EngineInfo]):
    op = "info"


class CreateSession(ControlRequest[SessionInfo]):
    op = "create_session"
    session_id: str | None = None
    auto_pin: bool = True
    pin_ttl_s: float | None = None


class GetSession(SessionRequest[SessionInfo]):
    op = "get_session"


class DeleteSession(SessionRequest[DeleteResult]):
    op = "delete_session"


class ListBranches(SessionRequest[BranchList]):
    op = "list_branches"


class GetBranch(BranchRequest[BranchInfo]):
    op = "get_branch"


class Fork(SessionRequest[BranchInfo]):
    op = "fork"
    parent: str = DEFAULT_BRANCH
    branch_id: str | None = None
    token_offset: int | None = None
    #: The rendered chat messages to fork at (the API process tokenizes them).
    token_prefix: list[int] | None = None


class DeleteBranch(BranchRequest[DeleteResult]):
    op = "delete_branch"


class Pin(BranchRequest[BranchInfo]):
    op = "pin"
    ttl_s: float


class Unpin(BranchRequest[BranchInfo]):
    op = "unpin"


class PlanPrefetch(BranchRequest[PrefetchPlan]):
    op = "prefetch_plan"
    to_device: bool = False


class Split(ControlRequest[SplitAnswer]):
    """The middleware's look-up of one finished request's prompt-source split, by its tag."""

    op = "split"
    tag: str


class GetStats(ControlRequest[EngineStats]):
    op = "stats"
    #: The admin view (metrics): no per-session listing.
    all_owners: bool = False


class ResetStore(ControlRequest[ResetResult]):
    op = "reset_store"


class ClaimHold(ControlRequest[HoldClaimResult]):
    """P/D decode instances: the router's claim (``holds.py``); handled in
    ``pd/verified_nixl.py``."""

    op = "claim_hold"
    handle: dict[str, Any]


class HostCoverage(ControlRequest[HostCoverageResult]):
    """Aggregated replicas: before a revive runs anything, the host store's cover of the
    branch's prefix (``server/plugin/revive.py``); handled in ``pd/host_coverage.py``."""

    op = "host_coverage"
    #: The turn's chained block hashes (hex), in order.
    hashes: list[str]
    identity: str
    cache_salt: str | None = None


class RunCoverage(ControlRequest[RunCoverageResult]):
    """Aggregated replicas: a prompt's block hashes (the asking side's index lookup) and the
    host store's cover of them, token ids compared (the holder's check before a block-run
    revive runs anything, ``server/plugin/revive.py``); handled in ``pd/host_coverage.py``."""

    op = "run_coverage"
    token_ids: list[int] = Field(max_length=RUN_COVERAGE_MAX_TOKENS)
    cache_salt: str | None = None


#: Every op's request class by op name (the P/D ``claim_hold`` included).
REQUESTS: dict[str, type[ControlRequest[Any]]] = {}


def _collect(cls: type[ControlRequest[Any]]) -> None:
    for sub in cls.__subclasses__():
        if "op" in sub.__dict__:
            REQUESTS[sub.op] = sub
        _collect(sub)


_collect(ControlRequest)


# --- both ends -----------------------------------------------------------------------------------
def request_line(request: ControlRequest[Any]) -> dict[str, Any]:
    """The wire object of ``request``: ``{"op": ..., **fields}``."""
    return {"op": request.op, **request.model_dump(mode="json")}


def parse_request(
    line: dict[str, Any], requests: dict[str, type[ControlRequest[Any]]] = REQUESTS
) -> ControlRequest[Any]:
    """The server's side: ``line`` as its op's request model; an unknown op or a bad, missing
    or unknown field is a :class:`ControlError` 400 that names it."""
    fields = dict(line)
    op = fields.pop("op", None)
    cls = requests.get(op) if isinstance(op, str) else None
    if cls is None:
        raise ControlError(400, f"unknown control op {op!r}")
    try:
        return cls.model_validate(fields)
    except ValidationError as exc:
        raise ControlError(400, f"control op {op!r}: {describe(exc)}") from None


def check_answer(model: type[A], data: Any, op: str, who: str) -> A:
    """``data`` as ``model``, strictly; a mismatch is a :class:`ControlError` 500 naming the
    field (``who``: which end refused it, for the message)."""
    try:
        return model.model_validate(data, extra=STRICT)
    except ValidationError as exc:
        raise ControlError(
            500,
            f"{who}: the answer to control op {op!r} does not match {model.__name__}: "
            f"{describe(exc)}",
        ) from None


def parse_answer(request: ControlRequest[A], data: Any) -> A:
    """The client's side: the engine's ``result`` as ``request``'s answer model."""
    answer: A = check_answer(request.answer, data, request.op, "kvbranch API")  # type: ignore[assignment]
    return answer
