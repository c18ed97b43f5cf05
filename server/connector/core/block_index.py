"""Scheduler-side index of the host block store: which block hash lives in which host slot.

The KV data itself lives in the worker (``engine/host_pool.py``); the scheduler decides where each
block goes and tells the worker through connector metadata. Keeping the index on the scheduler
side means ``get_num_new_matched_tokens`` answers without crossing a process boundary.

Rules:
* keys are vLLM's block hashes (a chained sha256 over the prefix and the ``cache_salt``), so a
  hash names one exact token prefix in one salt domain;
* each slot also keeps its block's token ids, and a hit must match them: a wrong hit would be a
  wrong answer, so we pay a tuple compare to make it impossible;
* pinned hashes (refcounted by branches) are never evicted; everything else is LRU;
* a slot may also hold a request's *tail* (a partial block, see ``tails.py``): keyed by its
  tail key like a block by its hash (so pins, LRU and eviction treat it the same), and filed
  under its parent key so that :meth:`match_tail` finds every tail that may continue a prefix.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from server.connector.core.part_pool import PartPool

#: Tails filed under one parent (forks that diverge inside one block); more are not saved.
MAX_TAILS_PER_PARENT = 64
#: Store events kept for the connector's ``take_events`` between two engine steps; beyond it
#: the oldest are dropped (and counted): the cluster index is advisory, a lost event costs a
#: wrong cost estimate until the entry's TTL, never a wrong answer.
MAX_STORE_EVENTS = 10_000

#: One host-store change for the KV event stream: ("stored" | "removed", block hash) or
#: ("cleared", None). Tails are not announced (their keys are not vLLM block hashes).
StoreEvent = tuple[Literal["stored", "removed", "cleared"], bytes | None]


class StoreEventLog:
    """The host store's changes since the connector last took them (only when vLLM's KV
    events are on: otherwise the index has no log and pays nothing)."""

    def __init__(self, cap: int = MAX_STORE_EVENTS) -> None:
        self.cap = cap
        self.events: deque[StoreEvent] = deque()
        self.dropped = 0

    def add(self, event: StoreEvent) -> None:
        if len(self.events) >= self.cap:
            self.events.popleft()
            self.dropped += 1
        self.events.append(event)

    def take(self) -> list[StoreEvent]:
        """Everything logged so far, oldest first (the log is empty afterwards)."""
        out: list[StoreEvent] = []
        events = self.events
        while events:
            try:
                out.append(events.popleft())
            except IndexError:  # taken concurrently (a control-socket reset): nothing lost
                break
        return out


@dataclass
class IndexCounters:
    """What the host store did since it started (``/v1/kvbranch/stats``'s ``store``)."""

    #: Full blocks copied into and out of the host store.
    saved_blocks: int = 0
    loaded_blocks: int = 0
    #: Unpinned blocks dropped for a newer one; blocks not saved because every slot was pinned.
    evictions: int = 0
    save_skipped_full: int = 0
    #: Stored blocks whose tokens did not match the prompt's (the match stops there: recompute).
    token_mismatches: int = 0
    #: Token-exact reuse (tails.py): partial blocks kept and loaded, and the tokens they gave.
    saved_tails: int = 0
    loaded_tails: int = 0
    tail_tokens_loaded: int = 0
    #: Recurrent states (state groups, ``kv_groups.py``) saved with a block and loaded at a
    #: hit's end.
    saved_states: int = 0
    loaded_states: int = 0
    #: Windowed groups (``part_pool.py``): hits shortened to where the window's parts are
    #: stored, and loads that found a position without its part (never expected).
    window_cuts: int = 0
    window_misses: int = 0


class HostBlockIndex:
    """Hash → slot map over ``num_slots`` host slots, LRU over unpinned slots."""

    def __init__(self, num_slots: int, window_slots: int = 0, state_slots: int = 0) -> None:
        if num_slots < 0:
            raise ValueError("num_slots must be >= 0")
        self.num_slots = num_slots
        self._slot_of: dict[bytes, int] = {}
        self._hash_of: list[bytes | None] = [None] * num_slots
        self._tokens_of: list[tuple[int, ...] | None] = [None] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        # Unpinned stored slots, least recently used first.
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._pinned_slots: set[int] = set()
        self._pin_counts: dict[bytes, int] = {}
        # Tails: parent key -> {tail key: None}, and each tail slot's parent key.
        self._tails_of: dict[bytes, dict[bytes, None]] = {}
        self._parent_of: dict[int, bytes] = {}
        self._tail_slots: set[int] = set()
        self.counters = IndexCounters()
        #: The windowed groups' and the state groups' parts of stored slots (``part_pool.py``);
        #: empty pools for a model without such groups.
        self.windows = PartPool(window_slots)
        self.states = PartPool(state_slots)
        #: Set by the connector when vLLM's KV events are on (see :class:`StoreEventLog`).
        self.event_log: StoreEventLog | None = None

    # --- queries -----------------------------------------------------------------------------
    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slot_of

    @property
    def used_slots(self) -> int:
        return len(self._slot_of)

    @property
    def pinned_stored_slots(self) -> int:
        return len(self._pinned_slots)

    @property
    def pinned_hashes(self) -> int:
        """Distinct hashes held by at least one pin (stored or not yet stored)."""
        return len(self._pin_counts)

    def pin_count(self, block_hash: bytes) -> int:
        return self._pin_counts.get(block_hash, 0)

    def slot_of(self, block_hash: bytes) -> int | None:
        return self._slot_of.get(block_hash)

    def has_state(self, slot: int) -> bool:
        """Whether the slot comes with the recurrent state after its block (a state part)."""
        return self.states.part_of(slot) is not None

    def attach_state(self, slot: int, protected: set[int]) -> int | None:
        """A state part for a stored slot (its recurrent state, copied there this step), or
        ``None`` (it has one, or none can be freed)."""
        if self._hash_of[slot] is None:
            return None
        part = self.states.attach(slot, protected, self.is_pinned)
        if part is not None:
            self.counters.saved_states += 1
        return part

    def match(
        self,
        block_hashes: Sequence[bytes],
        token_ids: Sequence[int],
        block_size: int,
        start_block: int,
        max_blocks: int,
    ) -> list[int]:
        """Slots of the consecutive stored blocks ``start_block, start_block+1, ...`` (at most
        ``max_blocks``) whose tokens match ``token_ids``. Side-effect free apart from counters."""
        slots: list[int] = []
        end = min(len(block_hashes), start_block + max_blocks)
        for k in range(start_block, end):
            slot = self._slot_of.get(block_hashes[k])
            if slot is None:
                break
            expected = tuple(token_ids[k * block_size : (k + 1) * block_size])
            if self._tokens_of[slot] != expected:
                self.counters.token_mismatches += 1
                break
            slots.append(slot)
        return slots

    def match_tail(self, parent: bytes, tokens: Sequence[int]) -> tuple[int, int] | None:
        """The stored tail under ``parent`` sharing the longest token prefix with ``tokens``
        (the prompt's tokens after the parent, already capped by the caller): ``(slot,
        matched tokens)``, or None when no tail matches even one token."""
        best: tuple[int, int] | None = None
        for key in self._tails_of.get(parent, ()):
            slot = self._slot_of[key]
            stored = self._tokens_of[slot] or ()
            n = 0
            for x, y in zip(stored, tokens, strict=False):
                if x != y:
                    break
                n += 1
            if n and (best is None or n > best[1]):
                best = (slot, n)
        return best

    # --- updates -----------------------------------------------------------------------------
    def refresh_all(self, keys: Sequence[bytes]) -> bool:
        """Whether every key (block hashes, tail keys) is stored; if so, mark them all most
        recently used, so that the branch they make up is the last thing the store evicts."""
        slots = [self._slot_of.get(key) for key in keys]
        if not slots or any(slot is None for slot in slots):
            return False
        for slot in slots:
            self.touch_slot(slot)  # type: ignore[arg-type]
        return True

    def touch(self, block_hash: bytes) -> None:
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self.touch_slot(slot)

    def touch_slot(self, slot: int) -> None:
        if slot in self._lru:
            self._lru.move_to_end(slot)
        self.windows.touch(slot)
        self.states.touch(slot)

    def is_pinned(self, slot: int) -> bool:
        return slot in self._pinned_slots

    def attach_window(self, slot: int, protected: set[int]) -> int | None:
        """A window part for a stored slot's windowed groups (see ``part_pool.py``)."""
        if self._hash_of[slot] is None:
            return None
        return self.windows.attach(slot, protected, self.is_pinned)

    def allocate(
        self,
        block_hash: bytes,
        tokens: Sequence[int],
        protected: set[int] | None = None,
        parent: bytes | None = None,
        *,
        _tail: bool = False,
    ) -> int | None:
        """Reserve a slot for a new block; ``None`` when the hash is already stored or when
        every slot is pinned (the block is then simply not saved). ``protected`` slots (read
        by loads planned in the same step) are not evicted. With ``parent`` (its tail parent
        key), the block is also filed for :meth:`match_tail`: a prompt that ends inside it (a
        regeneration, an edited reply) can load the prefix it repeats."""
        if block_hash in self._slot_of:
            self.touch(block_hash)
            return None
        slot = self._take_slot(protected or set())
        if slot is None:
            self.counters.save_skipped_full += 1
            return None
        self._slot_of[block_hash] = slot
        self._hash_of[slot] = block_hash
        self._tokens_of[slot] = tuple(tokens)
        if self._pin_counts.get(block_hash, 0) > 0:
            self._pinned_slots.add(slot)
        else:
            self._lru[slot] = None
        self.counters.saved_blocks += 1
        if _tail:
            self._tail_slots.add(slot)
        elif self.event_log is not None:
            self.event_log.add(("stored", block_hash))
        if parent is not None:
            self._file_under(parent, block_hash, slot)
        return slot

    def _file_under(self, parent: bytes, key: bytes, slot: int) -> None:
        siblings = self._tails_of.setdefault(parent, {})
        if len(siblings) < MAX_TAILS_PER_PARENT:
            siblings[key] = None
            self._parent_of[slot] = parent

    def allocate_tail(
        self, key: bytes, parent: bytes, tokens: Sequence[int], protected: set[int] | None = None
    ) -> int | None:
        """Reserve a slot for a tail (see :meth:`allocate`); also None when its parent already
        has :data:`MAX_TAILS_PER_PARENT` tails."""
        if key not in self._slot_of and len(self._tails_of.get(parent, ())) >= MAX_TAILS_PER_PARENT:
            return None
        slot = self.allocate(key, tokens, protected, _tail=True)
        if slot is not None:
            self.counters.saved_blocks -= 1  # counted as a tail, not a block
            self.counters.saved_tails += 1
            self._file_under(parent, key, slot)
        return slot

    def _take_slot(self, protected: set[int]) -> int | None:
        if self._free:
            return self._free.pop()
        for slot in self._lru:
            if slot in protected:
                continue
            self._drop(slot)
            self.counters.evictions += 1
            return slot
        return None

    def _drop(self, slot: int) -> None:
        block_hash = self._hash_of[slot]
        assert block_hash is not None
        self.states.release(slot)
        self.windows.release(slot)
        if slot in self._tail_slots:
            self._tail_slots.discard(slot)
        elif self.event_log is not None:
            self.event_log.add(("removed", block_hash))
        del self._slot_of[block_hash]
        self._hash_of[slot] = None
        self._tokens_of[slot] = None
        self._lru.pop(slot, None)
        self._pinned_slots.discard(slot)
        parent = self._parent_of.pop(slot, None)
        if parent is not None:
            siblings = self._tails_of[parent]
            siblings.pop(block_hash, None)
            if not siblings:
                del self._tails_of[parent]

    def pin(self, block_hash: bytes) -> None:
        count = self._pin_counts.get(block_hash, 0)
        self._pin_counts[block_hash] = count + 1
        if count == 0:
            slot = self._slot_of.get(block_hash)
            if slot is not None:
                self._lru.pop(slot, None)
                self._pinned_slots.add(slot)

    def unpin(self, block_hash: bytes) -> bool:
        """Drop one pin; True when this was the last one (the block is LRU again)."""
        count = self._pin_counts.get(block_hash, 0)
        if count <= 0:
            return False
        if count > 1:
            self._pin_counts[block_hash] = count - 1
            return False
        del self._pin_counts[block_hash]
        slot = self._slot_of.get(block_hash)
        if slot is not None:
            self._pinned_slots.discard(slot)
            self._lru[slot] = None  # most recently used: degrade to LRU, not to "evict next"
        return True

    def clear(self) -> int:
        """Forget every unpinned block (used by tests)."""
        dropped = 0
        for slot in list(self._lru):
            self._drop(slot)
            self._free.append(slot)
            dropped += 1
        return dropped

    def clear_all(self) -> int:
        """Forget every stored block and tail, pinned or not, and every pin count: the store
        is empty afterwards (a store reset: ``reset_prefix_cache?reset_external=true``, new
        weights, a reloaded LoRA). The caller drops the pins' owners (the leases) with it."""
        dropped = self.used_slots
        self._slot_of.clear()
        self._hash_of = [None] * self.num_slots
        self._tokens_of = [None] * self.num_slots
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._lru.clear()
        self._pinned_slots.clear()
        self._pin_counts.clear()
        self._tails_of.clear()
        self._parent_of.clear()
        self._tail_slots.clear()
        self.states.clear()
        self.windows.clear()
        if self.event_log is not None:
            self.event_log.add(("cleared", None))
        return dropped
