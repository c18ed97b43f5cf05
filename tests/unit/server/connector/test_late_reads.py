"""A pull given up while in flight (``server/connector/pd/late_reads.py``): the worker keeps it
polled, unreleased, and the scheduler keeps its blocks out of vLLM's free pool until it ended.
The scheduler's side runs against vLLM's own ``BlockPool``."""

from __future__ import annotations

from typing import Any

from vllm.v1.core.block_pool import BlockPool

from server.connector.pd.late_reads import LateReads, PinnedReads, ReadReport
from tests.unit.server.connector.test_pd_params import FakeNixlStates, _connector


class Worker:
    def __init__(self, transfers: dict[str, list[int]], states: dict[int, str]) -> None:
        self._recving_transfers = transfers
        self._recv_failures: set[str] = set()
        self.nixl_wrapper = FakeNixlStates(states)  # a handle it does not list: KeyError


def test_a_read_in_flight_is_failed_now_and_kept_polled_until_it_ends():
    worker = Worker({"r": [1, 2]}, {1: "DONE", 2: "PROC"})
    late = LateReads()
    late.give_up(worker, "r", [7, 8])
    assert worker._recv_failures == {"r"} and "r" not in worker._recving_transfers
    assert worker.nixl_wrapper.released == [] and len(late) == 1
    report = late.report()
    assert report is not None and report.given_up == {"r": ([7, 8], 1)} and not report.ended
    late.poll(worker)
    assert late.report() is None and worker.nixl_wrapper.released == []
    worker.nixl_wrapper.states[2] = "ERR"  # failed: it writes nothing more either
    late.poll(worker)
    assert worker.nixl_wrapper.released == [1, 2] and len(late) == 0
    report = late.report()
    assert report is not None and report.ended == {"r": 1} and not report.given_up


def test_a_read_that_already_ended_is_released_and_never_reported():
    worker = Worker({"r": [1, 3]}, {1: "DONE"})  # 3: unknown to NIXL
    late = LateReads()
    late.give_up(worker, "r", [7])
    assert worker.nixl_wrapper.released == [1, 3] and len(late) == 0
    assert late.report() is None and worker._recv_failures == {"r"}


def test_reports_of_several_workers_add_up():
    a = ReadReport({"r": ([1, 2], 1)}, {"q": 1})
    b = ReadReport({"r": ([2, 3], 1), "s": ([9], 1)}, {"q": 1})
    both = a.aggregate(b)
    assert both.given_up == {"r": ([1, 2, 3], 2), "s": ([9], 1)} and both.ended == {"q": 2}


def _pool() -> BlockPool:
    return BlockPool(num_gpu_blocks=8, enable_caching=True, hash_block_size=4)


def _pinned(pool: BlockPool, report: ReadReport) -> PinnedReads:
    pinned = PinnedReads()
    pinned.block_pool = pool
    pinned.apply(report)
    return pinned


def _ids(blocks: list[Any]) -> list[int]:
    return [b.block_id for b in blocks]


def test_a_late_reads_blocks_outlive_their_request_until_it_ended():
    pool = _pool()
    request_blocks = pool.get_new_blocks(3)
    free = pool.get_num_free_blocks()
    pinned = _pinned(pool, ReadReport({"r": (_ids(request_blocks)[1:], 1)}))
    assert pinned.blocks_pinned == 2
    pool.free_blocks(request_blocks)  # the request ends (or is preempted)
    assert pool.get_num_free_blocks() == free + 1  # only the block the read does not write
    others = pool.get_new_blocks(pool.get_num_free_blocks())
    assert not set(_ids(others)) & set(_ids(request_blocks)[1:])  # nobody else gets them
    pool.free_blocks(others)
    pinned.apply(ReadReport(ended={"r": 1}))
    assert pinned.blocks_pinned == 0 and pool.get_num_free_blocks() == free + 3


def test_a_pin_waits_for_every_worker_that_gave_the_read_up():
    pool = _pool()
    blocks = pool.get_new_blocks(2)
    pinned = _pinned(pool, ReadReport({"r": (_ids(blocks), 2)}))
    pool.free_blocks(blocks)
    free = pool.get_num_free_blocks()
    pinned.apply(ReadReport(ended={"r": 1}))
    assert pool.get_num_free_blocks() == free and pinned.blocks_pinned == 2
    pinned.apply(ReadReport(ended={"r": 1, "unknown": 1}))
    assert pool.get_num_free_blocks() == free + 2 and pinned.blocks_pinned == 0


def test_the_null_block_and_ids_outside_the_pool_are_never_pinned():
    pool = _pool()
    pinned = _pinned(pool, ReadReport({"r": ([0, 99, -1], 1)}))
    assert pinned.blocks_pinned == 0
    pinned.apply(ReadReport(ended={"r": 1}))


def test_without_a_bound_block_pool_nothing_is_pinned():
    pinned = PinnedReads()
    pinned.apply(ReadReport({"r": ([1], 1)}, {"r": 1}))
    assert pinned.blocks_pinned == 0


def test_the_nixl_child_pins_what_its_workers_report():
    conn = _connector()
    pool = _pool()
    blocks = pool.get_new_blocks(2)
    conn.bind_gpu_block_pool(pool)

    class StepOutput:
        finished_sending = None
        finished_recving = None
        invalid_block_ids: set[int] = set()
        kv_connector_worker_meta = ReadReport({"r": (_ids(blocks), 1)})

    conn.update_connector_output(StepOutput())
    assert conn.pinned_reads.blocks_pinned == 2 and conn.pinned_reads.reads_reported == 1
    StepOutput.kv_connector_worker_meta = ReadReport(ended={"r": 1})
    conn.update_connector_output(StepOutput())
    assert conn.pinned_reads.blocks_pinned == 0
