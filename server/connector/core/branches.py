"""The nouns of the session registry: sessions, branches, ids and the errors its operations
raise (each carries the HTTP status the routes answer with). Kept apart from the registry's
logic so that the pin leases (``leases.py``) and the registry (``sessions.py``) share them
without importing each other.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Generic, TypeVar, overload

from sdk.contract import DEFAULT_BRANCH  # noqa: F401 - the contract's, re-exported (registry API)

T = TypeVar("T")

DEFAULT_MAX_SESSIONS_PER_TENANT = 1000
DEFAULT_MAX_BRANCHES_PER_SESSION = 256
DEFAULT_IDLE_TTL_S = 6 * 3600.0

#: (owner, session id): the registry's key of a session.
SessionKey = tuple[str | None, str]
LeaseKey = tuple[str | None, str, str]  # (owner, session id, branch id)


class RegistryError(Exception):
    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(RegistryError):
    status = 404


class Conflict(RegistryError):
    status = 409


class QuotaExceeded(RegistryError):
    status = 429


class KeyRequired(RegistryError):
    status = 401


def new_id(prefix: str) -> str:
    """Unguessable ids: 128 random bits."""
    return f"{prefix}_{secrets.token_urlsafe(16)}"


#: Segments a :class:`SharedSeq` may chain before :meth:`SharedSeq.extend` flattens it.
MAX_SEGMENTS = 32


class SharedSeq(Sequence[T], Generic[T]):
    """An immutable sequence that shares its prefix with the sequence it was cut from or
    extended from: a branch's tokens and block hashes. A fork refers to its parent's tokens
    (:meth:`prefix`, O(1)); a turn adds only its own new tokens (:meth:`rebased`, memory for
    the suffix past the common prefix). Without this every fork and every turn copied the whole
    token list: 1000 sessions x 256 forks of 8k tokens was ~19 GB of Python lists.

    A node is (parent, cut, own): the parent's first ``cut`` items, then ``own``. Chains are
    at most :data:`MAX_SEGMENTS` deep (then flattened: one copy per that many turns)."""

    __slots__ = ("_parent", "_cut", "_own", "_len", "_depth")

    def __init__(
        self, items: Sequence[T] = (), *, _parent: SharedSeq[T] | None = None, _cut: int = 0
    ) -> None:
        self._parent = _parent
        self._cut = _cut if _parent is not None else 0
        self._own: tuple[T, ...] = tuple(items)
        self._len = self._cut + len(self._own)
        self._depth = _parent._depth + 1 if _parent is not None else 0

    @classmethod
    def of(cls, items: Sequence[T]) -> SharedSeq[T]:
        return items if isinstance(items, SharedSeq) else cls(items)

    def __len__(self) -> int:
        return self._len

    def pieces(self) -> list[tuple[T, ...]]:
        """The items as consecutive tuples, first to last (no copy of whole segments)."""
        out: list[tuple[T, ...]] = []
        node: SharedSeq[T] | None = self
        visible = self._len
        while node is not None:
            k = visible - node._cut
            if k > 0:
                out.append(node._own if k == len(node._own) else node._own[:k])
            visible = node._cut
            node = node._parent
        out.reverse()
        return out

    def __iter__(self) -> Iterator[T]:
        return chain.from_iterable(self.pieces())

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> SharedSeq[T]: ...
    def __getitem__(self, i: int | slice) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._len)
            if start == 0 and step == 1:
                return self.prefix(stop)
            return SharedSeq(tuple(self)[i])
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError("SharedSeq index out of range")
        node = self
        while i < node._cut:
            assert node._parent is not None
            node = node._parent
        return node._own[i - node._cut]

    def prefix(self, n: int) -> SharedSeq[T]:
        """The first ``n`` items, sharing this sequence's memory (O(depth), no copy)."""
        n = max(0, min(n, self._len))
        if n == self._len:
            return self
        if n == 0:
            return SharedSeq()
        node = self
        while node._parent is not None and n <= node._cut:
            node = node._parent
        if n == node._len:
            return node
        return SharedSeq(_parent=node, _cut=n)

    def extend(self, items: Sequence[T]) -> SharedSeq[T]:
        """This sequence followed by ``items`` (only ``items`` is new memory)."""
        own = tuple(items)
        if not own:
            return self
        if self._len == 0:
            return SharedSeq(own)
        if self._depth >= MAX_SEGMENTS:
            return SharedSeq(tuple(self) + own)
        return SharedSeq(own, _parent=self, _cut=self._len)

    def common_prefix(self, other: Sequence[T]) -> int:
        """How many leading items this sequence and ``other`` share (compared a segment at a
        time, at C speed)."""
        if not isinstance(other, tuple):
            other = tuple(other)
        n = 0
        for piece in self.pieces():
            theirs = other[n : n + len(piece)]
            if theirs == piece:
                n += len(piece)
                continue
            for x, y in zip(piece, theirs, strict=False):
                if x != y:
                    break
                n += 1
            return n
        return n

    def rebased(self, items: Sequence[T]) -> SharedSeq[T]:
        """``items`` as a sequence that shares its common prefix with this one."""
        n = self.common_prefix(items)
        return self.prefix(n).extend(items[n:])

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (SharedSeq, list, tuple)):
            return len(self) == len(other) and tuple(self) == tuple(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"SharedSeq({list(self)!r})"


def shared(items: Sequence[T]) -> SharedSeq[T]:
    return SharedSeq.of(items)


@dataclass
class Branch:
    session_id: str
    branch_id: str
    parent: str | None = None
    fork_offset_tokens: int | None = None
    #: Shared with the parent and the previous turn (:class:`SharedSeq`); any sequence given
    #: to the constructor is converted.
    token_ids: SharedSeq[int] = field(default_factory=SharedSeq)
    block_hashes: SharedSeq[bytes] = field(default_factory=SharedSeq)
    pinned_hashes: Sequence[bytes] = field(default_factory=SharedSeq)
    pin_expires_at: float | None = None
    pin_ttl_s: float | None = None
    pinned_at: float = 0.0
    degraded: bool = False
    cache_salt: str | None = None
    requests: int = 0
    owner: str | None = None
    #: The branch's tail (``tails.py``): its key in the store and the token it starts at.
    tail_key: bytes | None = None
    tail_start: int = 0

    def __post_init__(self) -> None:
        self.token_ids = SharedSeq.of(self.token_ids)
        self.block_hashes = SharedSeq.of(self.block_hashes)

    def wanted_pins(self) -> SharedSeq[bytes]:
        """What a pin of this branch holds: its full blocks and its tail (no copy: shared
        with the branch's block hashes; a tail key never equals a block hash)."""
        hashes = SharedSeq.of(self.block_hashes)
        return hashes.extend((self.tail_key,)) if self.tail_key is not None else hashes

    @property
    def pinned(self) -> bool:
        return self.pin_expires_at is not None and not self.degraded

    @property
    def lease_key(self) -> LeaseKey:
        return (self.owner, self.session_id, self.branch_id)


@dataclass
class Session:
    session_id: str
    created_at: float
    auto_pin: bool
    pin_ttl_s: float
    owner: str | None = None
    branches: dict[str, Branch] = field(default_factory=dict)
    last_used: float = 0.0
