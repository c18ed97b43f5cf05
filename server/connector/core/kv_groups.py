"""Which engines the host store can serve, read from the kinds of their KV cache groups.

The connector declares vLLM's ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on:
a model whose layers differ in how they keep KV gets one KV cache group per kind (and several
groups of one kind when the layer counts call for it), each with its own block table.

The host store keeps, per block position of a prompt, the KV of that position in every group
whose blocks hold per-token K and V:

* full attention (MLA's latent included): in the position's slot, every block of the request;
* sliding window and chunked-local attention: vLLM frees the blocks the window left behind
  (they become the null block in the request's table), and a resume after *n* tokens reads only
  the positions from :meth:`WindowRule.first_block` on. Their block of a position is a *window
  part* in a pool of its own (``part_pool.py``), kept only where a resume reads it; a hit ends
  only where the window's positions have their parts. vLLM allocates only the blocks each group
  still needs (the window before the hit's end) and pads the rest with the null block; the
  connector copies into what was allocated and skips the nulls.

State groups — Mamba and Gated DeltaNet (vLLM's ``MambaSpec``), whose block holds a running
state rather than per-token KV — are stored too, where vLLM keeps their states at block
boundaries (its prefix caching's ``align`` mode): a slot then also has, when vLLM kept one, a
*state part* (``part_pool.py``) with the state after the slot's last token, from the block
vLLM's prefix cache keeps under the block's hash (an ``align`` table is not positional: its
state blocks cannot be read by position). A hit may end only at a slot holding a state, a
resumed turn loads the attention KV of every position and the state of the last one, and no
token-exact tail is kept (a state exists only at block boundaries). Without ``align`` (prefix
caching off: vLLM keeps no state but the running one) the store stays off, as it does for
groups of any other kind and for groups of different block sizes, since a slot is one block
position of every group.

Pure: kinds are strings (``vllm_compat.kv_group_kinds`` reads them from vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

#: Kinds whose blocks hold per-token K and V (``vllm_compat.spec_kind``).
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
CHUNKED_LOCAL = "chunked_local"
STORED_KINDS = frozenset({FULL_ATTENTION, SLIDING_WINDOW, CHUNKED_LOCAL})
#: Kinds whose blocks hold a recurrent state (stored at block boundaries only).
STATE = "mamba"


@dataclass(frozen=True)
class GroupWindow:
    """How far back one windowed group attends: ``sliding_window`` tokens (plus the trailing
    tokens vLLM retains for multi-module speculative decoding), or the current chunk of
    ``chunk`` tokens (chunked-local attention)."""

    kind: str
    tokens: int
    extra_retained: int = 0

    def skipped_tokens(self, computed: int) -> int:
        """The leading tokens this group no longer reads once ``computed`` tokens are done:
        vLLM's ``get_num_skipped_tokens`` for the group's manager (its blocks there are the
        null block in the request's table)."""
        if self.kind == CHUNKED_LOCAL:
            return computed // self.tokens * self.tokens
        return max(0, computed - self.tokens + 1 - self.extra_retained)


@dataclass(frozen=True)
class WindowRule:
    """Which block positions a resume needs from the windowed groups (sliding window,
    chunked local): a prefix of ``n`` tokens loaded from outside is continued only from the
    positions vLLM allocates for those groups, those at or after ``first_block(n)`` (vLLM pads
    the ones before with the null block). The host store keeps the windowed groups' part of a
    position only where some resume point needs it (``core/part_pool.py``)."""

    groups: frozenset[int]
    windows: tuple[GroupWindow, ...]
    block_size: int

    def first_block(self, n_tokens: int) -> int:
        """The first block position any windowed group reads after a prefix of ``n_tokens``."""
        return min(w.skipped_tokens(n_tokens) for w in self.windows) // self.block_size


def state_groups(kinds: Sequence[str]) -> frozenset[int]:
    """The indices of the groups that hold a recurrent state rather than per-token KV."""
    return frozenset(i for i, kind in enumerate(kinds) if kind == STATE)


def store_off_reason(
    kinds: Sequence[str], block_sizes: Sequence[int] = (), *, states_at_boundaries: bool = False
) -> str | None:
    """Why the host store must stay off for an engine with these KV cache groups, or ``None``
    when it can be on (every group of a stored kind, one block size). ``states_at_boundaries``:
    vLLM keeps the state groups' states at block boundaries (``align``) and hands them over."""
    if not kinds:
        return "the model has no KV cache (attention-free)"
    if all(kind == STATE for kind in kinds):
        return "the model has no attention layers (only recurrent states)"
    if STATE in kinds and not states_at_boundaries:
        return (
            f"its KV cache groups ({', '.join(kinds)}) include recurrent states, which vLLM "
            "keeps at block boundaries only with prefix caching on (mamba_cache_mode 'align'); "
            "without it there is no state to resume from"
        )
    other = sorted({kind for kind in kinds if kind not in STORED_KINDS and kind != STATE})
    if other:
        return (
            f"its KV cache groups ({', '.join(kinds)}) include {', '.join(other)}, which the "
            "host store cannot keep"
        )
    if len(set(block_sizes)) > 1:
        return (
            f"its KV cache groups have different block sizes ({', '.join(map(str, block_sizes))})"
            "; a host store slot is one block position of every group"
        )
    return None
