"""Wire names of the kvbranch contract: route paths, headers, extension args, fields, limits and
the id/salt checks. Pure constants and functions (no pydantic, no engine): the server, the
router, the sdk and the benchmarks import every name from here (through :mod:`sdk.contract`)
so that a renamed field cannot drift between them."""

from __future__ import annotations

import re
from typing import Any

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
#: vLLM's own request/response fields kvbranch reads or sets (OpenAI-compatible bodies).
SESSION_FIELD = "session_id"
XARGS_FIELD = "vllm_xargs"
CACHE_SALT_FIELD = "cache_salt"
USAGE_FIELD = "usage"
#: ``/inference/v1/generate`` (:data:`NESTED_XARGS_PATH`): ``sampling_params.extra_args``.
SAMPLING_PARAMS_FIELD = "sampling_params"
EXTRA_ARGS_FIELD = "extra_args"
#: P/D: the field of a hold-claim answer (and of the transfer params the router passes to P)
#: that carries D's sealed claim (:class:`HoldClaim`).
CLAIM_FIELD = "kvbranch_claim"
#: The body of ``POST HOLD_CLAIM_PATH``: ``{CLAIM_HANDLE_FIELD: <transfer params D issued>}``.
CLAIM_HANDLE_FIELD = "handle"
#: vLLM's NIXL transfer-param names the router reads and sets (upstream's, not ours).
DO_REMOTE_DECODE = "do_remote_decode"
DO_REMOTE_PREFILL = "do_remote_prefill"
REMOTE_BLOCK_IDS = "remote_block_ids"
REMOTE_NUM_TOKENS = "remote_num_tokens"
#: P/D router: which way a turn went (``pd``, ``pd+pull``, ``prefill-only``, ...).
ROUTE_HEADER = "X-KVBranch-Route"
#: vLLM's OpenAI routes the sdk, the router and the fake server speak.
CHAT_COMPLETIONS_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
MODELS_PATH = "/v1/models"
#: The OpenAI completion routes kvbranch tags, guards and (in P/D) routes.
COMPLETION_PATHS = (CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH)
#: Every route of vLLM 0.32 that runs the model on a client's prompt (a superset of
#: COMPLETION_PATHS; the P/D router routes only those). The guard and the middleware cover all
#: of them: a valid key when the server has keys (``/invocations`` and ``/generative_scoring``
#: are outside vLLM's own key check), the tenant's cache salt, checked ids, no internal fields.
GENERATE_PATHS = COMPLETION_PATHS + (
    "/v1/chat/completions/batch",
    "/v1/responses",
    "/v1/messages",
    "/inference/v1/generate",
    "/invocations",
    "/v1/systemone",
    "/generative_scoring",
)
#: Generating routes whose body has no ``cache_salt`` (vLLM's Cohere API, when enabled): they
#: cannot be salted per tenant, so a server with keys refuses them.
UNSALTABLE_PATHS = ("/cohere/v2/chat",)
#: Generating routes whose bodies take no extension args from clients (only a salt is set).
NO_XARGS_PATHS = ("/v1/systemone", "/generative_scoring")
#: The route whose ``SamplingParams.extra_args`` arrive as ``sampling_params.extra_args``
#: (token in, token out); elsewhere they arrive as ``vllm_xargs``.
NESTED_XARGS_PATH = "/inference/v1/generate"
#: Set by the server (never by clients): the caller's tenant, and the prefetch marker.
OWNER_XARG = "kvbranch_owner"
PREFETCH_XARG = "kvbranch_prefetch"
#: Cache-hint dialects (server/dialects/): the routes, the clients' own fields, vLLM's
#: extension-arg name for a session id (the only way ``/v1/messages`` carries one), the pin
#: lease (seconds) the server derives from a retention/ttl hint, and the prefixes of session ids
#: derived from a ``prompt_cache_key`` that is not an id or from an Anthropic breakpoint prefix.
RESPONSES_PATH = "/v1/responses"
MESSAGES_PATH = "/v1/messages"
SESSION_XARG = "session_id"
PIN_TTL_XARG = "kvbranch_pin_ttl_s"
PROMPT_CACHE_KEY_FIELD = "prompt_cache_key"
PROMPT_CACHE_RETENTION_FIELD = "prompt_cache_retention"
PROMPT_CACHE_OPTIONS_FIELD = "prompt_cache_options"
CACHE_CONTROL_FIELD = "cache_control"
CACHE_KEY_SESSION_PREFIX = "pck-"
BREAKPOINT_SESSION_PREFIX = "cc-"
#: Stripped from every client request: only the server sets them.
INTERNAL_XARGS = (TAG_XARG, OWNER_XARG, PREFETCH_XARG, PIN_TTL_XARG)
#: Larger request bodies get 413 (server and router).
MAX_BODY_BYTES = 32 * 1024 * 1024
#: In a 409's message when a create finds its id taken (the router's fan-out counts that as
#: "already created" so a retry converges; other 409s, e.g. quotas, are failures).
ALREADY_EXISTS = "already exists"

#: Server-sent events: a data line's prefix and the blank line that ends an event.
SSE_DATA = b"data: "
SSE_EVENT_END = b"\n\n"

ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,127}$"
_ID_RE = re.compile(ID_PATTERN)
MAX_TTL_S = 24 * 3600.0
#: Deeper JSON request bodies get 400 from the guard: ``json.loads`` and every recursive
#: walk after it (re-encoding, pydantic, the dialects) would hit Python's recursion limit.
MAX_JSON_DEPTH = 100


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
        raise ValueError(
            "Parameter 'cache_salt' must be at most 128 characters and must not "
            "contain '@', '/', '\\\\', or NUL."
        )
    if has_lone_surrogate(value):  # not Unicode: no digest, prompt or answer can encode it
        raise ValueError(
            "Parameter 'cache_salt' must be valid Unicode: it contains a lone UTF-16 "
            "surrogate (\\ud800-\\udfff)."
        )


def has_lone_surrogate(text: str) -> bool:
    """Whether ``text`` holds a lone UTF-16 surrogate (JSON's ``"\\ud800"``, which
    ``json.loads`` accepts): such a string is not Unicode, and encoding it as UTF-8 raises."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def check_id(value: str, what: str = "id") -> str:
    """Ids are 1-128 characters of ``[A-Za-z0-9._:-]``, starting alphanumeric — the whole
    value (``fullmatch``: ``$`` alone would let a trailing newline through)."""
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        raise ValueError(
            f"{what} must be 1-128 characters of letters, digits, '.', '_', ':' or '-' "
            f"(starting with a letter or digit), got {value!r}"
        )
    return value
