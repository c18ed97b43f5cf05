"""The save fence, as the model runners drive the connector (issue 13 item 3), on CPU.

A block freed after step N can be handed to another request in step N+1 and written there:
zeroed (``new_block_ids_to_zero``), copy-on-write, the forward, or a peer connector's pull
(NIXL, in P/D). Step N's device->host save of that block must be complete first.

* Writers on the CUDA compute stream are ordered by the save itself (``HostKVPool.save`` makes
  the compute stream wait on the save's event; tests/gpu/test_cuda_copy.py checks that on
  a GPU).
* Writers outside any CUDA stream (a peer's pull) get a host-side wait, in the first connector
  hook of the step: ``handle_preemptions`` (model runner V1 calls it before ``_update_states``
  zeroes blocks) and ``bind_connector_metadata`` (V2 and the no-forward path call it before
  ``start_load_kv``). Before the fix the wait was only in ``start_load_kv``, which vLLM 0.32
  calls *after* the forward on steps without sync loads.

These tests replay the hook order of vLLM 0.32's runners with a recording pool.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.connector.core.block_index import HostBlockIndex
from server.connector.core.metadata import KVBranchMetadata
from server.connector.core.planner import Planner
from server.connector.core.sessions import SessionRegistry
from server.connector.engine.connector import KVBranchConnector
from server.connector.engine.worker_side import KVBranchWorker


class RecordingPool:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.pending = False

    def save(self, blocks, slots) -> None:
        self.log.append(f"save {list(blocks)}")
        self.pending = True

    def load(self, slots, blocks) -> None:
        self.log.append(f"load {list(blocks)}")

    def fence(self) -> None:
        if self.pending:
            self.log.append("fence")
            self.pending = False


def worker(log: list[str]) -> KVBranchConnector:
    conn = KVBranchConnector.__new__(KVBranchConnector)  # worker state only; no vLLM config
    conn.worker_side = KVBranchWorker(1, 1, pool=RecordingPool(log))
    conn.scheduler_side = None
    conn._connector_metadata = None
    return conn


def v1_step(conn, meta, log, sync_loads: bool) -> None:
    """vLLM 0.32 gpu_model_runner.execute_model + kv_connector_model_runner_mixin."""
    conn.handle_preemptions(meta)
    log.append("zero new blocks")  # _update_states: new_block_ids_to_zero
    conn.bind_connector_metadata(meta)  # _get_kv_connector_output
    if sync_loads:
        conn.start_load_kv(None)
    log.append("forward")
    if not sync_loads:
        conn.start_load_kv(None)  # after the forward: has_sync_kv_loads is False
    conn.wait_for_save()
    conn.clear_connector_metadata()


def v2_step(conn, meta, log, sync_loads: bool) -> None:
    """vLLM 0.32 gpu/model_runner.execute_model + gpu/kv_connector.ActiveKVConnector."""
    log.append("zero new blocks")  # update_requests, before any connector hook
    conn.handle_preemptions(meta)  # pre_forward
    conn.bind_connector_metadata(meta)
    if sync_loads:
        conn.start_load_kv(None)
    log.append("peer pull starts")  # NIXL's start_load_kv (first child of the PD pair)
    log.append("forward")
    if not sync_loads:
        conn.start_load_kv(None)  # post_forward
    conn.wait_for_save()
    conn.clear_connector_metadata()


def no_forward_step(conn, meta, log, sync_loads: bool) -> None:
    """A step with no tokens (kv_connector_no_forward): hooks still run."""
    conn.bind_connector_metadata(meta)
    log.append("peer pull starts")
    conn.start_load_kv(None)
    conn.wait_for_save()
    conn.clear_connector_metadata()


@pytest.mark.parametrize("step", [v1_step, v2_step, no_forward_step])
@pytest.mark.parametrize("sync_loads", [False, True])
def test_peer_pull_step_waits_for_the_pending_save_first(step, sync_loads):
    log: list[str] = []
    conn = worker(log)
    v1_step(conn, KVBranchMetadata(save_blocks=[3], save_slots=[0]), log, sync_loads=False)
    log.clear()
    step(conn, KVBranchMetadata(host_fence=True), log, sync_loads)
    assert "fence" in log
    first_write = min(
        log.index(x)
        for x in ("zero new blocks", "peer pull starts", "forward")
        if x in log and not (step is v2_step and x == "zero new blocks")
    )
    assert log.index("fence") < first_write, log


def test_v1_fence_comes_before_block_zeroing():
    log: list[str] = []
    conn = worker(log)
    v1_step(conn, KVBranchMetadata(save_blocks=[3], save_slots=[0]), log, sync_loads=False)
    log.clear()
    v1_step(conn, KVBranchMetadata(host_fence=True), log, sync_loads=False)
    assert log[:2] == ["fence", "zero new blocks"]


def test_steps_without_peer_writes_do_not_wait_on_the_host():
    """Own loads and the compute stream are ordered on the GPU; a host wait there would stall
    async scheduling for nothing."""
    log: list[str] = []
    conn = worker(log)
    v1_step(conn, KVBranchMetadata(save_blocks=[3], save_slots=[0]), log, sync_loads=False)
    v1_step(conn, KVBranchMetadata(load_slots=[0], load_blocks=[5]), log, sync_loads=True)
    assert "fence" not in log


def test_scheduler_flags_a_step_with_a_peer_pull():
    index = HostBlockIndex(8)
    registry = SessionRegistry(
        index, block_size=4, block_bytes=1, pin_budget_bytes=4, default_ttl_s=60.0
    )
    planner = Planner(index, registry, 4)
    request = SimpleNamespace(
        request_id="r",
        num_prompt_tokens=9,
        block_hashes=[],
        all_token_ids=list(range(9)),
        num_computed_tokens=0,
        sampling_params=None,
    )

    def resolve(request_id):
        return []

    assert not planner.build_meta({}, resolve).host_fence
    planner.note_remote_hit(request, 8)
    assert planner.build_meta({}, resolve).host_fence
    assert not planner.build_meta({}, resolve).host_fence  # one step only


def test_finished_tail_copies_are_reported_after_the_save_and_only_once():
    """A finished request's blocks are kept until its tail copy ran (issue 14 item 1): the
    worker reports it in the same step's ``get_finished``, after ``wait_for_save``."""
    log: list[str] = []
    conn = worker(log)
    meta = KVBranchMetadata(save_blocks=[3], save_slots=[0], finished_saves=["r1"])
    conn.bind_connector_metadata(meta)
    assert conn.get_finished(set()) == (None, None)  # nothing copied yet
    conn.wait_for_save()
    assert log == ["save [3]"]
    assert conn.get_finished({"r1"}) == ({"r1"}, None)
    assert conn.get_finished(set()) == (None, None)


def test_finished_requests_are_reported_even_without_a_host_pool():
    """No pool (store off on this worker): the blocks must still be released."""
    conn = worker([])
    conn.worker_side.pool = None
    conn.bind_connector_metadata(KVBranchMetadata(finished_saves=["r1"]))
    conn.wait_for_save()
    assert conn.get_finished({"r1"}) == ({"r1"}, None)
