"""Tenants: with ``--api-key`` each key is a tenant. A tenant's id (``owner``) is a keyed digest
of its key — the key itself is never stored or logged — and it scopes sessions (another key
gets 404) and salts the prefix cache (vLLM's ``cache_salt``)."""

from __future__ import annotations

import hashlib
import os

from server.cli import ENV_API_KEYS  # the launcher sets it from --api-key


def owner_of(authorization: str | None) -> str | None:
    """``None`` when the server has no keys (single tenant), else ``t_<digest>``."""
    if not os.environ.get(ENV_API_KEYS):
        return None
    if not authorization or not authorization.lower().startswith("bearer "):
        return None
    key = authorization[7:].strip()
    return "t_" + hashlib.sha256(b"kvbranch-tenant\0" + key.encode()).hexdigest()[:32]
