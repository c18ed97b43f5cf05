"""Some KV cache groups' part of stored block positions, in a pool of host slots of its own,
kept only where a resume reads it.

A slot of ``block_index.HostBlockIndex`` holds a position's full-attention groups. Two kinds of
group need their block of a position far less often, and a slot that kept room for them at
every position would spend most of the store's bytes on what no resume reads:

* windowed groups (sliding window, chunked local) read, after a prefix, only its last window
  (``kv_groups.WindowRule``): their *window part* is attached near resume points only (the
  window before each prompt's end and before each request's last computed token);
* state groups (Mamba, Gated DeltaNet) resume from the state after a hit's last block, which
  vLLM keeps at some block ends only: their *state part* is attached where vLLM kept a state,
  and kept when the request ends only at its resume points (its prompt's and its end's).

Parts follow their slot: dropped with it, touched with it, not evicted while it is pinned. When
a pool is full the least recently used unpinned part goes (the hits that needed it end earlier
and recompute the rest; never a wrong answer). A released part's slot is reused from the next
step on (a copy planned this step may still write it).

Pure bookkeeping (slot numbers only); the bytes live in the worker's ``engine/host_pool.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence


class PartPool:
    """A part slot per stored slot, over ``num_slots`` part slots, LRU over unpinned ones."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        self.num_slots = num_slots
        self._part_of: dict[int, int] = {}
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._released: list[int] = []
        #: Slots whose part may be evicted, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self.saved = 0
        self.loaded = 0
        self.evictions = 0
        self.released = 0

    def __len__(self) -> int:
        return len(self._part_of)

    def part_of(self, slot: int) -> int | None:
        """The part slot holding ``slot``'s groups of this pool, or ``None``."""
        return self._part_of.get(slot)

    def attach(self, slot: int, protected: set[int], pinned: Callable[[int], bool]) -> int | None:
        """A part slot for ``slot`` (the caller copies its groups there this step), or ``None``
        when it has one already or none can be freed. ``protected``: part slots this step
        reads or writes; ``pinned``: whether a stored slot is pinned (its part stays)."""
        if slot in self._part_of or self.num_slots == 0:
            return None
        part = self._take(protected, pinned)
        if part is None:
            return None
        self._part_of[slot] = part
        self._lru[slot] = None
        self.saved += 1
        return part

    def _take(self, protected: set[int], pinned: Callable[[int], bool]) -> int | None:
        if self._free:
            return self._free.pop()
        for owner in self._lru:
            part = self._part_of[owner]
            if part in protected or pinned(owner):
                continue
            self._forget(owner)
            self.evictions += 1
            return part
        return None

    def _forget(self, slot: int) -> None:
        self._part_of.pop(slot, None)
        self._lru.pop(slot, None)

    def touch(self, slot: int) -> None:
        if slot in self._lru:
            self._lru.move_to_end(slot)

    def release(self, slot: int) -> bool:
        """Free ``slot``'s part (its slot was dropped, or no resume reads it); whether it had
        one. The part slot is reused from the next step on (:meth:`new_step`): a copy this step
        may still write it."""
        part = self._part_of.get(slot)
        if part is None:
            return False
        self._forget(slot)
        self._released.append(part)
        return True

    def new_step(self) -> None:
        """A new step's copies are planned: parts released before it may be reused."""
        if self._released:
            self._free.extend(self._released)
            self._released = []

    def clear(self) -> None:
        self._part_of.clear()
        self._lru.clear()
        self._released = []
        self._free = list(range(self.num_slots - 1, -1, -1))


#: The most of the host store's bytes one pool of parts gets (when its groups are the larger
#: share of a position's bytes). Each stored resume point needs about one window of window
#: parts, or one state part: a quarter holds them for many turns' worth of positions.
PART_SHARE = 0.25
#: Slots per part slot when a model has no group outside the pools (every layer windowed): a
#: slot then costs no host bytes, only its token ids.
SLOTS_PER_PART_SLOT = 4


def split_store(
    store_bytes: int, slot_bytes: int, part_bytes: Sequence[int] = ()
) -> tuple[int, list[int]]:
    """(slots, part slots of each pool) for a host store of ``store_bytes``: a slot holds a
    position's groups outside the pools (``slot_bytes``), a part of pool *i* its groups there
    (``part_bytes[i]``, 0: no such pool). A pool gets its groups' share of a position's bytes,
    at most :data:`PART_SHARE`; the rest goes to slots. Without pools: every byte to slots."""
    # The bytes of a resume point are the pools' (a window, a state), those of a long history
    # the slots': capping the pools is what lets the store keep more history than before.
    total = slot_bytes + sum(part_bytes)
    if total <= 0:
        return 0, [0 for _ in part_bytes]
    # Every group in a pool (every layer windowed): the pools take all, slots cost nothing.
    cap = 1.0 if slot_bytes <= 0 else PART_SHARE
    parts = [
        int(store_bytes * min(cap, size / total)) // size if size > 0 else 0 for size in part_bytes
    ]
    if slot_bytes <= 0:
        return max(parts, default=0) * SLOTS_PER_PART_SLOT, parts
    rest = store_bytes - sum(n * size for n, size in zip(parts, part_bytes, strict=True))
    return rest // slot_bytes, parts
