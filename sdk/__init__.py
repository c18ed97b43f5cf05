"""kvbranch sdk: a sync and an async client for kvbranch (and any OpenAI-compatible) servers.

    from sdk import KVBranchClient

    with KVBranchClient("http://127.0.0.1:8000") as client:
        session = client.session(system="You are terse.")
        answer = session.main.chat("Name a prime number.", max_tokens=16, temperature=0)
        alt = session.main.fork(at_message=1)          # history before the first answer
        alt.chat("Name an even number.", max_tokens=16)
        print(answer.text, answer.split)                 # split: device/host/recomputed tokens

How it is built: one non-I/O core (``sdk._core``: request building, response parsing through
the contract's models, and every multi-step operation as a generator of requests;
``sdk._session_core``/``sdk._branch_core``: session recovery and the fork fallback;
``sdk._stream``: a stream's state) that two thin drivers run, :class:`KVBranchClient` with
httpx's sync client and :class:`AsyncKVBranchClient` with its async one. Server-sent events are
parsed by the sdk's own ``sdk.sse``, kept over httpx-sse after measuring both (more correct on
the format's edge cases and 1.5-2x faster; see that module).

Wire models (``SessionInfo``, ``BranchInfo``, ``PromptSourceSplit``, ...) come from
:mod:`sdk.contract`, the single source of truth, and are re-exported here.
"""

from importlib.metadata import PackageNotFoundError, version

from sdk import errors
from sdk.aclient import AsyncChatStream, AsyncKVBranchClient
from sdk.client import ChatStream, KVBranchClient
from sdk.contract import (
    DEFAULT_BRANCH,
    BranchInfo,
    DeleteResult,
    HealthInfo,
    PrefetchResult,
    PromptSourceSplit,
    SessionInfo,
    Stats,
)
from sdk.errors import *  # noqa: F403  (the error classes: sdk.errors.__all__)
from sdk.retry import NO_RETRY, RetryPolicy
from sdk.session import AsyncBranch, AsyncSession, Branch, Session
from sdk.types import ChatChunk, ChatResult, ToolCall, ToolCallDelta, Usage

try:  # one version: the package's own (pyproject.toml)
    __version__ = version("kvbranch")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

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
]
__all__ += errors.__all__
