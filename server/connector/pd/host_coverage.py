"""The ``host_coverage`` control op: how many leading blocks of a turn's prefix the host store
could load right now, and whether a revive request would hash them the same way.

An aggregated replica asks it before it revives a branch for a peer
(:mod:`server.plugin.revive`): a revive whose blocks miss the host store would make the replica
compute what the peer would compute itself, so the answer comes from the host store's block
index before any request is queued. Answered on the scheduler side, under the planner's lock
(the index's own), by reading the index only.

The ``run_coverage`` op is the same question for a prompt rather than a branch (a *block-run*
revive: a peer found, in the cluster index, that this replica's host store holds the longest
run of its prompt's blocks). The prompt's token ids come from the peer, so this engine hashes
them itself, with the caller's cache salt, and counts a block only where the store's slot
holds those very token ids: tokens the store does not have, under another salt or another
tenant's, cover nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

from server.connector.control.models import HostCoverage, RunCoverage
from server.connector.pd.transfer_params import identity_of


def leading_stored(hashes_hex: Sequence[str], stored: Callable[[bytes], bool]) -> int:
    """How many of ``hashes_hex`` (hex digests, in chain order) are stored, counted from the
    first until one is missing (a block without its predecessors cannot be loaded)."""
    n = 0
    for h in hashes_hex:
        try:
            key = bytes.fromhex(h)
        except ValueError:
            break
        if not stored(key):
            break
        n += 1
    return n


def revive_identity(cache_salt: str | None, compat: dict[str, Any]) -> str:
    """The identity a revive request has on this engine: the turn's cache salt, no adapter, no
    media, no embeddings (what :func:`~server.connector.pd.transfer_params.identity_of` reads)."""
    request = SimpleNamespace(
        cache_salt=cache_salt, lora_request=None, mm_features=None, prompt_embeds=None
    )
    return identity_of(request, compat)


def run_coverage(
    req: RunCoverage,
    index: Any,
    compat: dict[str, Any],
    hasher: Callable[[list[int], str | None], list[bytes]],
    block_size: int,
) -> dict[str, Any]:
    """The op's answer: the prompt's hashes, and its leading blocks the host store holds with
    the same token ids (``index.match``, read only)."""
    tokens = list(req.token_ids)
    hashes = hasher(tokens, req.cache_salt)
    slots = index.match(hashes, tokens, block_size, 0, len(hashes)) if hashes else []
    return {
        "hashes": [h.hex() for h in hashes],
        "blocks": len(slots),
        "identity": revive_identity(req.cache_salt, compat),
    }


def host_coverage(req: HostCoverage, index: Any, compat: dict[str, Any]) -> dict[str, Any]:
    """The op's answer from the host store's block index (``in``: a stored block hash)."""
    return {
        "blocks": leading_stored(req.hashes, index.__contains__),
        "identity_ok": revive_identity(req.cache_salt, compat) == req.identity,
    }
