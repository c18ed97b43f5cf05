"""The last turns of each branch, for the agent page (:mod:`server.plugin.ui`): where each
turn's prompt tokens came from (device, host store, pulled, recomputed) and how long it took.

The connector keeps a finished request's split only by its request tag, for the middleware to
pick up, and nobody kept TTFT; the page wants both per branch. So :class:`TurnRecorder`, the
innermost of the plugin's ASGI layers, times each generating request (to its first body byte:
the first event of a stream, sent when the first token is out; a JSON answer's first byte comes
only with the whole answer, so it is recorded as latency, not TTFT), then takes the request's
split through the completion middleware's own lookup (which it leaves in the scope: one
control-socket call per turn, shared with the usage it adds to the answer), and files it in
:class:`TurnLog`.

:class:`TurnLog` is bounded three ways, so no client can grow it: a few turns per branch, a
number of branches per tenant (its least recently used dropped first), and a number of branches
in all (the least recently used tenant's oldest dropped first). Entries are keyed by the
tenant (the caller's key's digest), so a read for one tenant never sees another's turns, even
for a session id both chose.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

from sdk.contract import GENERATE_PATHS
from server.plugin.request import header, route_path
from server.plugin.tenancy import app_args_of, owner_of

__all__ = ["SPLIT_SCOPE_KEY", "Turn", "TurnLog", "TurnRecorder"]

logger = logging.getLogger("kvbranch.turns")

#: Where the completion middleware leaves, in the ASGI scope it hands inward, its lookup of the
#: request's split: an async callable giving the split (a dict) or None, looked up at most once.
SPLIT_SCOPE_KEY = "kvbranch.split"
#: The tenant key of a server without API keys (one tenant: everyone).
NO_TENANT = ""
TURNS_PER_BRANCH = 8
BRANCHES_PER_TENANT = 256
MAX_BRANCHES = 4096

Message = dict[str, Any]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class Turn:
    """One finished turn of a branch."""

    session_id: str
    branch_id: str
    #: Wall-clock time it finished (seconds since the epoch).
    at: float
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    remote_hit_tokens: int
    recomputed_tokens: int
    #: Seconds to the first token: streamed turns only.
    ttft_s: float | None
    #: Seconds to the end of the answer.
    latency_s: float
    streamed: bool

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class TurnLog:
    """A bounded ring of turns per (tenant, session, branch)."""

    # Shape only beside router/edge.py's EdgeState: bounds with defaults, kept as given.
    def __init__(
        self,
        turns_per_branch: int = TURNS_PER_BRANCH,
        branches_per_tenant: int = BRANCHES_PER_TENANT,
        max_branches: int = MAX_BRANCHES,
    ) -> None:
        self.turns_per_branch = turns_per_branch
        self.branches_per_tenant = branches_per_tenant
        self.max_branches = max_branches
        #: tenant -> (session, branch) -> its last turns; both in least-recently-used order.
        self._tenants: OrderedDict[str, OrderedDict[tuple[str, str], deque[Turn]]] = OrderedDict()
        self._branches = 0

    def __len__(self) -> int:
        """Branches held, over all tenants."""
        return self._branches

    def add(self, owner: str | None, turn: Turn) -> None:
        tenant = owner or NO_TENANT
        branches = self._tenants.setdefault(tenant, OrderedDict())
        self._tenants.move_to_end(tenant)
        key = (turn.session_id, turn.branch_id)
        ring = branches.get(key)
        if ring is None:
            ring = branches[key] = deque(maxlen=self.turns_per_branch)
            self._branches += 1
        branches.move_to_end(key)
        ring.append(turn)
        while len(branches) > self.branches_per_tenant:
            branches.popitem(last=False)
            self._branches -= 1
        while self._branches > self.max_branches:
            oldest_tenant, oldest = next(iter(self._tenants.items()))
            if oldest:
                oldest.popitem(last=False)
                self._branches -= 1
            if not oldest:
                del self._tenants[oldest_tenant]

    def turns_of(
        self, owner: str | None, branches: Iterable[tuple[str, str]] | None = None
    ) -> list[Turn]:
        """``owner``'s turns, oldest first per branch; only of ``branches`` when given (the
        branches that still exist: a deleted one's history is not shown)."""
        held = self._tenants.get(owner or NO_TENANT)
        if not held:
            return []
        keys = list(held) if branches is None else [k for k in branches if k in held]
        return [turn for key in keys for turn in held[key]]


class TurnRecorder:
    """ASGI layer: file each finished generating request's split and timing in a
    :class:`TurnLog` (turns of a named session only). Never changes or delays the response
    itself: the look-up runs after its last byte went out, and a failed one is only logged."""

    def __init__(self, app: Any, log: TurnLog) -> None:
        self.app = app
        self.log = log

    async def __call__(self, scope: dict, receive: Any, send: Send) -> None:
        fetch_split = scope.get(SPLIT_SCOPE_KEY)
        if (
            scope["type"] != "http"
            or scope.get("method") != "POST"
            or fetch_split is None
            or route_path(scope) not in GENERATE_PATHS
        ):
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        timing: dict[str, Any] = {"status": None, "streamed": False, "first": None, "end": None}

        async def timed_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                timing["status"] = message.get("status")
                for name, value in message.get("headers", []):
                    if name.lower() == b"content-type":
                        timing["streamed"] = value.startswith(b"text/event-stream")
            elif message["type"] == "http.response.body":
                now = time.monotonic()
                if timing["first"] is None and message.get("body"):
                    timing["first"] = now
                if not message.get("more_body", False):
                    timing["end"] = now
            await send(message)

        await self.app(scope, receive, timed_send)
        if timing["status"] != 200 or timing["end"] is None:
            return
        first = timing["first"] if timing["first"] is not None else timing["end"]
        await self._record(
            scope,
            await fetch_split(),
            ttft_s=first - started if timing["streamed"] else None,
            latency_s=timing["end"] - started,
            streamed=bool(timing["streamed"]),
        )

    async def _record(
        self,
        scope: dict,
        split: dict[str, Any] | None,
        *,
        ttft_s: float | None,
        latency_s: float,
        streamed: bool,
    ) -> None:
        if split is None or not split.get("session_id") or not split.get("branch_id"):
            return  # not a session's turn (or the split is gone): nothing to file
        owner = owner_of(header(scope, "authorization"), app_args_of(scope))
        self.log.add(
            owner,
            Turn(
                session_id=split["session_id"],
                branch_id=split["branch_id"],
                at=time.time(),
                prompt_tokens=split["prompt_tokens"],
                device_hit_tokens=split["device_hit_tokens"],
                host_hit_tokens=split["host_hit_tokens"],
                remote_hit_tokens=split["remote_hit_tokens"],
                recomputed_tokens=split["recomputed_tokens"],
                ttft_s=ttft_s,
                latency_s=latency_s,
                streamed=streamed,
            ),
        )
