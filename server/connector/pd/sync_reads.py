"""A pull the step's forward waits for: NIXL's read of a peer's blocks done before the forward
that computes the rest of the prompt, in the same engine step.

Upstream ``NixlConnector`` loads a peer's blocks *asynchronously*: the scheduler parks the
request (``WAITING_FOR_REMOTE_KVS``), vLLM starts the read after that step's forward, the read
is reported done at the end of a step, and the request is scheduled at the step after. On a
busy engine that is two whole forwards of other requests between a turn's arrival and its
own prefill, while the read itself takes milliseconds (docs/cluster.md, "A pull the forward
waits for"). A *synchronous* load (the connector answers "not async", as the host store's
loads do) is scheduled at once: the read starts before the step's forward
(``has_sync_kv_loads``), the forward waits for it here, and the turn's own tokens are computed
in that same forward.

The wait is bounded (``sync_pull_wait_s``): a read that has not landed by then (a slow peer,
a handshake that hangs) or failed is given up — its transfers released, or a read still
waiting for its peer's handshake made to read nothing — and its blocks are reported as load
errors for this very step, so vLLM (``kv_load_failure_policy: recompute``) discards the step's
output of the request and recomputes those tokens. A read only ever writes the verified prefix
of the request's own blocks, checked before it is queued, as for every pull.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from server.connector.vllm_compat import (
    READ_DONE,
    READ_FAILED,
    READ_PENDING,
    read_state,
    start_ready_reads,
)

#: The metadata attribute that carries a step's synchronous reads from the scheduler to the
#: worker: request id -> None (NIXL queued the read) or the block ids that no read will fill.
SYNC_READS_ATTR = "kvbranch_sync_reads"
#: What a read not landed by the deadline is called (beside ``done`` and ``failed``).
READ_TIMED_OUT = "timed_out"
#: How often the forward's thread looks at the reads it waits for.
POLL_S = 0.0005


def wait_for_reads(
    worker: Any,
    request_ids: list[str],
    wait_s: float,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, str]:
    """Wait until every read of ``request_ids`` landed or failed, at most ``wait_s``; start the
    reads whose peer handshake finishes meanwhile. Returns request id -> ``done``, ``failed``
    or :data:`READ_TIMED_OUT`."""
    deadline = clock() + wait_s
    states: dict[str, str] = {}
    pending = list(request_ids)
    while True:
        start_ready_reads(worker)
        still = []
        for request_id in pending:
            state = read_state(worker, request_id)
            if state == READ_PENDING:
                still.append(request_id)
            else:
                states[request_id] = state
        pending = still
        if not pending or clock() >= deadline:
            break
        sleep(POLL_S)
    for request_id in pending:
        states[request_id] = READ_TIMED_OUT
    return states


__all__ = ["READ_DONE", "READ_FAILED", "READ_TIMED_OUT", "SYNC_READS_ATTR", "wait_for_reads"]
