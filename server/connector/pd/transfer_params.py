"""Which ``kv_transfer_params`` a P/D instance accepts from a client, and what they may mean.

A request's ``kv_transfer_params`` is the client's dict (vLLM hands the body's field to the
engine as is), and upstream ``NixlConnector`` reads it on the scheduler thread: which peer to
contact (host, port: heartbeats and handshakes), whose memory to read, and its own internal
markers (``_remote_blocks_processed``, ``_p_side_truncated``) that it sets on the same dict
after it processed it. A client that sets such a marker itself skips upstream's work, or ours:
a client-set ``kvbranch_verified`` once read another tenant's KV, and a client-set
``_remote_blocks_processed`` hung (then killed) an engine (docs/pd_notes.md). So, on the first
sight of a request, before any upstream hook sees the dict, :func:`sanitize` keeps only
:data:`INCOMING_KEYS`: the keys upstream's pull connector reads from a peer's handle
(``nixl/pull_scheduler.py``, ``nixl/base_scheduler.py``, ``nixl/metadata.py`` in vLLM 0.32) and
our sealed fields and claim. Markers set later by
upstream on the (now server-owned) dict keep working; the verification state itself lives on
the server (:class:`server.connector.pd.verified_nixl.VerifiedNixlConnector`), never in the dict.

``remote_block_size`` is read by upstream's metadata but never issued by upstream's
``request_finished`` (so no router carries it) and sits outside our seal: dropped.

The pure checks of a handle (token prefix, identity, block hashes, trimmed block list) live
here too; the connector runs them.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from server.connector.core.kv_groups import CHUNKED_LOCAL, FULL_ATTENTION, SLIDING_WINDOW, STATE
from server.connector.pd.transfer_auth import (
    CLAIM_FIELD,
    HASHES_FIELD,
    IDENTITY_FIELD,
    MAC_FIELD,
    REMOTE_BLOCK_FIELDS,
    SEALED_FIELDS,
    TOKENS_FIELD,
)

#: The direction flags: outside the seal, the router flips them between legs.
DIRECTION_KEYS = ("do_remote_prefill", "do_remote_decode")
#: Everything an incoming request may carry: upstream's keys a peer's handle has (all of them
#: sealed but the direction flags), our sealed fields, the seal and D's claim.
INCOMING_KEYS = frozenset((*DIRECTION_KEYS, *SEALED_FIELDS, MAC_FIELD, CLAIM_FIELD))
#: What :func:`strip` removes: every field that names a peer (where to connect, which blocks)
#: or vouches for it. After a strip upstream has nothing to contact and nothing to read.
PEER_FIELDS = (*SEALED_FIELDS, MAC_FIELD, CLAIM_FIELD, "remote_block_size")


#: Keys upstream adds to a prefill's returned params for D's *API server*, not its connector:
#: ``remote_prefill_cached_tokens`` (P's prefix-cache hits, which vLLM 0.32's scheduler writes
#: into P's params so that D reports them in ``prompt_tokens_details``). D's API server reads
#: it from the request before the engine core gets it (``output_processor``) and upstream's
#: connector never does, so the engine core drops it like any other key, but without a log
#: line: it comes with every P/D turn, and is no sign of a client or router misbehaving.
EXPECTED_EXTRA_KEYS = frozenset({"remote_prefill_cached_tokens"})


def sanitize(params: dict[str, Any]) -> list[str]:
    """Drop (in place) every key not in :data:`INCOMING_KEYS`; returns the dropped keys worth
    a log line (all but :data:`EXPECTED_EXTRA_KEYS`)."""
    dropped = [k for k in params if k not in INCOMING_KEYS]
    for key in dropped:
        del params[key]
    return [k for k in dropped if k not in EXPECTED_EXTRA_KEYS]


def names_a_peer(params: dict[str, Any]) -> bool:
    """The params would make upstream contact a peer or read its memory: a handle to check."""
    return bool(params.get("do_remote_prefill")) or any(
        params.get(k) is not None for k in REMOTE_BLOCK_FIELDS
    )


def strip(params: dict[str, Any]) -> None:
    """Forget a peer handle this instance will not honour: nothing is read, no peer contacted
    (no heartbeat, no handshake: upstream needs ``remote_engine_id``/``host``/``port``)."""
    for key in PEER_FIELDS:
        params.pop(key, None)
    params["do_remote_prefill"] = False


def compat_of(vllm_config: Any) -> dict[str, Any]:
    """What two engines must share for one's KV blocks to mean the same on the other: the
    model (weights and dtype), the KV cache dtype and the block size (the trimmed block list
    counts blocks of this instance's size)."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    return {
        "model": str(getattr(model, "model", None)),
        "dtype": str(getattr(model, "dtype", None)),
        "kv_dtype": str(getattr(cache, "cache_dtype", None)),
        "block_size": getattr(cache, "block_size", None),
    }


def verified_prefix(remote_tokens: Any, prompt_tokens: list[int]) -> int:
    """How many leading prompt tokens equal the tokens D holds KV for (0 if unknown).

    At most ``len(prompt) - 1``: the engine must compute the last prompt token itself."""
    if not isinstance(remote_tokens, list) or not prompt_tokens:
        return 0
    limit = min(len(remote_tokens), len(prompt_tokens) - 1)
    n = 0
    while n < limit and remote_tokens[n] == prompt_tokens[n]:
        n += 1
    return n


def block_hashes_hex(request: Any, num_blocks: int) -> list[str]:
    return [bytes(h).hex() for h in list(getattr(request, "block_hashes", []) or [])[:num_blocks]]


def identity_of(request: Any, compat: dict[str, Any] | None = None) -> str:
    """What the KV of a token sequence depends on besides the tokens: the cache salt (tenant),
    the LoRA adapter, multimodal inputs and prompt embeddings, and the engine's
    :func:`compat_of` (a handle from an incompatible peer fails the identity check)."""
    lora = getattr(request, "lora_request", None)
    ident = {
        "salt": getattr(request, "cache_salt", None),
        "lora": getattr(lora, "lora_name", None) if lora is not None else None,
        "mm": bool(getattr(request, "mm_features", None)),
        "embeds": getattr(request, "prompt_embeds", None) is not None,
        "engine": compat or {},
    }
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


def pullable_tokens(
    params: dict[str, Any], request: Any, block_size: int, compat: dict[str, Any] | None = None
) -> int:
    """Tokens of D's handle that P may read for ``request``: the longest token-identical prefix
    (capped at prompt length - 1), kept only when the identity (salt, LoRA, engine, ...) is the
    same and D's chained block hash of the last full verified block equals P's own. Pure."""
    if params.get(IDENTITY_FIELD) != identity_of(request, compat):
        return 0
    if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
        return 0  # placeholder token ids do not identify the media: whole blocks only, not here
    prompt = list(request.prompt_token_ids or [])
    held = params.get("remote_num_tokens")
    if not isinstance(held, int) or isinstance(held, bool) or held <= 0:
        return 0
    n = min(held, verified_prefix(params.get(TOKENS_FIELD), prompt))
    full = n // block_size
    if full:
        theirs = params.get(HASHES_FIELD)
        ours = block_hashes_hex(request, full)
        if (
            not isinstance(theirs, list)
            or len(theirs) < full
            or len(ours) < full
            or theirs[full - 1] != ours[full - 1]
        ):
            return 0
    return n


def trim_block_ids(
    block_ids: Any,
    num_tokens: int,
    block_size: int,
    kinds: Sequence[str] = (FULL_ATTENTION,),
    held_tokens: int | None = None,
) -> list[list[int]] | None:
    """D's block lists (one per KV cache group NIXL transfers, ``kinds`` in order) cut to what
    P may read for the first ``num_tokens`` tokens, or None when nothing can be pulled.

    NIXL's worker pairs P's *unfilled* blocks with the *last* ones of D's list, per group
    (``_apply_prefix_caching`` end-trims):

    * a full-attention group is cut to the blocks of the first ``num_tokens`` tokens, or an
      untrimmed list would put D's last blocks into P's first positions whenever the verified
      prefix is shorter than what D holds;
    * a sliding-window (or chunked-local) group arrives as D clipped it, the window before the
      end of D's ``held_tokens``: it lines up with P's window only when the verified prefix ends
      in D's last block. A shorter prefix needs window blocks D has already freed: nothing;
    * a state group (Mamba, Gated DeltaNet) holds the state after D's last token: only a prefix
      of exactly ``held_tokens`` can continue from it.

    Any other kind, a group count that differs from ``kinds`` or ids that are not block ids:
    nothing is pulled."""
    if (
        not isinstance(block_ids, list | tuple)
        or len(block_ids) != len(kinds)
        or not all(isinstance(group, list) for group in block_ids)
    ):
        return None
    if not all(
        isinstance(b, int) and not isinstance(b, bool) and b >= 0
        for group in block_ids
        for b in group
    ):
        return None
    need = -(-num_tokens // block_size)
    held = num_tokens if held_tokens is None else held_tokens
    trimmed: list[list[int]] = []
    for kind, group in zip(kinds, block_ids, strict=True):
        if kind == FULL_ATTENTION:
            if need > len(group):
                return None
            trimmed.append(list(group[:need]))
        elif kind in (SLIDING_WINDOW, CHUNKED_LOCAL):
            if need != -(-held // block_size) or not group:
                return None
            trimmed.append(list(group))
        elif kind == STATE:
            if num_tokens != held or not group:
                return None
            trimmed.append(list(group))
        else:
            return None
    return trimmed
