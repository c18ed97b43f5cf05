"""One tenant digest for the whole server: an API key's tenant id, shared by the plugin (which
scopes sessions and salts the prefix cache with it, :mod:`server.plugin.tenancy`) and the P/D
router (which scopes its cluster index with it), so both name a tenant the same way.

The key itself is never stored or logged, only this digest. Pure standard library: the router
imports it without the plugin or vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Iterable
from typing import Any

__all__ = ["ANONYMOUS", "KeyTable", "bearer_key", "keys_of", "scope_of", "tenant_id"]

#: 128 bits of the digest, as hex.
DIGEST_CHARS = 32
#: The scope of a request without an ``Authorization`` header.
ANONYMOUS = "-"


def tenant_id(key: str) -> str:
    """``t_`` + 128 bits of a domain-separated sha256 of the key."""
    return "t_" + hashlib.sha256(b"kvbranch-tenant\0" + key.encode()).hexdigest()[:DIGEST_CHARS]


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, parsed as vLLM parses it (scheme
    case-insensitive, the rest after one space is the key); None for any other header."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    return key if scheme.lower() == "bearer" else None


def scope_of(authorization: str | None) -> str:
    """Whose request this is, for state kept per caller without knowing the keys (the router's
    index): the tenant id of its bearer key — the owner the instances give it when the key is
    theirs — :data:`ANONYMOUS` without a header, and a digest of the whole header otherwise
    (so two different headers never share a scope)."""
    if not authorization:
        return ANONYMOUS
    key = bearer_key(authorization)
    if key is not None:
        return tenant_id(key)
    digest = hashlib.sha256(b"kvbranch-authorization\0" + authorization.encode())
    return "h_" + digest.hexdigest()[:DIGEST_CHARS]


def keys_of(args: Any) -> list[str]:
    """The keys vLLM enforces for these arguments (its rule: ``--api-key`` wins over
    ``VLLM_API_KEY``; empty ones are dropped) — the instances' keys, and the router's."""
    listed = getattr(args, "api_key", None)
    return [k for k in (listed or [os.environ.get("VLLM_API_KEY")]) if k]


class KeyTable:
    """A server's API keys, held as digests: :meth:`owner` is the tenant of a request's
    ``Authorization`` header when it carries one of them. One table for both doors — the
    instances (:mod:`server.plugin.tenancy`) and the router (:mod:`server.router.edge`) — so
    both accept exactly the same keys and name their tenants the same way."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = {hashlib.sha256(k.encode()).digest(): tenant_id(k) for k in keys if k}

    def __bool__(self) -> bool:
        return bool(self._digests)

    def owner(self, authorization: str | None) -> str | None:
        """The tenant of a configured bearer key, parsed as vLLM parses it; ``None`` without
        keys, without a header, or for a key this server does not have."""
        key = bearer_key(authorization)
        if not self._digests or key is None:
            return None
        try:
            digest = hashlib.sha256(key.encode("utf-8")).digest()
        except UnicodeEncodeError:  # a lone surrogate: not any key of ours
            return None
        owner = None
        for known, tenant in self._digests.items():  # compare all: no hint of which matched
            if hmac.compare_digest(digest, known):
                owner = tenant
        return owner
