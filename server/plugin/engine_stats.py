"""One server's stats from the stats of each of its data-parallel engines.

Why: each engine core answers ``stats`` for its own host store, sessions and counters; the
``/v1/kvbranch/stats`` route, the agent page and ``/metrics`` describe the server, so with
several engines they show the sum (a counter, a capacity, a count), the one value (the size of
one block or part, the same on every engine), the latest clock, and the sessions of all of them.
"""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from pydantic import BaseModel

from server.connector.control.models import GetStats
from server.connector.control.transport import AsyncControlClient

__all__ = ["gather_stats", "merge_stats"]

M = TypeVar("M", bound=BaseModel)

#: Fields that are the size of one unit, the same on every engine: kept, not summed.
_UNIT_FIELDS = frozenset({"block_bytes", "window_part_bytes", "state_part_bytes"})
#: The sessions one stats answer lists (as each engine lists at most this many).
MAX_SESSIONS = 100


def _merge(name: str, values: list[Any]) -> Any:
    present = [v for v in values if v is not None]
    if not present:
        return None
    first = present[0]
    if isinstance(first, BaseModel):
        return merge_stats(present)
    if isinstance(first, bool) or name in _UNIT_FIELDS:
        return first
    if isinstance(first, int):
        return sum(present)
    if isinstance(first, float):
        return max(present)  # a clock (``time``)
    if isinstance(first, dict):
        merged: dict[str, Any] = {}
        for value in present:
            for key, count in value.items():
                merged[key] = merged.get(key, 0) + count
        return merged
    if isinstance(first, list):
        return [item for value in present for item in value]
    return first


def merge_stats(parts: list[M]) -> M:
    """``parts`` (one model type, one per engine) as one: see the module docstring."""
    if len(parts) == 1:
        return parts[0]
    model = type(parts[0])
    fields = {
        name: _merge(name, [getattr(part, name) for part in parts]) for name in model.model_fields
    }
    sessions = fields.get("sessions")
    if isinstance(sessions, list) and len(sessions) > MAX_SESSIONS:
        fields["sessions"] = sessions[:MAX_SESSIONS]
    return model.model_validate(fields)


async def gather_stats(controls: list[AsyncControlClient], op: GetStats) -> Any:
    """``op`` asked of every engine at once, the answers merged."""
    answers = await asyncio.gather(*(control.call(op.model_copy()) for control in controls))
    return merge_stats(list(answers))
