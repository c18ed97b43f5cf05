"""How a request's vLLM ``priority`` carries the agent-aware policy's decision: written by the
API server's plugin (:mod:`server.plugin.priority`, which ranks each prompt), read back by the
engine core's warm-first scheduler (server/engine/scheduler.py). Each side runs in its own
process; this module is the whole of what they share, so neither imports the other.

The priority is a virtual deadline, ``arrival + level * aging_s`` on the system's monotonic
clock, in ticks of :data:`TICK_S`, with the level in its lowest digit (:func:`encode`,
:func:`level_in`). Pure apart from the environment read of :func:`aging_from_env`; standard
library only.
"""

from __future__ import annotations

from server.common.env import ENV_PRIORITY_AGING_S

#: ``--priority-aging-s`` default (the policy's own, :data:`DEFAULT_AGING_S`; 4 and 8 s were
#: measured side by side, docs/scheduling.md).
DEFAULT_PRIORITY_AGING_S = 8.0
#: Estimated tokens to prefill -> level: <= 256 -> 0, <= 1024 -> 1, <= 4096 -> 2, else 3.
LEVEL_BOUNDS = (256, 1024, 4096)
DEFAULT_AGING_S = DEFAULT_PRIORITY_AGING_S
#: Resolution of the priority (vLLM's ``priority`` is an integer): 10 ms.
TICK_S = 0.01
#: Levels 0..COLDEST; the priority carries the level in base ``LEVELS``' lowest digit.
COLDEST = len(LEVEL_BOUNDS)
LEVELS = COLDEST + 1


def encode(deadline_s: float, level: int) -> int:
    """vLLM priority of a request: its deadline in ticks, then its level (lower first)."""
    return round(deadline_s / TICK_S) * LEVELS + level


def level_in(priority: int) -> int:
    """The level a priority from :func:`encode` carries."""
    return priority % LEVELS


def unranked(now: float, aging_s: float) -> int:
    """The priority of a request the policy could not rank (no prompt it understands, or a
    route whose body has no ``priority``): the coldest level at its arrival, never ahead."""
    return encode(now + COLDEST * aging_s, COLDEST)


def aging_from_env() -> float | None:
    """The aging the launcher set in the environment with ``--agent-priority`` (read by the
    API server's plugin and by the engine's scheduler), else ``None``."""
    import os

    try:
        aging_s = float(os.environ.get(ENV_PRIORITY_AGING_S, ""))
    except ValueError:
        return None
    return aging_s if aging_s > 0 else None
