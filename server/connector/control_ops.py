"""The control socket's operations (what the HTTP routes ask the scheduler side), as a table:
op name -> handler. Each handler reads its fields from the request dict and answers with plain
JSON data; a :class:`~server.connector.sessions.RegistryError` or a missing field becomes a
4xx in :meth:`KVBranchScheduler.handle_control`, which runs these under the planner's lock.

Ops a composing connector adds (P/D: ``claim_hold``) live in the scheduler side's
``extra_ops`` and run outside that lock.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from server.connector.planner import Planner


class OpContext(Protocol):
    """What the handlers read: the scheduler side (a protocol, so that this table and
    ``scheduler_side.py`` do not import each other)."""

    block_size: int
    block_bytes: int
    num_slots: int
    enabled: bool
    planner: Planner
    extra_stats: dict[str, Any]

    def device_resident(self, block_hashes: list[bytes]) -> bool: ...


#: (scheduler side, request, owner) -> JSON-able result.
OpHandler = Callable[[OpContext, dict, "str | None"], Any]


def _info(side: OpContext, req: dict, owner: str | None) -> dict:
    return {
        "block_size": side.block_size,
        "block_bytes": side.block_bytes,
        "num_slots": side.num_slots,
        "enabled": side.enabled,
        "store_capacity_bytes": side.num_slots * side.block_bytes,
        "pin_budget_bytes": side.planner.registry.pin_budget_bytes,
        "platform": "cuda" if torch.cuda.is_available() else "cpu",
    }


def _create_session(side: OpContext, req: dict, owner: str | None) -> dict:
    reg = side.planner.registry
    session = reg.create_session(
        req.get("session_id"),
        auto_pin=bool(req.get("auto_pin", True)),
        pin_ttl_s=req.get("pin_ttl_s"),
        owner=owner,
    )
    return reg.session_info(session)


def _get_session(side: OpContext, req: dict, owner: str | None) -> dict:
    reg = side.planner.registry
    return reg.session_info(reg.get_session(req["session_id"], owner))


def _delete_session(side: OpContext, req: dict, owner: str | None) -> dict:
    return {
        "deleted": req["session_id"],
        "released_blocks": side.planner.registry.delete_session(req["session_id"], owner),
    }


def _list_branches(side: OpContext, req: dict, owner: str | None) -> list:
    reg = side.planner.registry
    session = reg.get_session(req["session_id"], owner)
    return [reg.branch_info(b) for b in session.branches.values()]


def _get_branch(side: OpContext, req: dict, owner: str | None) -> dict:
    reg = side.planner.registry
    return reg.branch_info(reg.get_branch(req["session_id"], req["branch_id"], owner))


def _fork(side: OpContext, req: dict, owner: str | None) -> dict:
    reg = side.planner.registry
    branch = reg.fork(
        req["session_id"],
        req.get("parent") or "main",
        req.get("branch_id"),
        token_offset=req.get("token_offset"),
        token_prefix=req.get("token_prefix"),
        owner=owner,
    )
    return reg.branch_info(branch)


def _delete_branch(side: OpContext, req: dict, owner: str | None) -> dict:
    released = side.planner.registry.delete_branch(req["session_id"], req["branch_id"], owner)
    return {"deleted": req["branch_id"], "released_blocks": released}


def _pin(side: OpContext, req: dict, owner: str | None) -> dict:
    reg = side.planner.registry
    return reg.branch_info(reg.pin(req["session_id"], req["branch_id"], float(req["ttl_s"]), owner))


def _unpin(side: OpContext, req: dict, owner: str | None) -> dict:
    reg = side.planner.registry
    return reg.branch_info(reg.unpin(req["session_id"], req["branch_id"], owner))


def _prefetch_plan(side: OpContext, req: dict, owner: str | None) -> dict:
    """Where the branch's blocks are: the device cache (nothing to run), the host store (nothing
    to run either unless ``to_device``: the next turn loads them in one copy, while an engine
    step would take the engine from other sessions and the device blocks it fills may well be
    evicted again before the turn comes), or neither (the engine runs it)."""
    planner = side.planner
    branch = planner.registry.get_branch(req["session_id"], req["branch_id"], owner)
    location = None
    if side.device_resident(branch.block_hashes):
        location = "device"
    elif not req.get("to_device") and side.enabled:
        keys = list(branch.block_hashes)
        if branch.tail_key is not None:
            keys.append(branch.tail_key)
        if planner.index.refresh_all(keys):
            location = "host"
    if location is not None:
        planner.prefetches_skipped += 1
    return {
        "token_ids": list(branch.token_ids),
        "cache_salt": branch.cache_salt,
        "location": location,
    }


def _split(side: OpContext, req: dict, owner: str | None) -> dict | None:
    return side.planner.split_for(str(req.get("tag", "")))


def _stats(side: OpContext, req: dict, owner: str | None) -> dict:
    return stats_of(side, owner, all_owners=bool(req.get("all_owners")))


def _reset_store(side: OpContext, req: dict, owner: str | None) -> dict:
    return {"dropped_blocks": side.planner.reset_store()}


OPS: dict[str, OpHandler] = {
    "info": _info,
    "create_session": _create_session,
    "get_session": _get_session,
    "delete_session": _delete_session,
    "list_branches": _list_branches,
    "get_branch": _get_branch,
    "fork": _fork,
    "delete_branch": _delete_branch,
    "pin": _pin,
    "unpin": _unpin,
    "prefetch_plan": _prefetch_plan,
    "split": _split,
    "stats": _stats,
    "reset_store": _reset_store,
}


#: Sessions ``/v1/kvbranch/stats`` describes (the caller's most recently used ones), and the
#: block-hash lookups its descriptions may make: it runs under the planner's lock in the engine
#: core, so 1000 sessions x 256 branches x 512 blocks must not be walked (that stalls every
#: step for seconds). Past the budget, block counts are ``None``; one session's own routes
#: (``GET /v1/kvbranch/sessions/{id}``) still count them all.
STATS_MAX_SESSIONS = 100
STATS_WALK_BUDGET = 200_000


def stats_of(side: OpContext, owner: str | None, all_owners: bool = False) -> dict:
    """``GET /v1/kvbranch/stats``: the store, the prompt-source totals, the caller's most
    recently used sessions (none with ``all_owners``: the admin view; at most
    :data:`STATS_MAX_SESSIONS`, block walks bounded by :data:`STATS_WALK_BUDGET`) and what
    composing connectors add."""
    planner = side.planner
    index, reg = planner.index, planner.registry
    counters = index.counters
    budget = [STATS_WALK_BUDGET]
    sessions = (
        []
        if all_owners
        else [reg.session_info(s, budget) for s in reg.sessions_of(owner, STATS_MAX_SESSIONS)]
    )
    return {
        "store": {
            "capacity_blocks": index.num_slots,
            "used_blocks": index.used_slots,
            "pinned_blocks": index.pinned_stored_slots,
            "block_bytes": side.block_bytes,
            "used_bytes": index.used_slots * side.block_bytes,
            "pin_budget_bytes": reg.pin_budget_bytes,
            # The same blocks as pinned_blocks: pinned and stored in host memory.
            "pinned_bytes": index.pinned_stored_slots * side.block_bytes,
            # What the pin budget is charged: also pins on blocks not stored (yet).
            "pin_budget_used_bytes": index.pinned_hashes * side.block_bytes,
            "evictions": counters.evictions,
            "saved_blocks": counters.saved_blocks,
            "loaded_blocks": counters.loaded_blocks,
            # Token-exact reuse (tails.py): partial blocks kept and loaded.
            "saved_tails": counters.saved_tails,
            "loaded_tails": counters.loaded_tails,
            "tail_tokens_loaded": counters.tail_tokens_loaded,
        },
        "hits_tokens": dict(planner.hits_tokens),
        "requests": planner.requests,
        "remote_failed_tokens": planner.remote_failed_tokens,
        "pins_degraded": reg.pins_degraded,
        "pins_refused": reg.pins_refused,
        "prefetches": planner.prefetches,
        "prefetches_skipped": planner.prefetches_skipped,
        "num_sessions": len(reg.sessions),
        "sessions": sessions,
        # The caller's sessions in all: more than listed when over STATS_MAX_SESSIONS.
        "num_own_sessions": 0 if all_owners else reg.num_sessions_of(owner),
        "store_resets": planner.store_resets,
        "time": time.time(),
        **{name: section() for name, section in side.extra_stats.items()},
    }
