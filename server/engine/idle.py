"""How often an engine with nothing to compute polls the KV blocks it holds for a peer.

In P/D, an engine keeps finished requests whose blocks a peer will read (P's prefill legs until
D read them; D's turns, with kvbranch, until P pulls them back on the next turn or the hold
ends). vLLM 0.32's engine core keeps stepping while it holds them (``has_requests``), sleeping
only 1 ms between two empty steps, so that the NIXL worker (whose progress thread is off, see
``server/connector/pd/verified_nixl.py``) notices the peer's reads. Every empty step is a
scheduler pass and a
round trip to the worker: a held conversation keeps an idle instance busy for good. On a small
CPU host that is the core the other instance, the API servers and the router need
(docs/pd_notes.md, "The engine's own waits", has what it cost and what this saves).

The launcher passes ``--idle-poll-ms`` (:data:`DEFAULT_IDLE_POLL_MS`) to every instance it
starts through :data:`ENV_IDLE_POLL_S`, and this module makes the engine core wait up to that
long on its input queue after an empty step taken only for held blocks. A new request ends the
wait at once (it is handled right away, as vLLM's own loop would); nothing that is waiting or
running ever waits (a request reading a peer's blocks is *waiting*, so its engine steps as
before). What gets slower is noticing that a peer finished reading: held blocks are freed up to
one poll later. ``--idle-poll-ms 0`` keeps vLLM's behaviour.

Pinned to vLLM 0.32's ``EngineCoreProc`` (``_process_engine_step``, ``input_queue``,
``_handle_client_request``, the scheduler's ``has_requests`` and request counts); on another
version the engine is left unchanged and that is logged.
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import Any

from server.engine.patch import MethodPatch, install_patch, seconds_from_env

ENV_IDLE_POLL_S = "KVBRANCH_IDLE_POLL_S"
DEFAULT_IDLE_POLL_MS = 20.0

logger = logging.getLogger("kvbranch.engine_idle")
#: The method this plugin wraps (vLLM 0.32's engine core loop step; see the module docstring).
IDLE_POLL = MethodPatch(
    "vllm.v1.engine.core.EngineCoreProc._process_engine_step",
    needs="_handle_client_request",
    what="the idle poll",
)

__all__ = ["install", "idle_poll_seconds", "seconds_from_env", "only_holds", "wait_for_work"]


def idle_poll_seconds() -> float | None:
    """The poll interval the launcher asked for, or ``None`` (leave vLLM as it is)."""
    return seconds_from_env(ENV_IDLE_POLL_S, "the engine's idle poll")


def only_holds(core: Any) -> bool:
    """Whether the engine would step only for finished requests whose blocks it still holds:
    nothing waiting or running, no finished ids still to report, no pipeline batch in flight."""
    scheduler = core.scheduler
    if getattr(core, "batch_queue", None) or getattr(core, "engines_running", False):
        return False
    return (
        scheduler.get_num_unfinished_requests() == 0
        and not scheduler.finished_req_ids
        and scheduler.has_requests()
    )


def wait_for_work(core: Any, seconds: float) -> None:
    """Block on the engine's input queue for up to ``seconds``; handle what arrives."""
    try:
        request = core.input_queue.get(timeout=seconds)
    except queue.Empty:
        return
    core._handle_client_request(*request)


def _idle_step(
    original: Callable[[Any], bool], poll_s: Callable[[], float]
) -> Callable[[Any], bool]:
    def _process_engine_step(self: Any) -> bool:
        model_executed = original(self)
        poll = poll_s()
        if not model_executed and poll > 0:
            try:
                idle = only_holds(self) and self.input_queue.empty()
            except Exception:  # noqa: BLE001 - any doubt: vLLM's own loop
                idle = False
            if idle:
                wait_for_work(self, poll)
        return model_executed

    return _process_engine_step


def install() -> None:
    """Called by the plugin entry point in every vLLM process (a no-op outside an engine)."""
    install_patch(IDLE_POLL, seconds=idle_poll_seconds(), wrap=_idle_step, log=logger)
