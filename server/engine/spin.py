"""How long vLLM's engine core and its worker busy-wait for each other (a vLLM general plugin).

vLLM's shared-memory message queue (``shm_broadcast.SpinCondition``) makes a reader spin on
``sched_yield`` for 1 s after every message before it sleeps on its notification socket. The
engine core reads the worker's answer after every step, and the worker reads the next step, so
under load both spin whenever the other computes: the engine core spends most of its time in
``sched_yield`` on a host where the worker computes on another core (docs/pd_notes.md, "The
engine's own waits", has the profile). That core is the one the API server, the router and,
with ``--disagg``, the other instance need; a spinning process that lands on a compute core
takes up to half of it (the scheduler shares a core between runnable threads, yielding or
not).

The launcher passes ``--mq-spin-ms`` (default :data:`DEFAULT_SPIN_MS`) to every instance it
starts, with or without the connector, through :data:`ENV_MQ_SPIN_S`; this plugin then sets
every reader's spin window to it. Back-to-back messages (the worker's next step, scheduled while
it computed) still arrive inside the window; a wait that outlasts it costs one socket wake-up
(tens of microseconds against steps of tens of milliseconds). Without the variable (vLLM started
by someone else) nothing changes. ``--mq-spin-ms 1000`` is vLLM's own behaviour.

Pinned to vLLM 0.32's ``SpinCondition`` (``busy_loop_s``, ``wait``); on another version the
class may differ and the plugin logs that it left vLLM unchanged.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from server.engine import idle as engine_idle
from server.engine.patch import MethodPatch, install_patch, seconds_from_env

ENV_MQ_SPIN_S = "KVBRANCH_MQ_SPIN_S"
DEFAULT_SPIN_MS = 2.0
PLUGIN_NAME = "kvbranch_mq_spin"

logger = logging.getLogger("kvbranch.engine_spin")
#: The method this plugin wraps (vLLM 0.32's message-queue wait; see the module docstring).
MQ_SPIN = MethodPatch(
    "vllm.distributed.device_communicators.shm_broadcast.SpinCondition.wait",
    needs="record_read",
    what="message-queue spin",
)


def spin_seconds() -> float | None:
    """The spin window the launcher asked for, or ``None`` (leave vLLM as it is)."""
    return seconds_from_env(ENV_MQ_SPIN_S, "vLLM's spin")


def _spin_wait(original: Callable[..., None], spin_s: Callable[[], float]) -> Callable[..., None]:
    def wait(self: Any, timeout_ms: int | None = None) -> None:
        # Readers made before this plugin ran get the window on their first wait.
        if self.is_reader:
            self.busy_loop_s = spin_s()
        original(self, timeout_ms)

    return wait


def install() -> None:
    """vLLM general-plugin entry point: runs in the API server, the engine core and every
    worker (possibly more than once per process). Also sets the engine's idle poll
    (:mod:`server.engine.idle`), the other busy-wait between the engine core and its worker."""
    engine_idle.install()
    install_patch(MQ_SPIN, seconds=spin_seconds(), wrap=_spin_wait, log=logger)
