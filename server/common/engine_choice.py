"""Which data-parallel engine keeps a session: one rule for the API server's plugin (which sends
a session's turns and routes there) and the engine cores (which keep no session state for a
session another engine owns). Standard library only: both processes import it."""

from __future__ import annotations

import hashlib

__all__ = ["engine_of"]


def engine_of(owner: str | None, session_id: str, engines: int) -> int:
    """The engine that serves ``owner``'s session ``session_id``: stable across requests,
    processes and restarts (a digest, not Python's salted ``hash``)."""
    if engines <= 1:
        return 0
    digest = hashlib.sha256(
        b"kvbranch-engine\0" + (owner or "").encode() + b"\0" + session_id.encode()
    ).digest()
    return int.from_bytes(digest[:8], "big") % engines
