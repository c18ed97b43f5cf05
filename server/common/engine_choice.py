"""Which data-parallel engine keeps a session: one rule for the API server's plugin (which sends
a session's turns and routes there) and the engine cores (which keep no session state for a
session another engine owns). Standard library only: both processes import it."""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = ["engine_count", "engine_of"]


def engine_count(engine_client: Any) -> int:
    """The data-parallel engines behind an API server's engine client (its config's
    ``data_parallel_size``; 1 without data parallel)."""
    parallel = getattr(getattr(engine_client, "vllm_config", None), "parallel_config", None)
    return int(getattr(parallel, "data_parallel_size", 1) or 1)


def engine_of(owner: str | None, session_id: str, engines: int) -> int:
    """The engine that serves ``owner``'s session ``session_id``: stable across requests,
    processes and restarts (a digest, not Python's salted ``hash``)."""
    if engines <= 1:
        return 0
    digest = hashlib.sha256(
        b"kvbranch-engine\0" + (owner or "").encode() + b"\0" + session_id.encode()
    ).digest()
    return int.from_bytes(digest[:8], "big") % engines
