"""Pydantic models of the kvbranch contract: request bodies the server validates, and every
response it (or the P/D router) returns — sessions, branches, forks, pins, prefetch, stats and
accounting, hold claims, errors. The server builds its responses through them and the sdk and
:mod:`sdk.testing` parse and build through them, so a field that drifts fails loudly."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from sdk.contract.wire import (
    CLAIM_FIELD,
    CLAIM_HANDLE_FIELD,
    DEFAULT_BRANCH,
    MAX_TTL_S,
    PROTOCOL_VERSION,
    check_id,
)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- requests --------------------------------------------------------------------------------
class CreateSessionRequest(_Strict):
    session_id: str | None = Field(
        default=None, description="Chosen id; the server makes an unguessable one when omitted."
    )
    pin_ttl_s: float | None = Field(
        default=None,
        gt=0,
        le=MAX_TTL_S,
        description="Pin every "
        "branch of this session for this long after each use "
        "(server default when omitted; 0 is not allowed, use "
        "auto_pin=false).",
    )
    auto_pin: bool = True

    @field_validator("session_id")
    @classmethod
    def _check_session_id(cls, value: str | None) -> str | None:
        return None if value is None else check_id(value, "session_id")


class ForkRequest(_Strict):
    parent: str = Field(default=DEFAULT_BRANCH, description="Branch to fork from.")
    branch_id: str | None = Field(
        default=None, description="Id of the new branch (server-made when omitted)."
    )
    token_offset: int | None = Field(
        default=None,
        ge=0,
        description="Fork after this many tokens of "
        "the parent's last sequence (default: all of it).",
    )
    messages: list[dict[str, Any]] | None = Field(
        default=None,
        description="Fork at the point where "
        "these chat messages end (rendered with the "
        "model's chat template).",
    )

    @field_validator("parent", "branch_id")
    @classmethod
    def _check_ids(cls, value: str | None) -> str | None:
        return None if value is None else check_id(value, "branch id")


class PinRequest(_Strict):
    ttl_s: float = Field(
        ...,
        gt=0,
        le=MAX_TTL_S,
        description="Lease length in seconds; each use of the branch renews it.",
    )


class PrefetchRequest(_Strict):
    to_device: bool = Field(
        default=False,
        description="Run the branch through the engine even when the host store holds all of "
        "it. By default such a prefetch only keeps the branch's blocks in the host store (the "
        "next turn loads them with one copy) and costs no engine step.",
    )


# --- responses -------------------------------------------------------------------------------
class BranchInfo(BaseModel):
    session_id: str
    branch_id: str
    parent: str | None = None
    fork_offset_tokens: int | None = None
    num_tokens: int = Field(default=0, description="Tokens of the branch's last known sequence.")
    pinned: bool = False
    pin_expires_in_s: float | None = None
    pinned_blocks: int = 0
    pinned_bytes: int = 0
    stored_blocks: int = Field(
        default=0, description="Blocks of the branch present in the host store."
    )
    degraded: bool = Field(
        default=False,
        description="The pin was demoted to LRU retention because the pin budget was full.",
    )
    requests: int = 0


class SessionInfo(BaseModel):
    session_id: str
    created_at: float
    auto_pin: bool
    pin_ttl_s: float
    branches: list[BranchInfo]
    pinned_blocks: int = 0
    pinned_bytes: int = 0


class DeleteResult(BaseModel):
    deleted: str
    released_blocks: int


class PrefetchResult(BaseModel):
    session_id: str
    branch_id: str
    status: Literal["scheduled", "nothing_to_do", "already_resident", "in_host_store"] = Field(
        description="scheduled: the engine runs the branch as a 1-token request. "
        "already_resident: every full block of the branch is in the device prefix cache, so "
        "nothing ran. in_host_store: the host store holds every block of the branch, so nothing "
        "ran either; its blocks were marked recently used (ask with to_device to run it anyway)."
    )
    num_tokens: int


class PromptSourceSplit(BaseModel):
    """Where a completion's prompt tokens came from."""

    session_id: str | None = None
    branch_id: str | None = None
    prompt_tokens: int
    device_hit_tokens: int = Field(description="Reused from vLLM's on-device prefix cache.")
    host_hit_tokens: int = Field(description="Loaded from the kvbranch host store.")
    remote_hit_tokens: int = Field(
        default=0,
        description="Pulled from a peer instance (P/D: the "
        "decode instance that holds the conversation).",
    )
    recomputed_tokens: int = Field(description="Prefilled from scratch.")


class ConnectorInfo(BaseModel):
    loaded: bool
    name: str
    block_size: int | None = None
    store_capacity_bytes: int | None = None
    pin_budget_bytes: int | None = None
    platform: str | None = None


class HealthInfo(BaseModel):
    status: Literal["ok", "degraded"]
    kvbranch_version: str
    protocol_version: str = PROTOCOL_VERSION
    vllm_version: str
    model: str
    connector: ConnectorInfo
    instance_id: str | None = Field(
        default=None,
        description="Random per server start: a router notices a restarted peer by it.",
    )
    role: str | None = Field(default=None, description="single, prefill, decode or router.")


class PDStats(BaseModel):
    """P/D instances (``Stats.pd``): holds a decode instance keeps for the prefill instance's
    next pull, and why handles were declined."""

    holds: int
    held_blocks: int
    #: Holds placed since the start (``holds`` counts those alive now: leases expire).
    holds_placed: int = 0
    holds_released_for_new_work: int
    claims: int
    claims_refused: int
    stalled_steps: int
    handles_declined: dict[str, int] = Field(default_factory=dict)
    #: Requests the scheduler was told would load from a peer but for which no read was
    #: queued (a declined or failed handle): their tokens were recomputed.
    reads_not_queued: int = 0
    #: Pulls loaded before the step's forward (the forward waited for the read) rather than
    #: asynchronously: the turn's own tokens were computed in the step its read ran in.
    sync_reads: int = 0
    #: Of those, the ones that did not land before the forward (failed, the peer's handshake
    #: still running, or past the wait): their tokens were recomputed.
    sync_reads_not_landed: int = 0
    #: Pulls given up (past the synchronous wait or ``pull_timeout_s``) while NIXL still had
    #: them in flight: recomputed, their blocks kept out of the free pool until they ended.
    late_reads: int = 0
    #: The blocks such reads still pin now.
    late_read_blocks_pinned: int = 0


class InstanceInfo(BaseModel):
    """One instance behind the P/D router, as the router sees it."""

    url: str
    role: str
    alive: bool
    instance_id: str | None = None
    inflight: int = 0
    #: Of those, requests whose prompt it is computing (what the decode-local rule weighs).
    prefilling: int = 0
    requests: int = 0
    failures: int = 0
    #: Named by ``--prefill``/``--decode``, or listed by the shared index (its heartbeat
    #: lives). A router sends turns only to instances that are alive and listed.
    listed: bool = True


class IndexEntry(BaseModel):
    """The router's cluster index: which decode instance holds a branch's conversation."""

    session_id: str
    branch_id: str
    decode: str
    tokens: int
    expires_in_s: float


class ClusterInfo(BaseModel):
    """``Stats.cluster``, added by the P/D router."""

    instances: list[InstanceInfo]
    index: list[IndexEntry]
    index_counters: dict[str, int]
    hold_ttl_s: float


class RouterHealthInfo(BaseModel):
    """The P/D router's health: a prefill instance's :class:`HealthInfo` (absent fields when
    none answered) plus the router's view of every instance."""

    status: Literal["ok", "degraded"]
    role: str = "router"
    protocol_version: str = PROTOCOL_VERSION
    instances: list[InstanceInfo]
    kvbranch_version: str | None = None
    vllm_version: str | None = None
    model: str | None = None
    connector: ConnectorInfo | None = None
    instance_id: str | None = None


class HoldClaimRequest(BaseModel):
    """``POST HOLD_CLAIM_PATH``: the transfer params a decode instance issued."""

    handle: dict[str, Any]


assert CLAIM_HANDLE_FIELD in HoldClaimRequest.model_fields, "HoldClaimRequest: CLAIM_HANDLE_FIELD"


class HoldClaim(BaseModel):
    """D's sealed promise not to release the held blocks before ``until`` (wall clock);
    ``until_perf`` is the same deadline on D's ``perf_counter`` clock."""

    handle: str | None
    until: float
    until_perf: float
    mac: str


class HoldClaimResult(BaseModel):
    """The answer to a hold claim: ``{CLAIM_FIELD: {...}}`` (the field is spelled out for the
    type checker; the check below ties it to :data:`CLAIM_FIELD`)."""

    kvbranch_claim: HoldClaim


assert CLAIM_FIELD in HoldClaimResult.model_fields, "HoldClaimResult must carry CLAIM_FIELD"


class StoreStats(BaseModel):
    capacity_blocks: int
    used_blocks: int
    pinned_blocks: int
    block_bytes: int
    used_bytes: int
    pin_budget_bytes: int
    pinned_bytes: int
    evictions: int
    saved_blocks: int
    loaded_blocks: int
    saved_tails: int = Field(
        default=0, description="Partial last blocks kept for token-exact reuse."
    )
    loaded_tails: int = Field(default=0, description="Stored tails loaded into a new prompt.")
    tail_tokens_loaded: int = Field(default=0, description="Prompt tokens those tail loads served.")
    saved_states: int = Field(
        default=0,
        description="Recurrent states (Mamba, Gated DeltaNet) kept with a block at its end.",
    )
    loaded_states: int = Field(default=0, description="Stored states a hit resumed from.")
    window_part_bytes: int = Field(
        default=0,
        description="Bytes of one window part: the sliding-window / chunked-local layers' "
        "block of a position, kept only near resume points (0: no such layers).",
    )
    window_parts_capacity: int = Field(default=0, description="Window parts the store holds.")
    window_parts_used: int = Field(default=0, description="Window parts stored now.")
    saved_window_parts: int = Field(default=0, description="Window parts copied in.")
    loaded_window_parts: int = Field(default=0, description="Window parts a hit loaded.")
    window_part_evictions: int = Field(default=0, description="Parts dropped for newer ones.")
    window_parts_released: int = Field(
        default=0, description="Parts freed when their request ended: no resume reads them."
    )
    state_part_bytes: int = Field(
        default=0,
        description="Bytes of one state part: the recurrent-state layers' state after a block, "
        "kept where vLLM keeps one and, once a request ends, at its resume points (0: none).",
    )
    state_parts_capacity: int = Field(default=0, description="State parts the store holds.")
    state_parts_used: int = Field(default=0, description="State parts stored now.")
    state_parts_released: int = Field(
        default=0, description="State parts freed when their request ended (not a resume point)."
    )
    window_cuts: int = Field(
        default=0, description="Host hits shortened to where the window's parts are stored."
    )
    window_misses: int = Field(
        default=0, description="Loads of a position without its window part (never expected)."
    )


class Stats(BaseModel):
    store: StoreStats
    hits_tokens: dict[str, int] = Field(
        description="Prompt tokens by source: device, host, recomputed."
    )
    requests: int
    pins_degraded: int
    pins_refused: int
    prefetches: int = Field(description="Prefetches that ran in the engine.")
    prefetches_skipped: int = Field(
        default=0,
        description="Prefetch requests that did not run in the engine: the branch was already "
        "device-resident, or the host store held all of it.",
    )
    sessions: list[SessionInfo] = Field(
        description="The caller's most recently used sessions (at most 100; with a bounded "
        "block walk: past it, their block counts read 0 — a session's own route counts all)."
    )
    num_own_sessions: int = Field(default=0, description="All of the caller's sessions.")
    store_resets: int = Field(
        default=0,
        description="Times the host store was emptied (reset_external, new weights, a LoRA "
        "reloaded or removed): pins and tails included.",
    )
    pd: PDStats | None = Field(
        default=None,
        description="P/D instances: held conversations, "
        "holds released for new work, claims, declined handles.",
    )


class RouterStats(Stats):
    """``STATS_PATH`` through the P/D router: a prefill instance's stats plus the cluster."""

    cluster: ClusterInfo


# --- errors ----------------------------------------------------------------------------------
#: The ``error.type`` of each status (OpenAI's names where it has one).
ERROR_TYPES: dict[int, str] = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    408: "RequestTimeoutError",
    409: "ConflictError",
    410: "GoneError",
    413: "RequestTooLargeError",
    422: "BadRequestError",
    429: "RateLimitError",
    502: "BadGatewayError",
    503: "ServiceUnavailableError",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "ServerError" if status >= 500 else "Error")


class ErrorDetail(BaseModel):
    """OpenAI's error shape. Extra fields are kept (the router's fan-out adds ``instances``)."""

    model_config = ConfigDict(extra="allow")

    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(BaseModel):
    """Every kvbranch error response (server, router, guard): ``{"error": {...}}``."""

    error: ErrorDetail


def error_body(status: int, message: str, param: str | None = None, **extra: Any) -> dict[str, Any]:
    """The JSON body of a kvbranch error, built through :class:`ErrorBody`."""
    detail = ErrorDetail(
        message=message, type=error_type(status), param=param, code=status, **extra
    )
    return ErrorBody(error=detail).model_dump()
