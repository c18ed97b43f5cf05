"""Agent-aware request priority: what is already cached goes first, with aging (docs/scheduling.md).

vLLM's ``--scheduling-policy priority`` orders its waiting queue by ``(priority, arrival
time)``, lower first. The API server cannot see vLLM's prefix cache, but it sees every prompt:
this module remembers digests of the prompts each tenant sent and, for a new request, finds the
longest prefix it sent before (a resumed agent turn, a fork of a branch, a shared tools prompt).
What is left is the estimated prefill work, bucketed SRPT-like into a *level* (0: a few blocks
to compute, a resumed turn; higher: colder and longer). The priority is a virtual deadline,
``arrival + level * aging_s`` on the system's monotonic clock, in ticks of :data:`TICK_S`, with
the level in its lowest digit (:func:`encode`, so that the engine's scheduler can read it back
with :func:`level_in`, server/engine/scheduler.py; both in :mod:`server.common.priority_code`):
a request of level *L* is outranked only by a request of level *L'* < *L* that arrives less than
``(L - L') * aging_s`` after it, so a cold first turn is never starved. (An earlier version used
``int(elapsed / aging_s) + level``: the rounding made the window anywhere between ``(L - 1)``
and ``L`` times the aging, depending on when the server started — measured, a resumed turn 6.6 s
after a level-2 cold lost its place with an aging of 4 s.)

Why digests of prefixes, not lengths per (session, branch): a length says nothing about
content, so a client could send a new 5k-token prompt of the length of its last one and be
ranked "cached". A digest chain matches only text the same tenant (same cache salt, same
model) really sent before, which vLLM's prefix cache or kvbranch's host store most likely still
holds; forks and shared system prompts match without any session. The estimate is never
trusted for correctness, only for order.

Why the client's own ``priority`` is not taken as is: it would let anyone jump the queue
(``priority: -2**63``). A positive one counts as that many levels later (a background job);
zero, a negative or a non-integer one changes nothing: a client may go later, never earlier.

State is bounded: at most ``max_digests`` prefix digests per tenant and ``max_tenants`` tenants,
both least-recently-used. Pure apart from the clock (testable); standard library only.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from server.common.priority_code import (
    DEFAULT_AGING_S,
    LEVEL_BOUNDS,
    aging_from_env,
    encode,
    unranked,
)

#: Characters per token, for the estimate (English and JSON with a BPE tokenizer: ~4).
CHARS_PER_TOKEN = 4
#: A prefix digest every this many characters (~128 tokens, one CPU KV block): the unmatched
#: tail of a resumed turn is then at most half of level 0.
CHUNK_CHARS = 512
#: A client's own positive ``priority`` counts as that many levels later, at most this many.
MAX_CLIENT_LEVELS = 1000
#: The routes whose vLLM body has a ``priority`` field (vLLM 0.32; /v1/messages has none).
PRIORITY_PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/inference/v1/generate",
)
PRIORITY_FIELD = "priority"


@dataclass(frozen=True)
class Estimate:
    """What :meth:`PriorityPolicy.assign` decided for one request."""

    prompt_units: int  # characters (text) or tokens (token ids) of the prompt
    cached_units: int  # of those, the longest prefix sent before
    new_tokens: int  # estimated tokens to prefill
    level: int
    priority: int


def prompt_text(payload: dict, path: str) -> tuple[str, bool] | None:
    """The prompt as one string that grows by appending as a conversation goes on (each message
    serialized on its own line, tools first: a turn's text is a prefix of the next turn's),
    and whether it counts tokens (a token-id prompt) rather than characters. ``None``: no
    prompt this module understands (left at vLLM's default order)."""
    if path.endswith("/chat/completions"):
        messages = payload.get("messages")
        if not isinstance(messages, list):
            return None
        parts = [_dump(payload.get("tools"))] + [_dump(m) for m in messages]
        return "\n".join(parts), False
    if path == "/v1/responses":
        head = [_dump(payload.get("tools")), _dump(payload.get("instructions"))]
        items = payload.get("input")
        items = items if isinstance(items, list) else [items]
        return "\n".join(head + [_dump(i) for i in items]), False
    prompt = payload.get("token_ids") if path == "/inference/v1/generate" else payload.get("prompt")
    if isinstance(prompt, str):
        return prompt, False
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return " ".join(map(str, prompt)), True
    return None  # several prompts in one request, or none


def _dump(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


def prefix_digests(seed: str, text: str, chunk: int = CHUNK_CHARS) -> list[tuple[int, bytes]]:
    """``(length, digest of seed + text[:length])`` at every ``chunk`` characters and at the
    end: one pass over the text (the hash is copied at each boundary)."""
    hasher = hashlib.blake2b(seed.encode(), digest_size=12)
    out: list[tuple[int, bytes]] = []
    data = text.encode()
    for start in range(0, len(data), chunk):
        hasher.update(data[start : start + chunk])
        out.append((min(start + chunk, len(data)), hasher.copy().digest()))
    return out


def level_of(new_tokens: int, bounds: tuple[int, ...] = LEVEL_BOUNDS) -> int:
    """SRPT-like bucket of the estimated prefill work."""
    for level, bound in enumerate(bounds):
        if new_tokens <= bound:
            return level
    return len(bounds)


class PriorityPolicy:
    """Per-tenant prefix digests and the priority of each request (see the module docstring).

    ``aging_s``: how much one level is worth in seconds of arrival time. With the default
    levels (0-3) a request can be passed only by warmer requests that arrive within
    ``max level * aging_s`` (12 s by default) after it."""

    def __init__(
        self,
        aging_s: float = DEFAULT_AGING_S,
        *,
        max_digests: int = 8192,
        max_tenants: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if aging_s <= 0:
            raise ValueError("aging_s must be positive")
        self.aging_s = aging_s
        self.max_digests = max_digests
        self.max_tenants = max_tenants
        self._clock = clock
        self._tenants: OrderedDict[str, OrderedDict[bytes, None]] = OrderedDict()

    @property
    def max_wait_s(self) -> float:
        """A request is never passed by one that arrives more than this long after it."""
        return len(LEVEL_BOUNDS) * self.aging_s

    def digests_held(self) -> int:
        return sum(len(d) for d in self._tenants.values())

    def _tenant(self, key: str) -> OrderedDict[bytes, None]:
        table = self._tenants.get(key)
        if table is None:
            table = self._tenants[key] = OrderedDict()
            while len(self._tenants) > self.max_tenants:
                self._tenants.popitem(last=False)
        else:
            self._tenants.move_to_end(key)
        return table

    def assign(
        self, payload: dict, path: str, tenant: str | None = None, held_tokens: int = 0
    ) -> Estimate | None:
        """Set ``payload["priority"]`` (at least the computed value) and remember the prompt's
        prefixes; ``None`` (payload untouched) for a route or prompt it does not handle.
        ``held_tokens``: a prefix of the prompt this instance will pull rather than compute (an
        aggregated replica's claimed hold, :mod:`server.plugin.peer_pull`): a moved session's
        turn is as warm as a resumed one, though this instance never saw its prompt."""
        if path not in PRIORITY_PATHS:
            return None
        found = prompt_text(payload, path)
        if found is None:  # ranked coldest: a client's own priority must not pass through
            payload[PRIORITY_FIELD] = unranked(self._clock(), self.aging_s)
            return None
        text, is_tokens = found
        # Different salt or model: a different cache, so different digests.
        seed = _dump([tenant or "", payload.get("cache_salt"), payload.get("model")])
        digests = prefix_digests(seed, text)
        table = self._tenant(seed)
        cached = 0
        for length, digest in reversed(digests):
            if digest in table:
                cached = length
                break
        for _, digest in digests:
            table[digest] = None
            table.move_to_end(digest)
        while len(table) > self.max_digests:
            table.popitem(last=False)
        total = len(text.encode())
        new_units = total - cached
        if is_tokens:  # " ".join of ids: scale the new bytes back to ids
            total_tokens = len(text.split())
            new_tokens = round(total_tokens * new_units / max(total, 1))
        else:
            new_tokens = -(-new_units // CHARS_PER_TOKEN)
            total_tokens = -(-total // CHARS_PER_TOKEN)
        if held_tokens > 0:
            new_tokens = min(new_tokens, max(total_tokens - held_tokens, 0))
        level = level_of(new_tokens)
        client = payload.get(PRIORITY_FIELD)
        later = client if isinstance(client, int) and not isinstance(client, bool) else 0
        later = min(max(later, 0), MAX_CLIENT_LEVELS)  # later is allowed, earlier is not
        computed = encode(self._clock() + (level + later) * self.aging_s, level)
        payload[PRIORITY_FIELD] = computed
        return Estimate(total, cached, new_tokens, level, computed)


def policy_from_env() -> PriorityPolicy | None:
    """The policy the launcher turned on (``--agent-priority``: it starts vLLM with
    ``--scheduling-policy priority`` and sets the aging in the environment), else ``None``:
    vLLM refuses a non-zero priority under its default first-come-first-served policy."""
    aging_s = aging_from_env()
    return PriorityPolicy(aging_s) if aging_s is not None else None
