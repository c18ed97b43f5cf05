"""What the warm-first scheduler (:mod:`server.engine.scheduler`) did, where ``/metrics`` can
read it: the scheduler and the connector's control socket both live in vLLM's engine-core
process, so the scheduler publishes its counters here and the socket's ``stats`` op copies them
into its answer (``kvbranch_scheduler_*`` on ``/metrics``). Standard library only: the control
ops import it without importing vLLM's scheduler."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SchedulerCounters:
    #: Cold prefills preempted for a warmer waiting request.
    preemptions: int = 0
    #: Steps that admitted a request past a better-ranked one that did not fit (backfill).
    backfills: int = 0
    #: Waiting requests passed by those steps, summed.
    passed_requests: int = 0
    #: Steps that left running cold prefills out for a resumed turn's prefill.
    paused_steps: int = 0


_published: SchedulerCounters | None = None


def publish(counters: SchedulerCounters) -> None:
    """The engine's scheduler registers its counters (one scheduler per engine process)."""
    global _published
    _published = counters


def published() -> dict[str, int] | None:
    """The counters of this process's warm-first scheduler; ``None`` without one (FCFS, CUDA,
    or the API process)."""
    return None if _published is None else asdict(_published)
