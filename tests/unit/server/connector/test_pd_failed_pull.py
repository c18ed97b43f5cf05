"""A pull that fails after its claim recomputes the turn, once, and later pulls still run.

vLLM 0.32's own ``NixlConnector`` with ``kv_load_failure_policy: "recompute"`` hangs here: the
scheduler puts a request whose read failed back in the waiting queue with its handle unchanged,
upstream offers D's tokens again, then skips the read it already queued once
(``_remote_blocks_processed``), and the request waits for a read that never comes
(docs/pd.md, "A pull that fails"). kvbranch's P must recompute instead.

Real parts: vLLM's ``Scheduler`` (and its ``AsyncScheduler``, for asynchronous scheduling) with
the connector stack and transfer config the launcher gives
P (``pd_transfer_config``: ``KVBranchPDConnector`` of ``VerifiedNixlConnector`` and the kvbranch
connector, failure policy "recompute"). Faked: only what the worker processes do. The fake
worker keeps what every device block holds (token ids written by a forward or by a read), reads
D's blocks as NIXL pairs them (P's blocks with the last blocks of D's list) or fails a read as
NIXL's worker reports a hold that expired (or a D that died) before the read, leaving the
blocks it had begun to write wrong; and it reports a step with nothing to say as vLLM's model
runner does, with no connector output. Its "model" answers a function of the prompt when every
position's KV holds the prompt's token, a wrong token otherwise: its answer is plain vLLM's
(the model on the prompt's own KV) exactly when no wrong KV was used."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import (
    MultiKVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import NixlConnectorMetadata
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from sdk.contract.models import PDStats
from server.connector.config import ConnectorConfig
from server.connector.pd import transfer_auth as auth
from server.connector.pd.late_reads import ReadReport
from server.connector.pd.sync_reads import SYNC_READS_ATTR
from server.connector.pd.transfer_params import block_hashes_hex, identity_of
from server.connector.pd.verified_nixl import VerifiedNixlConnector
from server.launcher.cli import build_parser, pd_transfer_config
from server.launcher.settings import CONNECTOR_CLASS, CONNECTOR_MODULE
from tests.unit.server.test_engine_scheduler import model_folder

BS = 16
NUM_BLOCKS = 40
SECRET = "f" * 64
#: Steps a turn may take before the test calls it hung (a turn here needs 3 or fewer).
STEP_LIMIT = 25
WRONG = -1  # what the fake model answers on wrong KV
D_ENGINE = {
    "remote_engine_id": "engine-d",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "transfer_mode": "pull",
}


def answer_to(tokens: list[int]) -> int:
    """The fake model's greedy answer to a prompt whose KV is right."""
    return 1 + sum((i + 1) * t for i, t in enumerate(tokens)) % 997


def make_scheduler(sync_wait_s: str = "0", overlapping: bool = False) -> Scheduler:
    """vLLM's scheduler as P runs it: the launcher's P/D transfer config (``sync_wait_s``:
    ``--sync-pull-wait-s``; 0, upstream's asynchronous loads). ``overlapping``: vLLM's
    asynchronous scheduling (its default where kvbranch's warm-first scheduler is off, as on
    GPUs): the next step is scheduled before the last one's output is taken, and a step's
    budget holds a prompt that needs every block."""
    model = ModelConfig(
        model=str(model_folder()), dtype="float32", max_model_len=1024, skip_tokenizer_init=True
    )
    sched = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=1024 if overlapping else 512,
        max_model_len=1024,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=BS, enable_prefix_caching=True)
    cache.num_gpu_blocks = NUM_BLOCKS
    kvbranch = {
        "kv_connector": CONNECTOR_CLASS,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": ConnectorConfig(host_store_bytes=0).to_extra(),
    }
    args = build_parser().parse_args(["--role", "prefill", "--sync-pull-wait-s", sync_wait_s])
    transfer = KVTransferConfig(**pd_transfer_config(args, kvbranch))
    assert transfer.kv_load_failure_policy == "recompute"
    config = VllmConfig(
        model_config=model, scheduler_config=sched, cache_config=cache, kv_transfer_config=transfer
    )
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    # vLLM's CPU platform turns asynchronous scheduling off; on GPUs it is on by default.
    config.scheduler_config.async_scheduling = overlapping
    scheduler = AsyncScheduler if overlapping else Scheduler
    return scheduler(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BS,
    )


def make_request(
    rid: str, tokens: list[int], params: dict | None = None, max_tokens: int = 1
) -> Request:
    init_none_hash(sha256)
    request = Request(
        rid,
        list(tokens),
        SamplingParams(max_tokens=max_tokens, temperature=0.0),
        None,
        block_hasher=get_request_block_hasher(BS, sha256),
    )
    request.kv_transfer_params = params
    return request


class FakeWorker:
    """What P's worker process does, reduced to the ids each device block holds."""

    def __init__(self, sched: Scheduler) -> None:
        self.sched = sched
        self.device: dict[int, list[int | None]] = {}
        #: D's memory: block id -> the token ids it holds.
        self.d_blocks: dict[int, list[int]] = {}
        #: Reads of these requests fail as NIXL reports an expired hold or a dead peer.
        self.fail_reads: set[str] = set()
        #: Synchronous reads of these requests are given up in flight: they land later
        #: (:meth:`land_late`), into the blocks they were given.
        self.late_reads: set[str] = set()
        self.in_flight: dict[str, tuple[list[int], list[int]]] = {}
        self._late: ReadReport | None = None
        self.reads: dict[str, int] = {}  # request id -> reads queued for it
        self.answers: dict[str, int] = {}
        self.tokens: dict[str, list[int]] = {}  # every token each request was given
        self._report: KVConnectorOutput | None = None

    def _write(self, block: int, offset: int, token: int) -> None:
        self.device.setdefault(block, [None] * BS)[offset] = token

    def _blocks_of(self, rid: str) -> list[int]:
        return list(self.sched.kv_cache_manager.get_block_ids(rid)[0])

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self.update(out, self.forward(out))
        return out

    def forward(self, out: SchedulerOutput) -> ModelRunnerOutput:
        """The worker's step ``out``: its reads, then its forward (each scheduled position's KV
        written, a token sampled where the prompt is complete)."""
        report, self._report = self._report, None
        lost = self._start_reads(out)
        if lost:
            # A synchronous read that did not land: this very step's load errors.
            report = report or KVConnectorOutput()
            report.invalid_block_ids = set(report.invalid_block_ids or ()) | lost
        if self._late is not None:
            # The NIXL child's worker metadata, as MultiConnector carries it (children in order).
            report = report or KVConnectorOutput()
            report.kv_connector_worker_meta = MultiKVConnectorWorkerMetadata(
                metadata=(self._late, None)
            )
            self._late = None
        ids = list(out.num_scheduled_tokens)
        sampled: list[list[int]] = []
        for rid in ids:
            request = self.sched.requests[rid]
            n = out.num_scheduled_tokens[rid]
            start = request.num_computed_tokens - n  # vLLM advanced it when it scheduled
            blocks = self._blocks_of(rid)
            tokens = request.all_token_ids
            for pos in range(start, start + n):
                self._write(blocks[pos // BS], pos % BS, tokens[pos])
            sampled.append(self._sample(request, blocks) if start + n == request.num_tokens else [])
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={rid: i for i, rid in enumerate(ids)},
            sampled_token_ids=sampled,
            # vLLM's model runner drops an empty connector output (a step with no transfer
            # news reaches the scheduler as None, not as an empty report).
            kv_connector_output=report if report is not None and not report.is_empty() else None,
        )

    def update(self, out: SchedulerOutput, output: ModelRunnerOutput) -> None:
        """The scheduler takes step ``out``'s output (with asynchronous scheduling, after it
        scheduled the next step)."""
        # Only what the scheduler keeps: it drops a step's token sampled on KV that failed to load.
        for outputs in self.sched.update_from_output(out, output).values():
            for o in outputs.outputs:
                if o.new_token_ids:
                    self.answers.setdefault(o.request_id, o.new_token_ids[0])
                    self.tokens.setdefault(o.request_id, []).extend(o.new_token_ids)

    def _sample(self, request: Request, blocks: list[int]) -> list[int]:
        prompt = request.all_token_ids
        held = [self.device.get(blocks[p // BS], [None] * BS)[p % BS] for p in range(len(prompt))]
        return [answer_to(list(prompt)) if held == list(prompt) else WRONG]

    def _start_reads(self, out: SchedulerOutput) -> set[int]:
        """NIXL's reads of this step: an asynchronous one reported at the next step (as the
        worker does), a synchronous one (``SYNC_READS_ATTR``) done before this step's forward.
        Returns the blocks of synchronous reads that did not land."""
        meta = out.kv_connector_metadata
        children = getattr(meta, "metadata", (meta,))
        nixl = next(m for m in children if isinstance(m, NixlConnectorMetadata))
        sync = getattr(nixl, SYNC_READS_ATTR, None) or {}
        done: set[str] = set()
        failed: set[str] = set()
        invalid: set[int] = set()
        lost: set[int] = set()
        for rid, req in nixl.reqs_to_recv.items():
            if rid in sync:
                assert not req.awaiting_kvs  # the scheduler runs it this step
            elif not req.awaiting_kvs:
                continue
            self.reads[rid] = self.reads.get(rid, 0) + 1
            local = list(req.local_block_ids[0])
            remote = list(req.remote.block_ids[0])[-len(local) :] if local else []
            if rid in sync and rid in self.late_reads:
                lost.update(local)  # given up at the wait, still in flight: pinned
                self.in_flight[rid] = (local, remote)
                self._late = ReadReport(given_up={rid: (local, 1)})
                continue
            if rid in self.fail_reads:
                # Cut off: whatever reached the blocks is not the prompt's KV.
                for block in local:
                    self.device[block] = [WRONG] * BS
                if rid in sync:
                    lost.update(local)
                    continue
                done.add(rid)
                failed.add(rid)
                invalid.update(local)
                continue
            if rid not in sync:
                done.add(rid)
            for mine, theirs in zip(local, remote, strict=True):
                self.device[mine] = list(self.d_blocks[theirs]) + [None] * (
                    BS - len(self.d_blocks[theirs])
                )
        if done:
            self._report = KVConnectorOutput(
                finished_recving=done, failed_recving=failed, invalid_block_ids=invalid
            )
        return lost

    def land_late(self, rid: str) -> None:
        """A given-up read's bytes arrive now, into the blocks it was given; the next step's
        output says it ended."""
        local, remote = self.in_flight.pop(rid)
        for mine, theirs in zip(local, remote, strict=True):
            self.device[mine] = list(self.d_blocks[theirs]) + [None] * (
                BS - len(self.d_blocks[theirs])
            )
        self._late = ReadReport(ended={rid: 1})


def d_handle(worker: FakeWorker, rid: str, held: list[int], first_block: int) -> dict[str, Any]:
    """D's sealed handle for ``held`` (its blocks filled in ``worker.d_blocks``), claimed for
    30 s as the router claims it right before P's turn."""
    blocks = list(range(first_block, first_block + -(-len(held) // BS)))
    for i, block in enumerate(blocks):
        worker.d_blocks[block] = held[i * BS : (i + 1) * BS]
    source = make_request(f"d-{rid}", held)
    nixl = worker.sched.connector._nixl
    params = dict(
        D_ENGINE,
        do_remote_decode=True,
        do_remote_prefill=False,
        remote_block_ids=[blocks],
        remote_request_id=f"d-{rid}",
        remote_num_tokens=len(held),
        remote_blocks_expiry_time=time.perf_counter() + 60,
        **{
            auth.TOKENS_FIELD: list(held),
            auth.HASHES_FIELD: block_hashes_hex(source, len(held) // BS),
            auth.IDENTITY_FIELD: identity_of(source, nixl.compat),
            auth.EXPIRES_FIELD: time.time() + 60,
        },
    )
    auth.seal(params, SECRET.encode())
    params[auth.CLAIM_FIELD] = auth.make_claim(params, time.time() + 30, SECRET.encode())
    return params


def run_to_tokens(worker: FakeWorker, rid: str, count: int) -> list[int]:
    """Step until ``rid`` has ``count`` tokens (or the step limit): the tokens it got."""
    for _ in range(STEP_LIMIT):
        worker.step()
        if len(worker.tokens.get(rid, ())) >= count:
            break
    return worker.tokens.get(rid, [])


def greedy(prompt: list[int], count: int) -> list[int]:
    """Plain vLLM's first ``count`` tokens: the fake model on right KV, token by token."""
    tokens = list(prompt)
    for _ in range(count):
        tokens.append(answer_to(tokens))
    return tokens[len(prompt) :]


def run_to_answer(worker: FakeWorker, rid: str) -> int:
    for _ in range(STEP_LIMIT):
        worker.step()
        if rid in worker.answers:
            return worker.answers[rid]
    status = worker.sched.requests[rid].status if rid in worker.sched.requests else None
    pytest.fail(f"{rid} has no answer after {STEP_LIMIT} steps (status {status}): it hangs")


@pytest.fixture
def p_worker(monkeypatch):
    monkeypatch.setenv(auth.ENV_CLUSTER_SECRET, SECRET)
    sched = make_scheduler()
    assert isinstance(sched.connector._nixl, VerifiedNixlConnector)
    yield FakeWorker(sched)
    sched.shutdown()


def conversation(seed: int, turn1: int, turn2: int) -> tuple[list[int], list[int]]:
    """What D holds after turn 1 (prompt and answer) and the next turn's prompt extending it."""
    held = [(seed * 31 + i * 7) % 500 + 1 for i in range(turn1)]
    return held, held + [(seed * 13 + i * 5) % 500 + 1 for i in range(turn2)]


def test_a_pull_that_fails_after_its_claim_recomputes_and_later_pulls_still_run(p_worker):
    worker = p_worker
    # Turn 2 of conversation A: D's claimed hold ends (or D dies) before P's worker reads it.
    held_a, prompt_a = conversation(1, 3 * BS + 5, 20)
    worker.fail_reads.add("a")
    worker.sched.add_request(make_request("a", prompt_a, d_handle(worker, "a", held_a, 100)))
    out = worker.step()
    assert worker.reads == {"a": 1}  # the pull was claimed and queued ...
    assert worker.sched.requests["a"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert not out.num_scheduled_tokens
    # ... and failed: the turn is recomputed (the model's answer on the prompt's own KV, as
    # plain vLLM gives it), with no second read of the handle and no wait for one.
    assert run_to_answer(worker, "a") == answer_to(prompt_a)
    assert worker.reads == {"a": 1}
    # A later pull (conversation B, from the same D) still runs: read once, P computes only
    # the new tokens, same answer.
    held_b, prompt_b = conversation(2, 2 * BS + 9, 11)
    worker.sched.add_request(make_request("b", prompt_b, d_handle(worker, "b", held_b, 200)))
    scheduled: list[int] = []
    for _ in range(STEP_LIMIT):
        out = worker.step()
        scheduled.append(out.num_scheduled_tokens.get("b", 0))
        if "b" in worker.answers:
            break
    assert worker.answers.get("b") == answer_to(prompt_b)
    assert worker.reads == {"a": 1, "b": 1}
    # P computed only what D did not hold
    assert sum(scheduled) == len(prompt_b) - len(held_b)


@pytest.fixture
def sync_p_worker(monkeypatch):
    monkeypatch.setenv(auth.ENV_CLUSTER_SECRET, SECRET)
    sched = make_scheduler(sync_wait_s="2")
    assert sched.connector._nixl.sync_pulls
    yield FakeWorker(sched)
    sched.shutdown()


def test_a_synchronous_pull_computes_the_turn_in_the_step_it_reads(sync_p_worker):
    worker = sync_p_worker
    held, prompt = conversation(3, 2 * BS + 9, 11)
    worker.sched.add_request(make_request("s", prompt, d_handle(worker, "s", held, 300)))
    out = worker.step()
    # One step: the read, then only what D did not hold, and plain vLLM's answer.
    assert worker.reads == {"s": 1}
    assert out.num_scheduled_tokens == {"s": len(prompt) - len(held)}
    assert worker.answers == {"s": answer_to(prompt)}


def test_a_synchronous_pull_that_fails_recomputes_and_later_pulls_still_run(sync_p_worker):
    worker = sync_p_worker
    held_a, prompt_a = conversation(1, 3 * BS + 5, 20)
    worker.fail_reads.add("a")
    worker.sched.add_request(make_request("a", prompt_a, d_handle(worker, "a", held_a, 100)))
    worker.step()
    # Read once, computed on blocks that did not land: the step's token is dropped ...
    assert worker.reads == {"a": 1} and "a" not in worker.answers
    # ... and the turn recomputed: plain vLLM's answer, no second read of the handle.
    assert run_to_answer(worker, "a") == answer_to(prompt_a)
    assert worker.reads == {"a": 1}
    held_b, prompt_b = conversation(2, 2 * BS + 9, 11)
    worker.sched.add_request(make_request("b", prompt_b, d_handle(worker, "b", held_b, 200)))
    assert run_to_answer(worker, "b") == answer_to(prompt_b)
    assert worker.reads == {"a": 1, "b": 1}


def test_a_late_reads_blocks_go_to_no_other_request_until_it_ended(sync_p_worker):
    worker = sync_p_worker
    sched = worker.sched
    held_a, prompt_a = conversation(4, 3 * BS + 5, 20)
    worker.late_reads.add("a")
    sched.add_request(make_request("a", prompt_a, d_handle(worker, "a", held_a, 100)))
    assert run_to_answer(worker, "a") == answer_to(prompt_a)  # recomputed meanwhile
    # P held the finished turn's blocks for D's read of it; D read them: the request ends.
    worker._report = KVConnectorOutput(finished_sending={"a"})
    worker.step()
    assert worker.reads == {"a": 1} and "a" not in sched.requests
    pinned = sched.connector._nixl.pinned_reads.blocks_pinned
    assert pinned == -(-len(held_a) // BS)  # the pulled range's blocks, out of the free pool
    assert PDStats.model_validate(sched.connector._pd_stats()).late_read_blocks_pinned == pinned
    # A cold prompt that needs every block, pinned ones included (two prefill chunks; the
    # blocks a finished request left cached are handed out last) ...
    prompt_c = [(i * 11) % 500 + 1 for i in range((NUM_BLOCKS - 1) * BS - 1)]
    sched.add_request(make_request("c", prompt_c, max_tokens=2))
    worker.step()
    worker.step()
    # ... and the late read's bytes arrive now: into blocks nobody else was given.
    worker.land_late("a")
    assert run_to_tokens(worker, "c", 2) == greedy(prompt_c, 2)
    assert sched.connector._nixl.pinned_reads.blocks_pinned == 0
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == NUM_BLOCKS - 1


@pytest.fixture
def overlapping_p_worker(monkeypatch):
    monkeypatch.setenv(auth.ENV_CLUSTER_SECRET, SECRET)
    sched = make_scheduler(sync_wait_s="2", overlapping=True)
    assert sched.connector._nixl.sync_pulls and sched.defer_block_free
    yield FakeWorker(sched)
    sched.shutdown()


def test_a_late_read_of_a_request_aborted_before_its_output_is_pinned_in_time(
    overlapping_p_worker,
):
    """With asynchronous scheduling the step after a give-up is scheduled before the give-up's
    report reaches the scheduler; a client's abort in between ends the request first. vLLM
    defers the free of a request's blocks until the output of its last scheduled step (a KV
    consumer with overlapping steps: ``defer_block_free``), and that output pins them: no
    allocation between. (With that deferral off, the cold prompt below is given the late
    read's blocks at once and its third token is computed on the late bytes.)"""
    worker = overlapping_p_worker
    sched = worker.sched
    held_a, prompt_a = conversation(5, 3 * BS + 5, 20)
    worker.late_reads.add("a")
    sched.add_request(make_request("a", prompt_a, d_handle(worker, "a", held_a, 100)))
    step_a = sched.schedule()
    output_a = worker.forward(step_a)  # the read given up in flight: its report in this output
    assert worker.reads == {"a": 1} and "a" in worker.in_flight
    # The client leaves before the step's output is taken; a cold prompt that needs every
    # block arrives and is scheduled next.
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    prompt_c = [(i * 11) % 500 + 1 for i in range((NUM_BLOCKS - 1) * BS - 3)]
    sched.add_request(make_request("c", prompt_c, max_tokens=3))
    step_c = sched.schedule()
    output_c = worker.forward(step_c)
    worker.update(step_a, output_a)
    worker.update(step_c, output_c)
    pinned = sched.connector._nixl.pinned_reads.blocks_pinned
    assert pinned == -(-len(held_a) // BS)
    # One more step (where vLLM recomputes what the read's load errors name), then the late
    # bytes arrive, then the cold prompt runs to its third token.
    worker.step()
    worker.land_late("a")
    assert run_to_tokens(worker, "c", 3) == greedy(prompt_c, 3)
    assert sched.connector._nixl.pinned_reads.blocks_pinned == 0
