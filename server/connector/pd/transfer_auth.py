"""Transfer handles a peer can trust: sealed (HMAC) by the instance that issued them, claimed
before use, and used at most once.

A P/D transfer handle (``kv_transfer_params`` naming a peer's blocks: engine, host, port, block
ids, and the token ids and block hashes those blocks encode) makes the receiving engine read
*raw memory* of another engine. Anyone who can send a completion request can put such a handle
in its body, so an instance must only act on handles that one of its own cluster issued:

* **Seal.** The issuing connector adds :data:`MAC_FIELD`, an HMAC-SHA256 (key: the cluster
  secret shared by P, D — never the router's clients) over the canonical JSON of the
  :data:`SEALED_FIELDS` it returned. The ``do_remote_*`` flags stay outside the seal: the router
  flips them between legs. A forged, edited or out-of-range handle fails the check and is
  dropped before NIXL sees it (the request recomputes; NIXL never connects to a forged host).
* **Expiry.** The issuer stamps :data:`EXPIRES_FIELD` (wall clock, inside the seal); a handle
  past it is declined — decode-stamped, prefill-checked, as upstream fixed the same class of bug.
* **Claim.** D may release a held conversation early when new work needs its device blocks
  (a hold is a lease). So P pulls D's blocks only under a *claim*: the router asks D to claim
  the handle right before the turn; D answers with :data:`CLAIM_FIELD` (sealed, with its own
  short deadline) and promises not to release the hold before that deadline. A hold that D
  already released cannot be claimed: no pull, the turn recomputes.
* **Once.** The receiving side remembers the handles it consumed (:class:`ConsumedHandles`)
  and declines a replay.

Strength: HMAC-SHA256 with a 256-bit secret; the token ids are compared one by one and the
block hashes are vLLM's chained SHA-256 block hashes (they cover cache_salt, LoRA, multimodal
and prompt-embedding inputs).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import math
import os
import secrets
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from sdk.contract import CLAIM_FIELD

logger = logging.getLogger("kvbranch.transfer_auth")

#: Environment variable with the cluster secret (hex or any string), the same on P and D.
ENV_CLUSTER_SECRET = "KVBRANCH_CLUSTER_SECRET"
#: Without it, instances on one machine share a secret kept in a private file here.
DEFAULT_SECRET_FILE = Path.home() / ".cache" / "kvbranch" / "cluster-secret"

MAC_FIELD = "kvbranch_mac"
EXPIRES_FIELD = "kvbranch_expires_at"
TOKENS_FIELD = "kvbranch_token_ids"
HASHES_FIELD = "kvbranch_block_hashes"
IDENTITY_FIELD = "kvbranch_identity"
#: (:data:`CLAIM_FIELD`, the field of D's sealed claim, is the contract's: the router reads it.)

#: NIXL's fields that name a peer's blocks: which engine, where, which blocks, until when.
REMOTE_BLOCK_FIELDS = (
    "remote_block_ids",
    "remote_engine_id",
    "remote_request_id",
    "remote_host",
    "remote_port",
    "remote_num_tokens",
    "remote_blocks_expiry_time",
)
#: What the seal covers: everything that decides which memory is read and what it means.
SEALED_FIELDS = (
    *REMOTE_BLOCK_FIELDS,
    "tp_size",
    "dcp_size",
    "pp_size",
    "transfer_mode",
    TOKENS_FIELD,
    HASHES_FIELD,
    IDENTITY_FIELD,
    EXPIRES_FIELD,
)


def load_cluster_secret() -> bytes:
    """The cluster secret: ``$KVBRANCH_CLUSTER_SECRET``, else a private per-user file (created
    once, mode 0600), so that P and D on one machine agree without configuration. Instances on
    different machines need the variable; without it their handles fail the check (no pulls,
    never a wrong one)."""
    env = os.environ.get(ENV_CLUSTER_SECRET)
    if env:
        return env.encode()
    path = DEFAULT_SECRET_FILE
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(32))
        for _ in range(50):  # another instance may be writing it right now
            text = path.read_text().strip()
            if text:
                if path.stat().st_mode & 0o077:
                    raise PermissionError(f"{path} is readable by other users")
                return text.encode()
            time.sleep(0.02)
    except OSError as exc:
        logger.warning(
            "kvbranch: no cluster secret (%s); set %s on every P/D instance. "
            "Transfer handles from peers will be declined.",
            exc,
            ENV_CLUSTER_SECRET,
        )
    return secrets.token_bytes(32)  # this process only: nothing from a peer verifies


def _canonical(params: dict[str, Any], fields: tuple[str, ...]) -> bytes:
    return json.dumps(
        {k: params.get(k) for k in fields}, sort_keys=True, separators=(",", ":"), default=str
    ).encode()


def _mac(secret: bytes, payload: bytes) -> str:
    return hmac.new(secret, payload, hashlib.sha256).hexdigest()


def seal(params: dict[str, Any], secret: bytes) -> dict[str, Any]:
    """Add the MAC over :data:`SEALED_FIELDS` (in place; returns ``params``)."""
    params[MAC_FIELD] = _mac(secret, _canonical(params, SEALED_FIELDS))
    return params


def _digest_equal(mac: Any, expected: str) -> bool:
    """Constant-time compare of a client-supplied MAC with ours. ``hmac.compare_digest`` raises
    TypeError on a str with non-ASCII characters, and these checks run inside vLLM's scheduler
    (an exception there kills the engine core): anything but a 64-char ASCII hex string is
    simply not equal."""
    return (
        isinstance(mac, str)
        and len(mac) == len(expected)
        and mac.isascii()
        and hmac.compare_digest(mac, expected)
    )


def is_sealed(params: Any, secret: bytes) -> bool:
    """Whether ``params`` carries a valid seal. Never raises, whatever the input (non-ASCII or
    huge MACs, unserialisable, circular or deeply nested values: all just "not sealed")."""
    try:
        if not isinstance(params, dict):
            return False
        mac = params.get(MAC_FIELD)
        if not isinstance(mac, str):
            return False
        return _digest_equal(mac, _mac(secret, _canonical(params, SEALED_FIELDS)))
    except Exception:  # ValueError, RecursionError, ...: a client's doing
        return False


def expired(params: dict[str, Any], now: float | None = None) -> bool:
    at = params.get(EXPIRES_FIELD) if isinstance(params, dict) else None
    if not isinstance(at, (int, float)) or isinstance(at, bool) or not math.isfinite(at):
        return True
    return (time.time() if now is None else now) >= at


# --- claims ---------------------------------------------------------------------------------
def make_claim(params: dict[str, Any], until_wall: float, secret: bytes) -> dict[str, Any]:
    """D's promise not to release this handle's blocks before ``until_wall``; ``until_perf`` is
    the same deadline on D's ``perf_counter`` clock, the clock NIXL's worker checks (with its
    measured clock offset) right before it reads."""
    until_perf = time.perf_counter() + (until_wall - time.time())
    body = {"handle": params.get(MAC_FIELD), "until": until_wall, "until_perf": until_perf}
    return dict(body, mac=_mac(secret, json.dumps(body, sort_keys=True).encode()))


def claim_valid(params: Any, secret: bytes, margin_s: float, now: float | None = None) -> bool:
    """A sealed claim for exactly this handle whose deadline is more than ``margin_s`` away.
    Never raises (it runs in the scheduler: see :func:`_digest_equal`)."""
    try:
        claim = params.get(CLAIM_FIELD) if isinstance(params, dict) else None
        if not isinstance(claim, dict):
            return False
        until, mac = claim.get("until"), claim.get("mac")
        if (
            not isinstance(until, (int, float))
            or isinstance(until, bool)
            or not math.isfinite(until)
            or not isinstance(mac, str)
        ):
            return False
        handle = params.get(MAC_FIELD)
        body = {"handle": handle, "until": until, "until_perf": claim.get("until_perf")}
        expected = _mac(secret, json.dumps(body, sort_keys=True).encode())
        if not _digest_equal(mac, expected) or claim.get("handle") != handle:
            return False
        return (time.time() if now is None else now) + margin_s < until
    except Exception:  # huge ints, odd types: a client's doing, not ours
        return False


class ConsumedHandles:
    """Handles already used on this instance (bounded, forgotten after their expiry)."""

    def __init__(self, capacity: int = 65536) -> None:
        self.capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def consume(self, handle: str, expires_at: float) -> bool:
        """True the first time ``handle`` is seen (and records it), False on a replay."""
        now = time.time()
        with self._lock:
            while self._seen and (
                len(self._seen) >= self.capacity or next(iter(self._seen.values())) < now
            ):
                self._seen.popitem(last=False)
            if handle in self._seen:
                return False
            self._seen[handle] = max(expires_at, now)
            return True
