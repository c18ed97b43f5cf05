"""What an aggregated replica remembers of the session turns it served, so that it can revive a
branch for a peer after its hold on the device blocks has ended (:mod:`server.plugin.revive`).

The index forgets a hold when its offer ends and a peer's turn takes it; the replica's own
record of its handle — the token ids and chained block hashes its blocks encode, the cache salt
and identity of the request — is what lets it find those blocks in its host store again. Kept
here, in the replica's own memory, under the same (tenant, session, branch) key the index uses:
a peer names only the branch, never the tokens, and another tenant's key finds nothing.

Bounded: at most :data:`MAX_TURNS` branches and :data:`MAX_TOKENS` token ids in all, least
recently served first out (token ids kept as 32-bit arrays). And :class:`ReviveSlots` bounds
the revives themselves: one at a time per branch, :data:`MAX_REVIVES_AT_ONCE` in all.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from server.connector.pd.transfer_auth import HASHES_FIELD, IDENTITY_FIELD, TOKENS_FIELD
from server.index import Key

#: Branches remembered (each a few KB of hashes plus its token ids).
MAX_TURNS = 4096
#: Token ids remembered in all (4 bytes each: 16 MiB).
MAX_TOKENS = 4 * 1024 * 1024
#: Revives running at once on one replica (each loads a prefix from the host store).
MAX_REVIVES_AT_ONCE = 2


@dataclass(frozen=True)
class OwnTurn:
    """One served turn's handle, as much of it as a revive needs."""

    turn: int
    cache_salt: str | None
    identity: str
    hashes: list[str]
    tokens: array[int] = field(repr=False)
    #: The data-parallel engine that served it (its host store, its prefill).
    engine: int = 0

    @classmethod
    def of(
        cls, turn: int, cache_salt: Any, params: dict[str, Any], engine: int = 0
    ) -> OwnTurn | None:
        """From the sealed handle the connector issued for the turn; None when it lacks the
        fields (then nothing can be revived)."""
        tokens, hashes = params.get(TOKENS_FIELD), params.get(HASHES_FIELD)
        identity = params.get(IDENTITY_FIELD)
        if (
            not isinstance(tokens, list)
            or not isinstance(hashes, list)
            or not isinstance(identity, str)
            or not all(isinstance(h, str) for h in hashes)
            or not all(isinstance(t, int) and 0 <= t < 2**31 for t in tokens)
        ):
            return None
        salt = cache_salt if isinstance(cache_salt, str) else None
        return cls(turn, salt, identity, list(hashes), array("i", tokens), engine)


class OwnTurns:
    """The latest turn per branch this replica served, least recently served first out."""

    def __init__(self, max_turns: int = MAX_TURNS, max_tokens: int = MAX_TOKENS) -> None:
        self.max_turns = max_turns
        self.max_tokens = max_tokens
        self._turns: OrderedDict[Key, OwnTurn] = OrderedDict()
        self._tokens = 0

    def remember(self, key: Key, turn: OwnTurn) -> None:
        """Keep ``turn`` as the branch's latest, unless a later turn is kept already."""
        old = self._turns.get(key)
        if old is not None:
            if old.turn > turn.turn:
                return
            self._forget(key)
        if len(turn.tokens) > self.max_tokens:
            return
        self._turns[key] = turn
        self._tokens += len(turn.tokens)
        while len(self._turns) > self.max_turns or self._tokens > self.max_tokens:
            self._forget(next(iter(self._turns)))

    def get(self, key: Key) -> OwnTurn | None:
        return self._turns.get(key)

    def _forget(self, key: Key) -> None:
        turn = self._turns.pop(key)
        self._tokens -= len(turn.tokens)

    def __len__(self) -> int:
        return len(self._turns)


class ReviveSlots:
    """One revive per branch at a time, and :data:`MAX_REVIVES_AT_ONCE` in all."""

    def __init__(self, at_once: int = MAX_REVIVES_AT_ONCE) -> None:
        self.at_once = at_once
        self._running: set[Key] = set()

    def take(self, key: Key) -> str | None:
        """None when the revive may run (the slot is taken); else why not."""
        if key in self._running:
            return "busy_branch"
        if len(self._running) >= self.at_once:
            return "busy"
        self._running.add(key)
        return None

    def give(self, key: Key) -> None:
        self._running.discard(key)

    def running(self) -> Sequence[Key]:
        return tuple(self._running)
