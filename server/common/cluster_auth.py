"""What proves that a request to a P/D instance came from this cluster's router.

P and D act on ``kv_transfer_params`` (NIXL reads a peer's raw KV memory for them, or keeps
blocks and exposes them for a peer's read) and on hold claims (D promises to keep blocks). A
client that can reach an instance's port must not be able to send either: the seal on D's
handles (:mod:`server.connector.pd.transfer_auth`) protects *what* is read, but a client's own
params would still make P hold blocks for a decode that never comes, or make upstream's NIXL
code contact a host of the client's choosing before any check runs.

So the router signs every request it sends with transfer params or a claim:
:data:`ROUTER_PROOF_HEADER` = ``"<unix ms>.<hex HMAC-SHA256>"``, keyed with the cluster secret
(the one P and D seal handles with; clients never have it), over the method, the path and the
*exact body bytes*. The instance checks it before anything reads the body's params
(:mod:`server.plugin.cluster_gate`): a missing, stale (more than :data:`MAX_SKEW_S` away) or
wrong proof means the params are the client's, and the request is refused with a 403 that says
so. The header is never echoed back, so a client never sees a proof it could replay, and a proof
covers only its own body.

Why a header and not a field of the params: the decision that a check runs must not depend on
anything the client controls in the body it sends; an unforgeable proof outside the params
decides it.
"""

from __future__ import annotations

import hashlib
import hmac
import time

#: The router's proof on a request to an instance (lower case: ASGI header names).
ROUTER_PROOF_HEADER = "x-kvbranch-router-proof"
#: A proof older or newer than this is refused (the router and the instances share a clock on
#: one machine; across machines, NTP keeps them well within it).
MAX_SKEW_S = 300.0
_CONTEXT = b"kvbranch-router-proof-v1"


def _mac(secret: bytes, stamp: str, method: str, path: str, body: bytes) -> str:
    message = b"\n".join(
        (
            _CONTEXT,
            stamp.encode(),
            method.upper().encode(),
            path.encode(),
            hashlib.sha256(body).digest(),
        )
    )
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def sign(secret: bytes, method: str, path: str, body: bytes, now: float | None = None) -> str:
    """The proof header's value for this request."""
    stamp = str(int((time.time() if now is None else now) * 1000))
    return f"{stamp}.{_mac(secret, stamp, method, path, body)}"


def verify(
    secret: bytes,
    proof: str | None,
    method: str,
    path: str,
    body: bytes,
    now: float | None = None,
) -> bool:
    """Whether ``proof`` is the router's for exactly this request, and fresh. Never raises."""
    if not isinstance(proof, str) or len(proof) > 200:
        return False
    stamp, _, mac = proof.partition(".")
    if not (stamp.isascii() and stamp.isdigit()) or len(stamp) > 16 or not mac.isascii():
        return False
    at = int(stamp) / 1000
    if abs((time.time() if now is None else now) - at) > MAX_SKEW_S:
        return False
    try:
        expected = _mac(secret, stamp, method, path, body)
    except (TypeError, ValueError, UnicodeError):
        return False
    return hmac.compare_digest(mac, expected)
