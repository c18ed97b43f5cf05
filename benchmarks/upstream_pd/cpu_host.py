"""vLLM's ``NixlConnector`` as upstream ships it, with the two thread fixes a P/D pair needs on
a small CPU host (and nothing else: the scheduler and worker logic, handles, TTLs, failure
handling and the bidirectional pull are vLLM 0.32's own).

Loaded by the upstream baseline's instances through vLLM's ``kv_connector_module_path``
(:mod:`benchmarks.upstream_pd.instance`):

* **NIXL's UCX progress thread paced** (``nixl_progress_delay_us``, default 1000 µs between
  polls). vLLM builds its NIXL agent with the progress thread on and NIXL's Python binding
  hard-codes a busy-spin (docs/pd_notes.md pitfall 3): on a core shared with an engine's forward
  it takes a large share of the core. With the thread off, a
  peer's read over UCX's TCP transport waits for the target's next forward (docs/pd.md, "Where
  a first turn's time goes"). kvbranch's P/D and its no-pull baseline run with the same pacing
  (:func:`server.connector.vllm_compat.nixl_progress_thread`); ``0`` keeps upstream's spinning
  thread.
* **the forward thread's CPU affinity kept** (pitfall 4): on the CPU platform NIXL's worker
  re-pins the engine's forward thread to the last core of each NUMA node, overriding
  ``VLLM_CPU_OMP_THREADS_BIND``, so that P and D would both compute on the same core. The
  affinity the instance was started with is put back after upstream's ``__init__``.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from server.connector.vllm_compat import NixlConnector, nixl_progress_thread

#: ``kv_connector_extra_config`` key for the pacing (NIXL's progress-thread delay, µs).
PROGRESS_KEY = "nixl_progress_delay_us"
CONNECTOR_CLASS = "CpuHostNixlConnector"
CONNECTOR_MODULE = __name__


class CpuHostNixlConnector(NixlConnector):
    """Upstream ``NixlConnector``; only its construction differs (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        delay_us = int(extra.get(PROGRESS_KEY, 1000))
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
        pacing = nixl_progress_thread(delay_us) if delay_us > 0 else contextlib.nullcontext()
        try:
            with pacing:
                super().__init__(vllm_config, role, kv_cache_config)
        finally:
            if affinity is not None and os.sched_getaffinity(0) != affinity:
                os.sched_setaffinity(0, affinity)
                print(
                    f"[upstream-pd] kept the forward thread on cores {sorted(affinity)} "
                    "(NIXL re-pinned it)",
                    file=sys.stderr,
                    flush=True,
                )
