"""The wire contract between kvbranch clients (sdk/) and the server: route paths, request and
response bodies, and how a chat request carries its session and branch.

This module is the single source of truth: the server's routes validate against these models,
and the sdk imports them (it depends on pydantic only — no engine imports here, ever).

How a chat completion names its session and branch (OpenAI-compatible body):

* ``session_id`` — vLLM 0.32's own field (or the ``X-Session-ID`` header). vLLM puts it on the
  engine ``Request`` that the KV connector sees.
* ``vllm_xargs["kvbranch_branch"]`` — the branch id (default ``"main"``); or the
  ``X-KVBranch-Branch`` header, which the server copies into ``vllm_xargs``. ``vllm_xargs`` is
  vLLM's supported channel for extension parameters (it lands in
  ``SamplingParams.extra_args``).

Where the prompt's tokens came from is reported on every completion as a top-level ``kvbranch``
object (:class:`PromptSourceSplit`) — in the JSON body, and in the final usage chunk of a stream
(``stream_options.include_usage=true``). ``usage.prompt_tokens_details.cached_tokens`` stays
vLLM's own number (device hits + host-store loads).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

API_PREFIX = "/v1/kvbranch"  # under /v1, so vLLM's --api-key check guards it
PROTOCOL_VERSION = "1"

HEALTH_PATH = f"{API_PREFIX}/health"
STATS_PATH = f"{API_PREFIX}/stats"
SESSIONS_PATH = f"{API_PREFIX}/sessions"
#: P/D only: the router claims a decode instance's held conversation right before P pulls it.
HOLD_CLAIM_PATH = f"{API_PREFIX}/holds/claim"


def session_path(session_id: str) -> str:
    return f"{SESSIONS_PATH}/{session_id}"


def branches_path(session_id: str) -> str:
    return f"{session_path(session_id)}/branches"


def branch_path(session_id: str, branch_id: str) -> str:
    return f"{branches_path(session_id)}/{branch_id}"


def pin_path(session_id: str, branch_id: str) -> str:
    return f"{branch_path(session_id, branch_id)}/pin"


def prefetch_path(session_id: str, branch_id: str) -> str:
    return f"{branch_path(session_id, branch_id)}/prefetch"


# --- request identity -----------------------------------------------------------------------
SESSION_HEADER = "X-Session-ID"
BRANCH_HEADER = "X-KVBranch-Branch"
BRANCH_XARG = "kvbranch_branch"
#: Set by the server (never by clients) to find a request's accounting after it finished.
TAG_XARG = "kvbranch_tag"
DEFAULT_BRANCH = "main"
RESPONSE_FIELD = "kvbranch"
#: vLLM's field for KV-transfer params (P/D); a streaming response carries it in its usage chunk.
TRANSFER_PARAMS_FIELD = "kv_transfer_params"
#: The OpenAI completion routes kvbranch tags, guards and (in P/D) routes.
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions")
#: Every route of vLLM 0.32 that runs the model on a client's prompt (a superset of
#: COMPLETION_PATHS; the P/D router routes only those). The guard and the middleware cover all
#: of them: a valid key when the server has keys (``/invocations`` and ``/generative_scoring``
#: are outside vLLM's own key check), the tenant's cache salt, checked ids, no internal fields.
GENERATE_PATHS = COMPLETION_PATHS + (
    "/v1/chat/completions/batch", "/v1/responses", "/v1/messages", "/inference/v1/generate",
    "/invocations", "/v1/systemone", "/generative_scoring")
#: Generating routes whose body has no ``cache_salt`` (vLLM's Cohere API, when enabled): they
#: cannot be salted per tenant, so a server with keys refuses them.
UNSALTABLE_PATHS = ("/cohere/v2/chat",)
#: The route whose ``SamplingParams.extra_args`` arrive as ``sampling_params.extra_args``
#: (token in, token out); elsewhere they arrive as ``vllm_xargs``.
NESTED_XARGS_PATH = "/inference/v1/generate"
#: Set by the server (never by clients): the caller's tenant, and the prefetch marker.
OWNER_XARG = "kvbranch_owner"
PREFETCH_XARG = "kvbranch_prefetch"
#: Stripped from every client request: only the server sets them.
INTERNAL_XARGS = (TAG_XARG, OWNER_XARG, PREFETCH_XARG)
#: Larger request bodies get 413 (server and router).
MAX_BODY_BYTES = 32 * 1024 * 1024
#: In a 409's message when a create finds its id taken (the router's fan-out counts that as
#: "already created" so a retry converges; other 409s, e.g. quotas, are failures).
ALREADY_EXISTS = "already exists"

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_ID_RE = re.compile(ID_PATTERN)
MAX_TTL_S = 24 * 3600.0


#: vLLM's rules for ``cache_salt`` (``validate_cache_salt``): checked before kvbranch derives
#: a tenant's salt from it, so a bad one gets vLLM's answer, not a silently valid salt.
MAX_CACHE_SALT_CHARS = 128
_CACHE_SALT_FORBIDDEN = frozenset("@/\\\x00")


def check_cache_salt(value: Any) -> None:
    """``None`` or 1-128 characters without ``@``, ``/``, ``\\`` or NUL, as vLLM requires."""
    if value is None:
        return
    if not isinstance(value, str) or not value:
        raise ValueError("Parameter 'cache_salt' must be a non-empty string if provided.")
    if len(value) > MAX_CACHE_SALT_CHARS or any(c in _CACHE_SALT_FORBIDDEN for c in value):
        raise ValueError("Parameter 'cache_salt' must be at most 128 characters and must not "
                         "contain '@', '/', '\\\\', or NUL.")


def check_id(value: str, what: str = "id") -> str:
    """Ids are 1-128 characters of ``[A-Za-z0-9._:-]``, starting alphanumeric."""
    if not isinstance(value, str) or not _ID_RE.match(value):
        raise ValueError(
            f"{what} must be 1-128 characters of letters, digits, '.', '_', ':' or '-' "
            f"(starting with a letter or digit), got {value!r}"
        )
    return value


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


# --- requests --------------------------------------------------------------------------------
class CreateSessionRequest(_Strict):
    session_id: str | None = Field(None, description="Chosen id; the server makes an "
                                   "unguessable one when omitted.")
    pin_ttl_s: float | None = Field(None, gt=0, le=MAX_TTL_S, description="Pin every "
                                    "branch of this session for this long after each use "
                                    "(server default when omitted; 0 is not allowed, use "
                                    "auto_pin=false).")
    auto_pin: bool = True

    @field_validator("session_id")
    @classmethod
    def _check_session_id(cls, value: str | None) -> str | None:
        return None if value is None else check_id(value, "session_id")


class ForkRequest(_Strict):
    parent: str = Field(DEFAULT_BRANCH, description="Branch to fork from.")
    branch_id: str | None = Field(None, description="Id of the new branch (server-made "
                                  "when omitted).")
    token_offset: int | None = Field(None, ge=0, description="Fork after this many tokens of "
                                     "the parent's last sequence (default: all of it).")
    messages: list[dict[str, Any]] | None = Field(None, description="Fork at the point where "
                                                  "these chat messages end (rendered with the "
                                                  "model's chat template).")

    @field_validator("parent", "branch_id")
    @classmethod
    def _check_ids(cls, value: str | None) -> str | None:
        return None if value is None else check_id(value, "branch id")


class PinRequest(_Strict):
    ttl_s: float = Field(..., gt=0, le=MAX_TTL_S, description="Lease length in seconds; "
                         "each use of the branch renews it.")


# --- responses -------------------------------------------------------------------------------
class BranchInfo(BaseModel):
    session_id: str
    branch_id: str
    parent: str | None = None
    fork_offset_tokens: int | None = None
    num_tokens: int = Field(0, description="Tokens of the branch's last known sequence.")
    pinned: bool = False
    pin_expires_in_s: float | None = None
    pinned_blocks: int = 0
    pinned_bytes: int = 0
    stored_blocks: int = Field(0, description="Blocks of the branch present in the host store.")
    degraded: bool = Field(False, description="The pin was demoted to LRU retention because "
                           "the pin budget was full.")
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
    status: Literal["scheduled", "nothing_to_do", "already_resident"] = Field(
        description="already_resident: every full block of the branch is in the device prefix "
                    "cache, so nothing ran.")
    num_tokens: int


class PromptSourceSplit(BaseModel):
    """Where a completion's prompt tokens came from."""

    session_id: str | None = None
    branch_id: str | None = None
    prompt_tokens: int
    device_hit_tokens: int = Field(description="Reused from vLLM's on-device prefix cache.")
    host_hit_tokens: int = Field(description="Loaded from the kvbranch host store.")
    remote_hit_tokens: int = Field(0, description="Pulled from a peer instance (P/D: the "
                                   "decode instance that holds the conversation).")
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
    instance_id: str | None = Field(None, description="Random per server start: a router "
                                    "notices a restarted peer by it.")
    role: str | None = Field(None, description="single, prefill, decode or router.")


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


class Stats(BaseModel):
    store: StoreStats
    hits_tokens: dict[str, int] = Field(description="Prompt tokens by source: device, host, "
                                        "recomputed.")
    requests: int
    pins_degraded: int
    pins_refused: int
    prefetches: int = Field(description="Prefetches that ran in the engine.")
    prefetches_skipped: int = Field(0, description="Prefetch requests skipped because the "
                                    "branch was already device-resident.")
    sessions: list[SessionInfo]
    pd: dict[str, Any] | None = Field(None, description="P/D instances: held conversations, "
                                      "holds released for new work, claims, declined handles.")


class ErrorBody(BaseModel):
    error: dict[str, Any]
