"""Which engines the host store can serve, read from the kinds of their KV cache groups.

The connector declares vLLM's ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on:
a model whose layers differ in how they keep KV gets one KV cache group per kind (and several
groups of one kind when the layer counts call for it), each with its own block table.

The host store keeps, per block position of a prompt, the KV of that position in *every*
group: a slot is one block of every layer. That serves every group whose blocks hold per-token
K and V:

* full attention (MLA's latent included): every block of the request stays while it runs;
* sliding window and chunked-local attention: vLLM frees the blocks the window left behind
  (they become the null block in the request's table), but a block is saved in the step that
  fills it, when every group still has it, so a stored slot is whole. When a later request
  loads a prefix, vLLM allocates only the blocks each group still needs (the window before the
  hit's end) and pads the rest with the null block; the connector copies into what was
  allocated and skips the nulls. A hit therefore needs nothing more than the full-attention
  rule: consecutive whole slots.

Groups of another kind — a Mamba or linear-attention state (Mamba2, Gated DeltaNet), whose
block is a running state rather than per-token KV — are not stored: an engine with one turns
its host store off and runs as plain vLLM (its own prefix cache), with a warning. Groups of
different block sizes (vLLM gives SSM groups their own) are refused the same way, since a slot
is one block position of every group.

Pure: kinds are strings (``vllm_compat.kv_group_kinds`` reads them from vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence

#: Kinds whose blocks hold per-token K and V (``vllm_compat.spec_kind``).
FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
CHUNKED_LOCAL = "chunked_local"
STORED_KINDS = frozenset({FULL_ATTENTION, SLIDING_WINDOW, CHUNKED_LOCAL})


def store_off_reason(kinds: Sequence[str], block_sizes: Sequence[int] = ()) -> str | None:
    """Why the host store must stay off for an engine with these KV cache groups, or ``None``
    when it can be on (every group of a stored kind, one block size)."""
    if not kinds:
        return "the model has no KV cache (attention-free)"
    other = sorted({kind for kind in kinds if kind not in STORED_KINDS})
    if other:
        return (
            f"its KV cache groups ({', '.join(kinds)}) include {', '.join(other)}, whose "
            "blocks hold a running state rather than per-token KV; the host store keeps "
            "attention KV only"
        )
    if len(set(block_sizes)) > 1:
        return (
            f"its KV cache groups have different block sizes ({', '.join(map(str, block_sizes))})"
            "; a host store slot is one block position of every group"
        )
    return None
