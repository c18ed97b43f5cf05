"""The windowed groups' part of stored block positions: a pool of its own, kept only where a
resume needs it.

A model with sliding-window (or chunked-local) layers reads, after a prefix of *n* tokens, only
the last window of it in those layers (``kv_groups.WindowRule``). A host store that kept every
layer of every position (as it does for full attention) would spend most of its bytes on
window blocks no resume can read: for a Gemma-3-shaped model five layers in six. So a stored
position (a slot of ``block_index.HostBlockIndex``: the full-attention and state groups) may
carry a *window part* — the windowed groups' block of that position, in a second, smaller pool
of host slots — and the planner attaches one only to the positions a likely resume reads:
the window before the end of each request's prompt and before its last computed token. A hit
ends only where every position the window reads from the host has its part.

Parts follow their slot: dropped with it, touched with it, pinned while it is pinned. When the
pool is full the least recently used unpinned part goes (the hits that needed it end earlier
and recompute the rest; never a wrong answer).

Pure bookkeeping (slot numbers only); the bytes live in the worker's ``engine/host_pool.py``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable


class WindowParts:
    """Window slot per stored slot, over ``num_slots`` window slots, LRU over unpinned ones."""

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
        """The window slot holding ``slot``'s windowed groups, or ``None``."""
        return self._part_of.get(slot)

    def attach(self, slot: int, protected: set[int], pinned: Callable[[int], bool]) -> int | None:
        """A window slot for ``slot``'s part (the caller copies it there this step), or
        ``None`` when it has one already or none can be freed. ``protected``: window slots this
        step reads or writes; ``pinned``: whether a stored slot is pinned (its part stays)."""
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
        one. The window slot is reused from the next step on (:meth:`new_step`): a copy this
        step may still write it."""
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


#: The share of the host store's bytes given to window parts when a position's windowed part
#: is the larger share of its bytes. Each stored resume point needs about one window of
#: parts, so a quarter holds a window for every few turns' worth of positions in the rest.
WINDOW_SHARE = 0.25
#: Slots per window slot when a model has no other group (every layer windowed): a slot then
#: costs no host bytes, only its token ids.
SLOTS_PER_WINDOW_SLOT_ALL_WINDOWED = 4


def split_store(store_bytes: int, slot_bytes: int, window_bytes: int) -> tuple[int, int]:
    """(slots, window slots) for a host store of ``store_bytes``: a slot holds a position's
    non-windowed groups (``slot_bytes``), a window slot its windowed groups (``window_bytes``).
    Without windowed groups every byte goes to slots, as before. With them, window parts get
    their bytes' share of a position, at most :data:`WINDOW_SHARE` of the store."""
    if window_bytes <= 0:
        return (store_bytes // slot_bytes if slot_bytes > 0 else 0), 0
    if slot_bytes <= 0:
        window_slots = store_bytes // window_bytes
        return window_slots * SLOTS_PER_WINDOW_SLOT_ALL_WINDOWED, window_slots
    share = min(WINDOW_SHARE, window_bytes / (slot_bytes + window_bytes))
    window_slots = int(store_bytes * share) // window_bytes
    return (store_bytes - window_slots * window_bytes) // slot_bytes, window_slots
