"""What a replica agrees to revive from its host store for a peer, decided before any engine work.

An aggregated replica's hold on a turn's device blocks ends after ``--pd-hold-ttl-s`` or when
new work needs the blocks; its host store keeps the history much longer. A peer that gets the
branch's next turn then asks it to *revive* the branch (:mod:`server.plugin.revive`): load the
prefix its host store still has into device blocks with a one-token prefill and hold them as
after a turn, so that the peer claims and pulls them as usual. These rules keep that request
from costing the holder what the peer would compute itself:

* the prefix is cut to the run of leading blocks the host store holds (the holder's block index
  answers before anything runs), plus one token: vLLM computes at least one prompt token, and
  with whole blocks only the last block would be recomputed;
* it must come to at least ``min_tokens`` (a claim and a pull cost more than a smaller
  prefill), and it is cut to ``max_tokens`` (the size limit: a revive loads at most that many);
* the turn's identity (cache salt, adapter, engine) must be what the revive request will carry,
  or its block hashes would miss the store and the holder would compute the whole prefix.

A *block-run* revive also names the member whose host store the index listed (``member``: on
a data-parallel holder, one member per engine, it says which engine's store to load from; a
member id that is not one of the holder's is a 404). It is asked for a turn the holder has no
record of (a session-less turn, a
fork's new branch, a refused home): the asking peer found in the cluster index that the
holder's host store has the longest run of its prompt's blocks, and sends the prompt's token
ids up to that run's end, with its cache salt. The holder takes neither on trust: it hashes the
token ids itself with that salt and counts only blocks whose stored token ids are those very
ones; and the salt must be one of the caller's tenant's (:func:`salt_refusal`), so that one
tenant's key cannot name another's salt. Blocks are hashed with the salt, so another tenant's
history is never even found.

Pure: the caller reads the holder's records and block index.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sdk.contract import DEFAULT_BRANCH, check_id
from server.checks.ids import MESSAGE_CHARS

#: The holder's route a peer asks; signed with the cluster secret (the guard refuses others).
REVIVE_PATH = "/v1/kvbranch/holds/revive"
#: The answer's field: the fresh sealed handle, claimed and pulled as any hold.
REVIVE_HANDLE_FIELD = "handle"
#: Most tokens one revive loads (the rest of a longer history is recomputed by the peer).
MAX_REVIVE_TOKENS = 65_536


@dataclass(frozen=True)
class Refusal:
    """Why a revive is not done: the HTTP status, a metric label and a message."""

    status: int
    reason: str
    message: str


@dataclass(frozen=True)
class ReviveTarget:
    """The branch a peer names: its session and branch ids (the tenant is the caller's key).
    A block-run revive also names the prompt's token ids (up to the run's end) and its cache
    salt; a branch revive names neither (``token_ids`` is None)."""

    session_id: str
    branch_id: str
    token_ids: list[int] | None = None
    cache_salt: str | None = None
    #: The holder's member the index listed the run under (a block-run revive; None: the
    #: holder's first engine).
    member: str | None = None


_BRANCH_FIELDS = frozenset(("session_id", "branch_id"))
_RUN_FIELDS = _BRANCH_FIELDS | {"token_ids", "cache_salt", "member"}
#: The longest cache salt a run names (vLLM's salt check allows no more than this either way).
MAX_SALT_CHARS = 128


def parse_target(body: Any) -> ReviveTarget | Refusal:
    """``{"session_id": ..., "branch_id": ...}`` (``branch_id`` defaults to the main branch),
    both valid ids, plus ``token_ids`` (at most :data:`MAX_REVIVE_TOKENS` ids in
    ``[0, 2**31)``), ``cache_salt`` (a string or null) and ``member`` (an id, optional) for a
    block-run revive; anything else is a 400."""
    if not isinstance(body, dict) or set(body) - _RUN_FIELDS:
        return Refusal(400, "bad_request", 'body must be {"session_id": ..., "branch_id": ...}')
    run = _run_of(body)
    if isinstance(run, Refusal):
        return run
    session, branch = body.get("session_id"), body.get("branch_id", DEFAULT_BRANCH)
    for name, value in (("session_id", session), ("branch_id", branch)):
        if not isinstance(value, str):
            return Refusal(400, "bad_request", f"{name} must be a string")
        try:
            check_id(value, name)
        except ValueError as exc:
            return Refusal(400, "bad_request", str(exc)[:MESSAGE_CHARS])
    if run is None:
        return ReviveTarget(str(session), str(branch))
    member = body.get("member")
    if member is not None:
        if not isinstance(member, str):
            return Refusal(400, "bad_request", "member must be a string")
        try:
            check_id(member, "member")
        except ValueError as exc:
            return Refusal(400, "bad_request", str(exc)[:MESSAGE_CHARS])
    return ReviveTarget(str(session), str(branch), run[0], run[1], member)


def _run_of(body: dict[str, Any]) -> tuple[list[int], str | None] | None | Refusal:
    """A block-run revive's token ids and salt; None for a branch revive."""
    if "token_ids" not in body:
        extra = [f for f in ("cache_salt", "member") if f in body]
        if extra:
            return Refusal(400, "bad_request", f"{extra[0]} goes with token_ids only")
        return None
    tokens, salt = body["token_ids"], body.get("cache_salt")
    if (
        not isinstance(tokens, list)
        or not tokens
        or len(tokens) > MAX_REVIVE_TOKENS
        or not all(type(t) is int and 0 <= t < 2**31 for t in tokens)
    ):
        return Refusal(
            400,
            "bad_request",
            f"token_ids must be 1 to {MAX_REVIVE_TOKENS} token ids (integers in [0, 2**31))",
        )
    if salt is not None and (not isinstance(salt, str) or not 0 < len(salt) <= MAX_SALT_CHARS):
        return Refusal(400, "bad_request", f"cache_salt must be 1 to {MAX_SALT_CHARS} characters")
    return list(tokens), salt


def salt_refusal(cache_salt: str | None, owner: str | None) -> Refusal | None:
    """Why a block-run revive's salt is not the caller's tenant's; None when it is. With API
    keys every request's salt is the tenant's id, or that id and a digest of the client's own
    salt (:func:`server.plugin.tenancy.tenant_salt`): anything else would name another
    tenant's blocks. Without keys (``owner`` None) there are no tenants to keep apart."""
    if owner is None:
        return None
    if cache_salt is not None and (cache_salt == owner or cache_salt.startswith(owner + ".")):
        return None
    return Refusal(403, "tenant", "that cache salt is not the calling tenant's")


def hashes_to_check(hashes: Sequence[str], block_size: int, max_tokens: int) -> list[str]:
    """The leading block hashes the holder's block index is asked about: no more than a
    revive may load."""
    return list(hashes[: max(max_tokens - 1, 0) // block_size])


def revive_prompt(
    tokens: Sequence[int],
    covered_blocks: int,
    block_size: int,
    *,
    identity_ok: bool,
    min_tokens: int,
    max_tokens: int = MAX_REVIVE_TOKENS,
) -> list[int] | Refusal:
    """The token ids the revive prefills: the first ``covered_blocks`` blocks the host store
    holds (at most ``max_tokens`` - 1 tokens' worth) and one token more, so that the engine
    loads every one of those blocks and computes one token; a :class:`Refusal` when the
    identity differs or that is fewer than ``min_tokens``."""
    if not identity_ok:
        return Refusal(
            409,
            "identity",
            "the turn's cache salt, adapter or engine is not what a revive would run: "
            "its blocks would miss the host store",
        )
    blocks = min(covered_blocks, (len(tokens) - 1) // block_size, (max_tokens - 1) // block_size)
    if blocks <= 0 or blocks * block_size < min_tokens:
        return Refusal(
            409,
            "not_covered",
            f"the host store holds {max(covered_blocks, 0) * block_size} leading tokens of "
            f"the branch's {len(tokens)}: fewer than the {min_tokens} worth a pull",
        )
    return list(tokens[: blocks * block_size + 1])
