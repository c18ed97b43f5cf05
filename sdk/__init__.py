"""kvbranch sdk: a sync and an async client for kvbranch (and any OpenAI-compatible) servers.

    from sdk import KVBranchClient

    with KVBranchClient("http://127.0.0.1:8000") as client:
        session = client.session(system="You are terse.")
        answer = session.main.chat("Name a prime number.", max_tokens=16, temperature=0)
        alt = session.main.fork(at_message=1)          # history before the first answer
        alt.chat("Name an even number.", max_tokens=16)
        print(answer.text, answer.split)                 # split: device/host/recomputed tokens

Wire models (``SessionInfo``, ``BranchInfo``, ``PromptSourceSplit``, ...) come from
:mod:`server.contract`, the single source of truth, and are re-exported here.
"""

from sdk.aclient import AsyncChatStream, AsyncKVBranchClient
from sdk.client import ChatStream, KVBranchClient
from sdk.errors import (
    APIConnectionError,
    APIResponseError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    ConflictError,
    KVBranchError,
    KVBranchUnavailableError,
    NotFoundError,
    RateLimitError,
    ServerError,
    StreamInterruptedError,
)
from sdk.retry import NO_RETRY, RetryPolicy
from sdk.session import AsyncBranch, AsyncSession, Branch, Session
from sdk.types import ChatChunk, ChatResult, ToolCall, ToolCallDelta, Usage
from server.contract import (
    DEFAULT_BRANCH,
    BranchInfo,
    DeleteResult,
    HealthInfo,
    PrefetchResult,
    PromptSourceSplit,
    SessionInfo,
    Stats,
)

__version__ = "0.1.0"

__all__ = [
    # clients
    "KVBranchClient",
    "AsyncKVBranchClient",
    "ChatStream",
    "AsyncChatStream",
    # sessions
    "Session",
    "Branch",
    "AsyncSession",
    "AsyncBranch",
    "DEFAULT_BRANCH",
    # results
    "ChatResult",
    "ChatChunk",
    "ToolCall",
    "ToolCallDelta",
    "Usage",
    "PromptSourceSplit",
    "SessionInfo",
    "BranchInfo",
    "DeleteResult",
    "PrefetchResult",
    "HealthInfo",
    "Stats",
    # retries
    "RetryPolicy",
    "NO_RETRY",
    # errors
    "KVBranchError",
    "APIConnectionError",
    "APITimeoutError",
    "StreamInterruptedError",
    "APIResponseError",
    "APIStatusError",
    "BadRequestError",
    "AuthenticationError",
    "NotFoundError",
    "KVBranchUnavailableError",
    "ConflictError",
    "RateLimitError",
    "ServerError",
]
