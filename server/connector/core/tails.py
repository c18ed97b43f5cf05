"""Token-exact reuse: the KV of a finished request's *tail* — the tokens after its last full
block whose KV was computed (the prompt's partial last block plus the generated tokens, minus
the last sampled token, which was never fed back) — kept in one host slot and loaded where a
later prompt repeats those tokens.

Why: full blocks are content-addressed by vLLM's chained block hashes, but a partial block has
no hash, so without tails every turn recomputes the previous turn's partial block and reply
(up to ``block_size - 1`` tokens of history).

Integrity, as for full blocks:

* a tail is found through its *parent key*: the chained hash of the full block before it (which
  names the exact token prefix, cache salt, LoRA and multimodal inputs) plus the request's
  identity (salt, LoRA name and path) — so a tail starting at token 0 is still scoped to its tenant;
* the tail's own token ids are stored and compared token by token; a prompt loads the longest
  common prefix of the stored tail and its own tokens. That prefix is exact because KV is
  causal: the KV at position ``p`` depends on tokens ``0..p`` only, all of which match (the
  parent chain covers everything before the tail). Positions past the prefix hold stale KV in
  the loaded block, which vLLM overwrites as it computes them and never reads before that;
* requests with multimodal inputs or prompt embeddings neither save nor load tails: their
  placeholder token ids do not identify the media.

Pure functions over duck-typed requests (``all_token_ids``, ``block_hashes``, ``cache_salt``,
``lora_request``, ``mm_features``, ``prompt_embeds``, ``num_computed_tokens``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_PARENT_TAG = b"kvbranch-tail-parent\x00"
_KEY_TAG = b"kvbranch-tail\x00"


def identity_of(request: Any) -> bytes | None:
    """What a tail's KV depends on besides its token prefix, or ``None`` when tails cannot be
    used for this request (multimodal inputs or prompt embeddings)."""
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return None
    lora = getattr(request, "lora_request", None)
    lora_name = getattr(lora, "lora_name", None) if lora is not None else None
    # The adapter's path too, as vLLM 0.32's block hashes (``_gen_lora_extra_hash_keys``):
    # a name re-pointed at another adapter must not reuse a tail that starts at token 0.
    lora_path = getattr(lora, "lora_path", None) if lora is not None else None
    salt = getattr(request, "cache_salt", None)
    return repr((salt, lora_name, lora_path)).encode()


def parent_key(block_hashes: Sequence[Any], start_block: int, identity: bytes) -> bytes:
    """The key tails starting at block ``start_block`` are filed under."""
    prev = bytes(block_hashes[start_block - 1]) if start_block > 0 else b""
    digest = hashlib.sha256(_PARENT_TAG)
    digest.update(len(prev).to_bytes(4, "little") + prev)
    digest.update(identity)
    return digest.digest()


def tail_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """A tail's own key: its parent and its exact tokens (equal tails share one slot)."""
    digest = hashlib.sha256(_KEY_TAG + parent)
    digest.update(b",".join(str(int(t)).encode() for t in tokens))
    return digest.digest()


@dataclass(frozen=True)
class TailSpec:
    """The tail of a finished request: tokens ``start .. start + len(tokens)``, held in the
    request's block number ``block`` (``start == block * block_size``)."""

    block: int
    start: int
    tokens: tuple[int, ...]
    parent: bytes
    key: bytes


def finished_tail(request: Any, block_size: int) -> TailSpec | None:
    """The tail worth keeping from a finished request, or None (no partial block with KV,
    or a request kind that cannot use tails).

    Only tokens whose KV is computed *and processed*: with async scheduling
    ``num_computed_tokens`` already counts tokens of a step still in flight; and the last
    sampled token is never fed back, so it has no KV."""
    identity = identity_of(request)
    if identity is None:
        return None
    tokens = list(request.all_token_ids)
    in_flight = int(getattr(request, "num_in_flight_tokens", 0) or 0)
    computed = min(request.num_computed_tokens - in_flight, len(tokens) - 1)
    if computed <= 0:
        return None
    start_block = computed // block_size
    start = start_block * block_size
    if computed == start or start_block > len(request.block_hashes):
        return None
    tail = tuple(tokens[start:computed])
    parent = parent_key(request.block_hashes, start_block, identity)
    return TailSpec(start_block, start, tail, parent, tail_key(parent, tail))
