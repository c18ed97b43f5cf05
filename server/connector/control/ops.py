"""The control socket's operations (what the HTTP routes ask the scheduler side), as a
registry: op name -> :class:`Op` (its request model, its answer model, its handler), and
:func:`run_op`, the engine's side of every call.

Why typed: see :mod:`server.connector.control.models`. :func:`run_op` validates the incoming
line into the op's request model (an unknown op, or a bad, missing or unknown field, is a 400
naming it), runs the handler, and validates its answer through the answer model before it is
serialised (a handler whose answer drifted from the model is a 500 naming the field, here in
the engine, not a surprise in the API process). Handlers get the parsed request and answer
with plain data or a model; the registry's :class:`~server.connector.core.sessions.RegistryError`
becomes its HTTP status.

Ops a composing connector adds (P/D: ``claim_hold``) go in the scheduler side's ``extra_ops``
as :class:`Op` entries too, with ``locked=False``: they keep their own locks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import torch
from pydantic import BaseModel

from server.connector.control import models as ctl
from server.connector.control.models import ControlError, check_answer, parse_request
from server.connector.core.planner import Planner
from server.connector.core.sessions import RegistryError
from server.engine import scheduler_counters

logger = logging.getLogger("kvbranch.control")


class OpContext(Protocol):
    """What the handlers read: the scheduler side (a protocol, so that this table and
    ``scheduler_side.py`` do not import each other)."""

    block_size: int
    block_bytes: int
    num_slots: int
    window_bytes: int
    state_bytes: int
    enabled: bool
    planner: Planner
    extra_stats: dict[str, Any]

    def device_resident(self, block_hashes: list[bytes]) -> bool: ...


R = TypeVar("R", bound=ctl.ControlRequest[Any])


@dataclass(frozen=True)
class Op(Generic[R]):
    """One op: the request model (which names the op and its answer model) and the handler,
    ``(scheduler side, parsed request) -> answer`` (plain data or the answer model)."""

    request: type[R]
    handler: Callable[[OpContext, R], Any]
    #: Run under the planner's lock, after expiring idle sessions (the registry's ops).
    locked: bool = True

    @property
    def name(self) -> str:
        return self.request.op

    @property
    def answer(self) -> type[BaseModel]:
        return self.request.answer


def run_op(side: OpContext, ops: Mapping[str, Op[Any]], line: dict[str, Any]) -> Any:
    """The engine's side of one call: ``line`` (the decoded JSON object) -> the JSON-able
    result, both validated through the op's models. Errors are :class:`ControlError`."""
    request = parse_request(line, {name: op.request for name, op in ops.items()})
    op = ops[request.op]
    try:
        if op.locked:
            planner = side.planner
            with planner.lock:
                planner.registry.expire()
                result = op.handler(side, request)
        else:
            result = op.handler(side, request)
    except RegistryError as exc:
        raise ControlError(exc.status, exc.message) from None
    try:
        answer = check_answer(op.answer, result, op.name, "kvbranch engine")
    except ControlError as exc:
        logger.error("%s", exc.message)  # a bug on this side: say so where it happened
        raise
    return answer.model_dump(mode="json")


def _info(side: OpContext, req: ctl.Info) -> dict:
    return {
        "block_size": side.block_size,
        "block_bytes": side.block_bytes,
        "num_slots": side.num_slots,
        "enabled": side.enabled,
        "store_capacity_bytes": side.num_slots * side.block_bytes
        + side.planner.index.windows.num_slots * side.window_bytes
        + side.planner.index.states.num_slots * side.state_bytes,
        "pin_budget_bytes": side.planner.registry.leases.pin_budget_bytes,
        "platform": "cuda" if torch.cuda.is_available() else "cpu",
    }


def _create_session(side: OpContext, req: ctl.CreateSession) -> dict:
    reg = side.planner.registry
    session = reg.create_session(
        req.session_id, auto_pin=req.auto_pin, pin_ttl_s=req.pin_ttl_s, owner=req.owner
    )
    return reg.session_info(session)


def _get_session(side: OpContext, req: ctl.GetSession) -> dict:
    reg = side.planner.registry
    return reg.session_info(reg.get_session(req.session_id, req.owner))


def _delete_session(side: OpContext, req: ctl.DeleteSession) -> dict:
    released = side.planner.registry.delete_session(req.session_id, req.owner)
    return {"deleted": req.session_id, "released_blocks": released}


def _list_branches(side: OpContext, req: ctl.ListBranches) -> list:
    reg = side.planner.registry
    session = reg.get_session(req.session_id, req.owner)
    return [reg.branch_info(b) for b in session.branches.values()]


def _get_branch(side: OpContext, req: ctl.GetBranch) -> dict:
    reg = side.planner.registry
    return reg.branch_info(reg.get_branch(req.session_id, req.branch_id, req.owner))


def _fork(side: OpContext, req: ctl.Fork) -> dict:
    reg = side.planner.registry
    branch = reg.fork(
        req.session_id,
        req.parent,
        req.branch_id,
        token_offset=req.token_offset,
        token_prefix=req.token_prefix,
        owner=req.owner,
    )
    return reg.branch_info(branch)


def _delete_branch(side: OpContext, req: ctl.DeleteBranch) -> dict:
    released = side.planner.registry.delete_branch(req.session_id, req.branch_id, req.owner)
    return {"deleted": req.branch_id, "released_blocks": released}


def _pin(side: OpContext, req: ctl.Pin) -> dict:
    reg = side.planner.registry
    return reg.branch_info(reg.pin(req.session_id, req.branch_id, req.ttl_s, req.owner))


def _unpin(side: OpContext, req: ctl.Unpin) -> dict:
    reg = side.planner.registry
    return reg.branch_info(reg.unpin(req.session_id, req.branch_id, req.owner))


def _prefetch_plan(side: OpContext, req: ctl.PlanPrefetch) -> dict:
    """Where the branch's blocks are: the device cache (nothing to run), the host store (nothing
    to run either unless ``to_device``: the next turn loads them in one copy, while an engine
    step would take the engine from other sessions and the device blocks it fills may well be
    evicted again before the turn comes), or neither (the engine runs it)."""
    planner = side.planner
    branch = planner.registry.get_branch(req.session_id, req.branch_id, req.owner)
    location = None
    if side.device_resident(branch.block_hashes):
        location = "device"
    elif not req.to_device and side.enabled:
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


def _split(side: OpContext, req: ctl.Split) -> dict | None:
    return side.planner.split_for(req.tag)


def _stats(side: OpContext, req: ctl.GetStats) -> dict:
    return stats_of(side, req.owner, all_owners=req.all_owners)


def _reset_store(side: OpContext, req: ctl.ResetStore) -> dict:
    return {"dropped_blocks": side.planner.reset_store()}


def registry(*ops: Op[Any]) -> dict[str, Op[Any]]:
    """``{op name: op}``; one entry per op name."""
    table = {op.name: op for op in ops}
    assert len(table) == len(ops), "two ops with one name"
    return table


OPS: dict[str, Op[Any]] = registry(
    Op(ctl.Info, _info),
    Op(ctl.CreateSession, _create_session),
    Op(ctl.GetSession, _get_session),
    Op(ctl.DeleteSession, _delete_session),
    Op(ctl.ListBranches, _list_branches),
    Op(ctl.GetBranch, _get_branch),
    Op(ctl.Fork, _fork),
    Op(ctl.DeleteBranch, _delete_branch),
    Op(ctl.Pin, _pin),
    Op(ctl.Unpin, _unpin),
    Op(ctl.PlanPrefetch, _prefetch_plan),
    Op(ctl.Split, _split),
    Op(ctl.GetStats, _stats),
    Op(ctl.ResetStore, _reset_store),
)


#: Sessions ``/v1/kvbranch/stats`` describes (the caller's most recently used ones), and the
#: block-hash lookups its descriptions may make: it runs under the planner's lock in the engine
#: core, so 1000 sessions x 256 branches x 512 blocks must not be walked (that stalls every
#: step for seconds). Past the budget, block counts are left out (the answer model reads 0);
#: one session's own routes (``GET /v1/kvbranch/sessions/{id}``) still count them all.
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
            "pin_budget_bytes": reg.leases.pin_budget_bytes,
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
            # Hybrid models (kv_groups.py): recurrent states kept at block ends and resumed.
            "saved_states": counters.saved_states,
            "loaded_states": counters.loaded_states,
            # Sliding-window / chunked-local layers (part_pool.py): kept near resume points.
            "window_part_bytes": side.window_bytes,
            "window_parts_capacity": index.windows.num_slots,
            "window_parts_used": len(index.windows),
            "saved_window_parts": index.windows.saved,
            "loaded_window_parts": index.windows.loaded,
            "window_part_evictions": index.windows.evictions,
            "window_parts_released": index.windows.released,
            # Recurrent-state layers (part_pool.py): kept at resume points.
            "state_part_bytes": side.state_bytes,
            "state_parts_capacity": index.states.num_slots,
            "state_parts_used": len(index.states),
            "state_parts_released": index.states.released,
            "window_cuts": counters.window_cuts,
            "window_misses": counters.window_misses,
        },
        "hits_tokens": dict(planner.hits_tokens),
        "requests": planner.requests,
        "remote_failed_tokens": planner.remote_failed_tokens,
        "pins_degraded": reg.leases.pins_degraded,
        "pins_refused": reg.leases.pins_refused,
        "prefetches": planner.prefetches,
        "prefetches_skipped": planner.prefetches_skipped,
        "num_sessions": len(reg.sessions),
        "sessions": sessions,
        # The caller's sessions in all: more than listed when over STATS_MAX_SESSIONS.
        "num_own_sessions": 0 if all_owners else reg.num_sessions_of(owner),
        "store_resets": planner.store_resets,
        "time": time.time(),
        "scheduler": scheduler_counters.published(),
        **{name: section() for name, section in side.extra_stats.items()},
    }
