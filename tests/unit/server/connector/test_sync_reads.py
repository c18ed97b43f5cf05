"""A verified pull loaded synchronously (``server/connector/pd/sync_reads.py``): the scheduler
is told "not async" and the read goes into the pulled range's blocks; the worker waits for it
before the forward, and whatever did not land becomes this step's load errors (recompute),
never a request the scheduler would take for a parked one."""

from __future__ import annotations

import queue
from typing import Any

from server.connector.pd.late_reads import ReadReport
from server.connector.pd.sync_reads import READ_TIMED_OUT, SYNC_READS_ATTR, wait_for_reads
from tests.unit.server.connector.test_pd_params import (
    HELD,
    PROMPT,
    Blocks,
    Req,
    _connector,
    _d_handle,
    _RaisingAlloc,
)


class AllBlocks(Blocks):
    """The request's blocks as the scheduler holds them after a synchronous allocation: the
    pulled range is already hashed (cached), so upstream finds none of it unhashed."""

    def get_block_ids(self) -> tuple:
        return (list(self.ids),)

    def get_unhashed_block_ids_all_groups(self) -> tuple:
        return (list(self.ids[-1:]),)


def _sync_pull(conn: Any, req: Req, local: int, blocks: list[int]) -> tuple:
    conn.on_new_request(req)
    n, load_async = conn.get_num_new_matched_tokens(req, local)
    conn.update_state_after_alloc(req, AllBlocks(blocks), n or 0)
    return n, load_async


def test_a_verified_pull_is_loaded_synchronously_into_the_pulled_range():
    conn = _connector(sync=True)
    req = Req("p", PROMPT, _d_handle(HELD))
    # 4 tokens (one block) hit locally; D's 14 verified tokens give 10 more (3 blocks).
    assert _sync_pull(conn, req, 4, [7, 8, 9, 10, 11]) == (10, False)
    entry = conn.connector_scheduler._reqs_need_recv["p"]
    assert entry[1] == [[8, 9, 10]] and entry[2] == (1,) and entry[3] is False
    meta = conn.build_connector_meta(_Output())
    assert getattr(meta, SYNC_READS_ATTR) == {"p": None}
    assert not getattr(conn.build_connector_meta(_Output()), SYNC_READS_ATTR, None)  # once
    assert conn.sync_reads == 1


def test_without_sync_pulls_the_load_stays_upstreams_asynchronous_one():
    conn = _connector(sync=False)
    req = Req("p", PROMPT, _d_handle(HELD))
    assert _sync_pull(conn, req, 4, [7, 8, 9, 10, 11]) == (10, True)
    assert not getattr(conn.build_connector_meta(_Output()), SYNC_READS_ATTR, None)


def test_a_declined_handle_is_no_synchronous_load():
    conn = _connector(sync=True)
    req = Req("p", PROMPT, _d_handle(HELD, claimed=False))
    assert _sync_pull(conn, req, 0, [7, 8, 9, 10]) == (0, False)
    assert not getattr(conn.build_connector_meta(_Output()), SYNC_READS_ATTR, None)


def test_a_synchronous_load_upstream_did_not_queue_is_recomputed():
    conn = _connector(upstream=_RaisingAlloc(), sync=True)
    req = Req("p", PROMPT, _d_handle(HELD))
    assert _sync_pull(conn, req, 4, [7, 8, 9, 10, 11]) == (10, False)
    meta = conn.build_connector_meta(_Output())
    assert getattr(meta, SYNC_READS_ATTR) == {"p": [8, 9, 10]}  # blocks no read fills
    assert not conn._unqueued  # not reported "received": the request runs


class _Output:
    total_num_scheduled_tokens = 1
    scheduled_new_reqs: list = []
    scheduled_cached_reqs = None
    finished_req_ids: set = set()


class FakeNixl:
    def __init__(self, states: dict[int, list[str]], released: list[int]) -> None:
        self.states = states  # handle -> the states it reports, in turn (the last one stays)
        self.released = released

    def release_xfer_handle(self, handle: int) -> None:
        self.released.append(handle)

    def check_xfer_state(self, handle: int) -> str:
        seq = self.states[handle]
        return seq.pop(0) if len(seq) > 1 else seq[0]


class ReadMeta:
    def __init__(self, ids: list[int]) -> None:
        self.local_block_ids = [list(ids)]
        self.local_physical_block_ids = [list(ids)]


class FakeWorker:
    """NIXL's pull worker, the state the wait reads: transfers, failures, handshakes."""

    use_host_buffer = False
    enable_permute_local_kv = False
    enable_heterogeneous_attn_post_process = False

    def __init__(self, transfers: dict[str, list[int]], states: dict[int, list[str]]) -> None:
        self._recving_transfers = transfers
        self._recving_metadata: dict[str, Any] = {r: object() for r in transfers}
        self._recv_failures: set[str] = set()
        self._failed_recv_reqs: queue.Queue = queue.Queue()
        self._ready_requests: queue.Queue = queue.Queue()
        self.started: list[str] = []
        self.released: list[int] = []
        self.nixl_wrapper = FakeNixl(states, self.released)

    def _read_blocks_for_req(self, req_id: str, meta: Any) -> None:
        self.started.append(req_id)
        self._recving_transfers[req_id] = [99]

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set()  # upstream's own (failed async reads): none here


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_the_wait_ends_when_every_read_landed_or_failed():
    worker = FakeWorker(
        {"a": [1], "b": [2]}, {1: ["PROC", "PROC", "DONE"], 2: ["ERR"], 99: ["DONE"]}
    )
    worker._ready_requests.put(("c", ReadMeta([5])))  # its handshake just finished
    clock = Clock()
    states = wait_for_reads(worker, ["a", "b", "c"], 2.0, clock, clock.sleep)
    assert states == {"a": "done", "b": "failed", "c": "done"} and worker.started == ["c"]
    assert clock.now < 0.01


def test_a_read_not_landed_by_the_deadline_times_out():
    worker = FakeWorker({"a": [1]}, {1: ["PROC"]})
    clock = Clock()
    assert wait_for_reads(worker, ["a", "hs"], 0.05, clock, clock.sleep) == {
        "a": READ_TIMED_OUT,
        "hs": READ_TIMED_OUT,  # its peer's handshake never finished
    }
    assert 0.05 <= clock.now < 0.06


class StepMeta:
    def __init__(self, reads: dict[str, ReadMeta], sync: dict[str, Any]) -> None:
        self.reqs_to_recv = reads
        setattr(self, SYNC_READS_ATTR, sync)


def test_what_did_not_land_is_this_steps_load_errors_and_never_reported_received():
    conn = _connector(sync=True)
    conn.sync_pull_wait_s = 0.01
    worker = FakeWorker({"ok": [1], "slow": [2]}, {1: ["DONE"], 2: ["PROC"]})
    hs_meta = ReadMeta([30, 31])
    reads = {"ok": ReadMeta([10]), "slow": ReadMeta([20, 21]), "hs": hs_meta}
    meta = StepMeta(reads, {"ok": None, "slow": None, "hs": None, "lost": [40]})
    conn.connector_worker = worker
    conn._wait_for_sync_reads(worker, meta, getattr(meta, SYNC_READS_ATTR))
    assert conn.get_block_ids_with_load_errors() == {20, 21, 30, 31, 40}
    assert conn.get_block_ids_with_load_errors() == set()  # this step's only
    # The slow read is failed but kept in flight, unreleased (a release would not stop it),
    # its blocks reported for the scheduler to pin; the handshake's read will only notify.
    assert worker.released == [] and "slow" not in worker._recving_transfers
    assert worker._recv_failures == {"slow"} and len(conn.late_reads) == 1
    report = conn.build_connector_worker_meta()
    assert report.given_up == {"slow": ([20, 21], 1)}
    # Whether each landed, by request id, for the scheduler's accounts.
    assert report.sync_landed == {"ok": True, "slow": False, "hs": False, "lost": False}
    assert list(report.sync_landed.values()).count(False) == 3  # not landed, of the four
    assert conn.build_connector_worker_meta() is None  # this step's only
    assert hs_meta.local_physical_block_ids == [] and hs_meta.local_block_ids == [[]]
    # Reported by upstream later (then kept from the scheduler); the abandoned one never is.
    assert conn._sync_ids == {"ok", "slow"}


def test_a_failed_read_with_a_transfer_still_in_flight_keeps_its_blocks_pinned():
    conn = _connector(sync=True)
    conn.sync_pull_wait_s = 0.01
    worker = FakeWorker({"mixed": [3, 4], "failed": [5]}, {3: ["ERR"], 4: ["PROC"], 5: ["ERR"]})
    reads = {"mixed": ReadMeta([50, 51]), "failed": ReadMeta([60])}
    meta = StepMeta(reads, {"mixed": None, "failed": None})
    conn.connector_worker = worker
    conn._wait_for_sync_reads(worker, meta, getattr(meta, SYNC_READS_ATTR))
    assert conn.get_block_ids_with_load_errors() == {50, 51, 60}
    # One transfer of "mixed" failed, the other may still write: pinned until it ends.
    # "failed" ended with its only transfer: released, nothing to pin.
    assert conn.build_connector_worker_meta().given_up == {"mixed": ([50, 51], 1)}
    assert worker.released == [5] and len(conn.late_reads) == 1


def test_a_synchronous_read_is_kept_out_of_what_the_scheduler_is_told():
    conn = _connector(sync=True)
    conn._sync_ids = {"ok", "slow"}

    class Results:
        finished_recving = {"ok", "async-one"}
        failed_recving = {"slow"}

    conn.pull_timeout_s = 0
    conn.connector_worker = None
    results = _filtered(conn, Results())
    assert results.finished_recving == {"async-one"} and results.failed_recving == set()
    assert conn._sync_ids == set()


def _filtered(conn: Any, results: Any) -> Any:
    """The connector's ``get_transfer_results`` on ``results`` as upstream's would give them."""
    from server.connector.vllm_compat import NixlConnector

    original = NixlConnector.get_transfer_results
    NixlConnector.get_transfer_results = lambda self, finished: results  # type: ignore[method-assign]
    try:
        return conn.get_transfer_results(set())
    finally:
        NixlConnector.get_transfer_results = original  # type: ignore[method-assign]


def test_the_scheduler_learns_which_synchronous_reads_did_not_land():
    """By request id from the workers' report: with asynchronous scheduling the next step's
    reads are queued before this step's output arrives, and a step's output may carry no
    connector news at all."""
    conn = _connector(sync=True)
    first = Req("p", PROMPT, _d_handle(HELD))
    _sync_pull(conn, first, 4, [7, 8, 9, 10, 11])
    second = Req("q", PROMPT, _d_handle(HELD))
    _sync_pull(conn, second, 4, [20, 21, 22, 23, 24])  # queued before the first one's output
    assert conn.loads_synchronously(first) and conn.loads_synchronously(second)

    class StepOutput:
        finished_sending = None
        finished_recving = None
        invalid_block_ids = {9}
        # Two tensor-parallel workers: the first read landed on one of them only.
        kv_connector_worker_meta = ReadReport(sync_landed={"p": True}).aggregate(
            ReadReport(sync_landed={"p": False})
        )

    conn.update_connector_output(StepOutput())
    assert conn.take_failed_sync_reads() == [(first, 0)]
    assert conn.take_failed_sync_reads() == []
    StepOutput.kv_connector_worker_meta = ReadReport(sync_landed={"q": True})
    conn.update_connector_output(StepOutput())  # the second step's: it landed
    assert conn.take_failed_sync_reads() == [] and conn._sync_inflight == {}
