"""The nouns of the session registry: sessions, branches, ids and the errors its operations
raise (each carries the HTTP status the routes answer with). Kept apart from the registry's
logic so that the pin leases (``leases.py``) and the registry (``sessions.py``) share them
without importing each other.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

DEFAULT_BRANCH = "main"
DEFAULT_MAX_SESSIONS_PER_TENANT = 1000
DEFAULT_MAX_BRANCHES_PER_SESSION = 256
DEFAULT_IDLE_TTL_S = 6 * 3600.0

#: (owner, session id): the registry's key of a session.
SessionKey = tuple[str | None, str]
LeaseKey = tuple[str | None, str, str]  # (owner, session id, branch id)


class RegistryError(Exception):
    status = 400

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class NotFound(RegistryError):
    status = 404


class Conflict(RegistryError):
    status = 409


class QuotaExceeded(RegistryError):
    status = 429


class KeyRequired(RegistryError):
    status = 401


def new_id(prefix: str) -> str:
    """Unguessable ids: 128 random bits."""
    return f"{prefix}_{secrets.token_urlsafe(16)}"


@dataclass
class Branch:
    session_id: str
    branch_id: str
    parent: str | None = None
    fork_offset_tokens: int | None = None
    token_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    pinned_hashes: list[bytes] = field(default_factory=list)
    pin_expires_at: float | None = None
    pin_ttl_s: float | None = None
    pinned_at: float = 0.0
    degraded: bool = False
    cache_salt: str | None = None
    requests: int = 0
    owner: str | None = None
    #: The branch's tail (``tails.py``): its key in the store and the token it starts at.
    tail_key: bytes | None = None
    tail_start: int = 0

    def wanted_pins(self) -> list[bytes]:
        """What a pin of this branch holds: its full blocks and its tail."""
        wanted = list(self.block_hashes)
        if self.tail_key is not None:
            wanted.append(self.tail_key)
        return list(dict.fromkeys(wanted))

    @property
    def pinned(self) -> bool:
        return self.pin_expires_at is not None and not self.degraded

    @property
    def lease_key(self) -> LeaseKey:
        return (self.owner, self.session_id, self.branch_id)


@dataclass
class Session:
    session_id: str
    created_at: float
    auto_pin: bool
    pin_ttl_s: float
    owner: str | None = None
    branches: dict[str, Branch] = field(default_factory=dict)
    last_used: float = 0.0
