"""Which engines the host store can serve, read from the kinds of their KV cache groups.

The host store keeps, per block hash, the K and V of ``block_size`` tokens at every layer, and
loads them back as the prefix of a later request. That is right only for a KV cache group whose
blocks hold every token of the request for as long as it runs: full attention (MLA included).
vLLM's other groups do not: a sliding-window or chunked-local group frees (and reuses) blocks
that fell out of the window while the request still runs, and a Mamba group holds a running
state, not per-token KV. So:

* one full-attention group — the store is on. This is also what a model with sliding-window
  layers gets from vLLM when the hybrid KV cache manager is off (vLLM turns it off for a
  connector that does not declare ``SupportsHMA``, as this one): every layer's blocks are
  managed as full attention (the window still limits the attention compute);
* one group of another kind (every layer windowed, a pure SSM) — the store is off, with a
  warning: the engine runs as plain vLLM (its own prefix cache only), never loading KV a
  window or a state would have dropped;
* several groups — the hybrid manager is on (only a composing connector that declares
  ``SupportsHMA``, or a start that forced it, gets here): refused at start with what to do,
  since a non-HMA connector under it fails at the first finished request.

Pure: kinds are strings (``vllm_compat.kv_group_kinds`` reads them from vLLM).
"""

from __future__ import annotations

from collections.abc import Sequence

#: The one group kind the host store keeps.
FULL_ATTENTION = "full_attention"


class HybridKVCacheError(ValueError):
    """The engine runs vLLM's hybrid KV cache manager (several KV cache groups)."""


def check_groups(kinds: Sequence[str]) -> None:
    """Raise :class:`HybridKVCacheError` when there is more than one KV cache group."""
    if len(kinds) > 1:
        raise HybridKVCacheError(
            f"the kvbranch connector supports one KV cache group; this engine has "
            f"{len(kinds)} ({', '.join(kinds)}): vLLM's hybrid KV cache manager is on. Start "
            "vLLM with --disable-hybrid-kv-cache-manager (python -m server does); hybrid "
            "attention/SSM models do not run with the connector at all (docs/models.md)"
        )


def store_off_reason(kinds: Sequence[str]) -> str | None:
    """Why the host store must stay off for an engine with these KV cache groups, or ``None``
    when it can be on (one full-attention group). Call :func:`check_groups` first."""
    if not kinds:
        return "the model has no KV cache (attention-free)"
    if len(kinds) > 1:
        return f"{len(kinds)} KV cache groups ({', '.join(kinds)})"
    if kinds[0] != FULL_ATTENTION:
        return (
            f"its KV cache group is {kinds[0]}, whose blocks vLLM drops or rewrites while a "
            "request runs; the host store keeps full-attention blocks only"
        )
    return None
