"""A P/D read that cannot start or finish ends in bounded time (recompute), never "KV fetch in
progress" for good. Two holes upstream ``NixlConnector`` (vLLM 0.32) leaves:

* **A read promised but never queued.** The scheduler parks a request in
  ``WAITING_FOR_REMOTE_KVS`` when the connector says "load async", and waits for the worker to
  report it received. If upstream's ``update_state_after_alloc`` then queues no read (it
  raised, or a path of its skips the read: a client-set ``_remote_blocks_processed``, the host
  buffer on P), nothing is ever reported. No read exists, so reporting the request received
  with only its local tokens valid is safe: vLLM recomputes the rest, or frees the blocks of a
  request aborted meanwhile (it waits for that report too: an engine-core assertion seen in
  testing came from a late one).
* **A read in flight that never completes.** Upstream bounds handshakes (a 5 s receive
  timeout) and reads that would start after D's deadline, not a transfer in flight. Past
  ``pull_timeout_s`` such a read is given up: the worker reports the request failed and vLLM
  recomputes (``kv_load_failure_policy: recompute``). Releasing the transfer would not stop it,
  so it stays in flight against blocks the scheduler pins until it ends (``late_reads.py``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from server.connector.vllm_compat import (
    RequestStatus,
    read_block_ids,
    read_failed,
    reads_in_flight,
)

if TYPE_CHECKING:
    from server.connector.pd.late_reads import LateReads

logger = logging.getLogger("kvbranch.pd")


def report_unqueued(pending: dict[str, tuple[Any, int]], connector_output: Any) -> int:
    """Add ``pending`` (request id -> (request, tokens valid locally)) to the step's
    ``finished_recving``, each request's computed tokens cut to its local ones. Skips a
    request reported already or no longer waiting (nor finished). Returns how many."""
    done = set(connector_output.finished_recving or ())
    added = 0
    for request_id, (request, local) in pending.items():
        if request_id in done:
            continue
        status = request.status
        if status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            request.num_computed_tokens = min(local, request.num_computed_tokens)
        elif not RequestStatus.is_finished(status):
            continue
        done.add(request_id)
        added += 1
    connector_output.finished_recving = done
    return added


def fail_slow_reads(
    worker: Any, started: dict[str, float], now: float, timeout_s: float, late: LateReads
) -> int:
    """Give up the reads of NIXL's pull ``worker`` in flight for ``timeout_s`` or longer
    (``started``: request id -> when first seen in flight, kept by the caller; ``late`` keeps
    them polled until they end). Returns how many were given up now."""
    transfers = reads_in_flight(worker)
    for request_id in [r for r in started if r not in transfers]:
        del started[request_id]
    failed = 0
    for request_id in list(transfers):
        since = started.setdefault(request_id, now)
        if now - since < timeout_s or read_failed(worker, request_id):
            continue
        failed += 1
        logger.warning(
            "kvbranch: the read of request %s has not finished after %.0f s: failing it "
            "(vLLM recomputes those blocks)",
            request_id,
            now - since,
        )
        late.give_up(worker, request_id, read_block_ids(worker, request_id))
    return failed
