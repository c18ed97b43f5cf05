"""Transfer params a client sends cannot steer NIXL (issue 22): the allow-list on first sight,
checks whatever markers the client set, server-side verdicts keyed by the engine request,
hooks that never raise into vLLM's scheduler, engine compatibility in the identity, no pull for
requests that read no prefix cache, and reads that end in bounded time.

The connector runs against upstream's real ``NixlPullConnectorScheduler`` methods (vLLM 0.32),
built without an engine: only the request bookkeeping the hooks touch."""

from __future__ import annotations

import time
from typing import Any

import pytest
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import (
    NixlPullConnectorScheduler,
)
from vllm.v1.request import RequestStatus

from server.connector.pd import transfer_auth as auth
from server.connector.pd.hold_registry import HoldRegistry
from server.connector.pd.transfer_auth import make_claim, seal
from server.connector.pd.transfer_params import INCOMING_KEYS, identity_of, sanitize
from server.connector.pd.verified_nixl import VerifiedNixlConnector
from tests.unit.server.connector.fakes import BS, chained_hashes

SECRET = b"k" * 32
COMPAT = {"model": "m", "dtype": "bfloat16", "kv_dtype": "auto", "block_size": BS}
PEER = {
    "remote_engine_id": "engine-d",
    "remote_host": "10.0.0.7",
    "remote_port": 5600,
    "tp_size": 1,
    "dcp_size": 1,
    "pp_size": 1,
    "transfer_mode": "pull",
}


class Upstream(NixlPullConnectorScheduler):
    """Upstream's scheduler half with only its per-request state (no engine, no sockets)."""

    def __init__(self) -> None:  # noqa: D107 - deliberately skips upstream's __init__
        self.is_bidirectional_kv_xfer_enabled = True
        self.use_host_buffer = False
        self.kv_recompute_threshold = 0
        self._reqs_need_recv: dict = {}
        self._reqs_need_save: dict = {}
        self._reqs_need_send: dict = {}
        self._reqs_in_batch: set = set()
        self._reqs_not_processed: set = set()
        self._heartbeat_by_engine: dict = {}
        self._heartbeat_req_engine: dict = {}

    def _prefill_backoff(self) -> int:
        return 0

    def get_exchange_clipped_blocks(self, block_ids: Any, clip_ssm: bool = True) -> Any:
        return block_ids


class Req:
    """The engine request's fields the hooks read (duck-typed like vLLM's ``Request``)."""

    def __init__(self, rid: str, prompt: list[int], params: dict | None, **kw: Any) -> None:
        self.request_id = rid
        self.prompt_token_ids = list(prompt)
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.kv_transfer_params = params
        self.block_hashes = chained_hashes(prompt, kw.get("cache_salt"))
        self.cache_salt = kw.get("cache_salt")
        self.lora_request = None
        self.mm_features: list = []
        self.prompt_embeds = None
        self.skip_reading_prefix_cache = kw.get("skip_reading_prefix_cache", False)
        self.session_id = kw.get("session_id")
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0

    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)


class Blocks:
    def __init__(self, ids: list[int]) -> None:
        self.ids = ids
        self.blocks: tuple = ([],)

    def get_unhashed_block_ids_all_groups(self) -> tuple:
        return (list(self.ids),)


def _connector(
    compat: dict = COMPAT, upstream: Any = None, sync: bool = False
) -> VerifiedNixlConnector:
    conn = object.__new__(VerifiedNixlConnector)  # no engine: the hooks' decisions only
    conn.connector_scheduler = upstream if upstream is not None else Upstream()
    conn.connector_worker = None
    conn.block_size = BS
    conn.group_kinds = ("full_attention",)
    conn.compat = dict(compat)
    conn.secret = SECRET
    conn.consumed = auth.ConsumedHandles()
    conn.holds = HoldRegistry(30.0)
    conn.hold_ttl_s = 480.0
    conn.pull_timeout_s = 60.0
    conn.sync_pulls = sync
    conn.sync_pull_wait_s = 2.0
    conn.declined = {}
    conn._init_tracking()
    return conn


def _handle(
    rid: str, tokens: list[int], compat: dict, *, from_d: bool, first_block: int, life_s: float
) -> dict:
    """A sealed handle naming ``tokens``' blocks: D's (P pulls it back) or P's (D reads it)."""
    req = Req(rid, tokens, None)
    params = dict(
        PEER,
        do_remote_prefill=not from_d,
        do_remote_decode=from_d,
        remote_block_ids=[list(range(first_block, first_block + -(-len(tokens) // BS)))],
        remote_request_id=rid,
        remote_num_tokens=len(tokens),
        remote_blocks_expiry_time=time.perf_counter() + 400 if from_d else None,
        **{
            auth.TOKENS_FIELD: tokens,
            auth.HASHES_FIELD: [h.hex() for h in req.block_hashes],
            auth.IDENTITY_FIELD: identity_of(req, compat),
            auth.EXPIRES_FIELD: time.time() + life_s,
        },
    )
    return seal(params, SECRET)


def _d_handle(held: list[int], compat: dict = COMPAT, claimed: bool = True) -> dict:
    """D's handle for P's next turn, as the router forwards it (sealed, claimed)."""
    params = _handle("d-turn", held, compat, from_d=True, first_block=100, life_s=400)
    if claimed:
        params[auth.CLAIM_FIELD] = make_claim(params, time.time() + 30, SECRET)
    return params


def _p_handle(prompt: list[int], compat: dict = COMPAT) -> dict:
    """P's handle for D's read of the prompt it just prefilled."""
    return _handle("p-leg", prompt, compat, from_d=False, first_block=200, life_s=60)


def _schedule(conn: VerifiedNixlConnector, req: Req, blocks: list[int] | None = None) -> tuple:
    """vLLM's order for a new request: on_new_request, the match, the allocation."""
    conn.on_new_request(req)
    n, load_async = conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, Blocks(blocks or [1, 2, 3, 4]), n or 0)
    return n, load_async


HELD = list(range(1, 15))  # 14 tokens D holds
PROMPT = HELD + [50, 51]  # P's next turn extends them


def _no_peer_left(params: dict) -> bool:
    return set(params) <= {"do_remote_prefill", "do_remote_decode"} and not params.get(
        "do_remote_prefill"
    )


# --- 1. the allow-list, server-side verdicts ----------------------------------------------
def test_sanitize_keeps_nixl_and_sealed_keys_and_drops_every_marker():
    params = dict(_d_handle(HELD), kvbranch_verified=1, _remote_blocks_processed=True)
    params.update(_p_side_truncated=True, remote_block_size=1, whatever=[1])
    dropped = sanitize(params)
    assert set(dropped) == {
        "kvbranch_verified",
        "_remote_blocks_processed",
        "_p_side_truncated",
        "remote_block_size",
        "whatever",
    }
    assert set(params) <= INCOMING_KEYS and auth.MAC_FIELD in params and auth.CLAIM_FIELD in params


def test_sanitize_drops_ps_cached_token_count_without_a_word():
    """vLLM's scheduler adds ``remote_prefill_cached_tokens`` to every P handle (for D's API
    server's usage report): dropped in the engine core like any unknown key, but not reported
    as a key a client may not set (the log line fired once per P/D turn)."""
    params = dict(_p_handle(PROMPT), remote_prefill_cached_tokens=128)
    assert sanitize(params) == []
    assert "remote_prefill_cached_tokens" not in params and set(params) <= INCOMING_KEYS
    params = dict(_p_handle(PROMPT), remote_prefill_cached_tokens=128, whatever=1)
    assert sanitize(params) == ["whatever"]


def test_issue_22_a_p_handle_marked_verified_with_another_prompt_reads_nothing_on_d():
    # The attack: P's params, seal and claim removed, "kvbranch_verified" added, sent to D with
    # a different prompt. The old code skipped every check and D read P's blocks.
    forged = _p_handle(PROMPT)
    forged.pop(auth.MAC_FIELD)
    forged["kvbranch_verified"] = 1
    conn = _connector()
    req = Req("attack", [9, 9, 9, 9, 9, 9, 9, 9, 9], forged)
    assert _schedule(conn, req) == (0, False)
    assert conn.declined == {"unsealed": 1}
    assert "attack" not in conn.connector_scheduler._reqs_need_recv
    assert _no_peer_left(req.kv_transfer_params)
    assert not conn.connector_scheduler._heartbeat_by_engine  # no heartbeat to its host


def test_a_marked_and_still_sealed_handle_is_checked_too():
    # Seal intact but for another prompt: the marker no longer skips the token check.
    params = dict(_p_handle(PROMPT), kvbranch_verified=len(PROMPT))
    conn = _connector()
    req = Req("attack", [7] * 16, params)
    assert _schedule(conn, req) == (0, False)
    assert conn.declined == {"tokens": 1}


def test_a_client_remote_blocks_processed_marker_can_neither_skip_checks_nor_hang():
    # Old code: the marker skipped our checks; upstream then promised an async load for D's
    # blocks but never queued the read: "KV fetch in progress" for good.
    forged = dict(_d_handle(HELD), _remote_blocks_processed=True)
    forged.pop(auth.CLAIM_FIELD)
    conn = _connector()
    req = Req("p", PROMPT, forged)
    assert _schedule(conn, req) == (0, False)
    assert conn.declined == {"unclaimed": 1}
    # the same with a valid claim: the marker is dropped and the pull is really queued
    conn = _connector()
    req = Req("p", PROMPT, dict(_d_handle(HELD), _remote_blocks_processed=True))
    n, load_async = _schedule(conn, req)
    assert (n, load_async) == (14, True)
    assert "p" in conn.connector_scheduler._reqs_need_recv
    assert not conn._unqueued


def test_upstreams_own_marker_after_processing_keeps_one_read_per_request():
    conn = _connector()
    req = Req("p", PROMPT, _d_handle(HELD))
    assert _schedule(conn, req) == (14, True)
    assert req.kv_transfer_params["_remote_blocks_processed"] is True  # set by upstream
    conn.connector_scheduler._reqs_need_recv.clear()  # the step's metadata was built
    # preempted and asked again: no second promise of a read upstream would never queue
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    conn.update_state_after_alloc(req, Blocks([1, 2]), 0)
    assert not conn.connector_scheduler._reqs_need_recv and not conn._unqueued


def test_verdicts_are_per_request_object_not_per_request_id():
    conn = _connector()
    first = Req("same-id", PROMPT, _d_handle(HELD))
    assert _schedule(conn, first) == (14, True)
    # another request with the same id (a client-chosen id): checked on its own
    second = Req("same-id", PROMPT, dict(_d_handle(HELD), **{auth.MAC_FIELD: "0" * 64}))
    assert _schedule(conn, second) == (0, False)
    assert conn.declined == {"unsealed": 1}


def test_the_record_of_a_request_ends_with_it():
    conn = _connector(upstream=_Finishing())
    req = Req("p", PROMPT, _d_handle(HELD))
    _schedule(conn, req)
    assert len(conn._seen) == 1
    req.status = RequestStatus.FINISHED_STOPPED
    conn.request_finished(req, [1, 2, 3, 4])
    assert not conn._seen


def test_a_replayed_handle_is_declined():
    handle = _d_handle(HELD)
    conn = _connector()
    assert _schedule(conn, Req("a", PROMPT, dict(handle)))[0] == 14
    assert _schedule(conn, Req("b", PROMPT, dict(handle))) == (0, False)
    assert conn.declined == {"reused": 1}


def test_do_remote_prefill_without_a_handle_is_declined_not_an_assertion():
    # upstream: "load async" for the whole prompt, then assert num_external_tokens == 0
    conn = _connector()
    req = Req("d", PROMPT, {"do_remote_prefill": True})
    assert _schedule(conn, req) == (0, False)
    assert conn.declined == {"unsealed": 1}


def test_the_routers_plain_legs_are_untouched():
    conn = _connector()
    for params in ({"do_remote_decode": True}, {"do_remote_prefill": False}):
        req = Req("leg", PROMPT, dict(params))
        _schedule(conn, req)
        assert req.kv_transfer_params.get("do_remote_decode") == params.get("do_remote_decode")
    assert conn.declined == {}


# --- 2. hooks never raise into the scheduler ----------------------------------------------
class _Raising(Upstream):
    """Upstream failing on a handle (any hostile shape it chokes on), fine without one."""

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if request.kv_transfer_params.get("remote_block_ids"):
            raise KeyError("remote_engine_id")
        return super().get_num_new_matched_tokens(request, num_computed_tokens)


class _RaisingAlloc(Upstream):
    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        raise AssertionError("upstream")


class _Finishing(Upstream):
    def request_finished(self, request, block_ids):
        return False, None


class _RaisingFinish(Upstream):
    def request_finished(self, request, block_ids):
        raise TypeError("upstream")


def test_upstream_raising_on_a_handle_declines_it_and_retries_without():
    conn = _connector(upstream=_Raising())
    req = Req("p", PROMPT, _d_handle(HELD))
    assert conn.get_num_new_matched_tokens(req, 0) == (0, False)
    assert conn.declined == {"error": 1}
    assert _no_peer_left(
        {k: v for k, v in req.kv_transfer_params.items() if k != "do_remote_prefill"}
    )


def test_an_allocation_upstream_failed_to_queue_is_recomputed_not_awaited_forever():
    conn = _connector(upstream=_RaisingAlloc())
    req = Req("p", PROMPT, _d_handle(HELD))
    conn.on_new_request(req)
    assert conn.get_num_new_matched_tokens(req, 4) == (10, True)
    conn.update_state_after_alloc(req, Blocks([1, 2, 3, 4]), 10)  # raises inside: caught
    req.status = RequestStatus.WAITING_FOR_REMOTE_KVS  # what the scheduler does next
    req.num_computed_tokens = 14

    class Output:
        finished_sending = None
        finished_recving = None

    out = Output()
    conn.update_connector_output(out)
    assert out.finished_recving == {"p"}  # unblocks the scheduler ...
    assert req.num_computed_tokens == 4  # ... with only the local hit valid: recompute
    conn.update_connector_output(Output())  # reported once
    assert not conn._unqueued and conn.reads_not_queued == 1


def test_an_unqueued_read_of_a_request_aborted_meanwhile_frees_its_blocks():
    conn = _connector(upstream=_RaisingAlloc())
    req = Req("p", PROMPT, _d_handle(HELD))
    conn.get_num_new_matched_tokens(req, 0)
    conn.update_state_after_alloc(req, Blocks([1, 2, 3, 4]), 14)
    req.status = RequestStatus.FINISHED_ABORTED  # vLLM keeps its blocks until "received"

    class Output:
        finished_sending = None
        finished_recving = {"other"}

    out = Output()
    conn.update_connector_output(out)
    assert out.finished_recving == {"other", "p"}


def test_request_finished_never_raises():
    conn = _connector(upstream=_RaisingFinish())
    req = Req("p", PROMPT, {"do_remote_decode": True})
    req.status = RequestStatus.FINISHED_STOPPED
    assert conn.request_finished(req, [1, 2]) == (False, None)


def test_a_check_that_raises_declines_the_handle():
    conn = _connector()
    req = Req("p", PROMPT, _d_handle(HELD))
    conn.consumed = None  # type: ignore[assignment]  # a bug of ours: the consume step raises
    assert _schedule(conn, req) == (0, False)
    assert conn.declined == {"error": 1}


# --- 4. a declined handle leaves no peer to contact ---------------------------------------
def test_a_declined_handle_leaves_no_field_that_names_a_peer():
    params = dict(_d_handle(HELD), remote_block_size=1)
    params[auth.EXPIRES_FIELD] = time.time() - 1  # expired (the seal no longer matches either)
    conn = _connector()
    req = Req("p", PROMPT, params)
    _schedule(conn, req)
    # (upstream marks it processed afterwards, on the server's dict: its own bookkeeping)
    left = set(req.kv_transfer_params) - {"_remote_blocks_processed"}
    assert left == {"do_remote_prefill", "do_remote_decode"}
    assert not conn.connector_scheduler._reqs_need_recv


def test_remote_block_size_never_reaches_upstream():
    conn = _connector()
    req = Req("p", PROMPT, dict(_d_handle(HELD), remote_block_size=1))
    assert _schedule(conn, req) == (14, True)
    assert "remote_block_size" not in req.kv_transfer_params


# --- 5. engine compatibility --------------------------------------------------------------
@pytest.mark.parametrize(
    "other", [{"model": "other"}, {"kv_dtype": "fp8"}, {"block_size": 16}, {"dtype": "half"}]
)
def test_a_handle_from_an_incompatible_engine_is_declined_for_identity(other):
    theirs = dict(COMPAT, **other)
    conn = _connector()
    assert _schedule(conn, Req("p", PROMPT, _d_handle(HELD, compat=theirs))) == (0, False)
    assert _schedule(conn, Req("d", PROMPT, _p_handle(PROMPT, compat=theirs))) == (0, False)
    assert conn.declined == {"identity": 2}


def test_a_compatible_d_read_goes_ahead():
    conn = _connector()
    n, load_async = _schedule(conn, Req("d", PROMPT, _p_handle(PROMPT)))
    assert (n, load_async) == (len(PROMPT), True) and not conn.declined


# --- 6. no pull for a request that reads no prefix cache ----------------------------------
def test_prompt_logprobs_requests_never_pull():
    conn = _connector()
    req = Req("p", PROMPT, _d_handle(HELD), skip_reading_prefix_cache=True)
    _schedule(conn, req)
    assert conn.declined == {"no_prefix_cache": 1}
    assert "p" not in conn.connector_scheduler._reqs_need_recv  # no contact with D at all


# --- 7. a read in flight ends -------------------------------------------------------------
class FakeNixlStates:
    def __init__(self, states: dict[int, str]) -> None:
        self.states = states
        self.released: list[int] = []

    def check_xfer_state(self, handle: int) -> str:
        return self.states[handle]

    def release_xfer_handle(self, handle: int) -> None:
        self.released.append(handle)


class ReadMeta:
    def __init__(self, *groups: list[int]) -> None:
        self.local_block_ids = [list(g) for g in groups]


class FakeWorker:
    def __init__(self) -> None:
        self._recving_transfers = {"slow": [11, 12], "fast": [13]}
        self._recving_metadata = {"slow": ReadMeta([5, 6]), "fast": ReadMeta([7])}
        self._recv_failures: set[str] = set()
        self.nixl_wrapper = FakeNixlStates({11: "DONE", 12: "PROC", 13: "PROC"})


def test_a_read_past_the_timeout_is_given_up_and_kept_polled_until_it_ends():
    conn = _connector()
    worker = FakeWorker()
    conn._fail_slow_reads(worker, 100.0)
    assert not worker._recv_failures  # first seen now
    worker._recving_transfers.pop("fast")  # finished in time
    conn._fail_slow_reads(worker, 100.0 + conn.pull_timeout_s + 1)
    # Upstream reports it failed (vLLM recomputes); its transfers are not released while one
    # is in flight (a release would not stop it), and its blocks go to the scheduler to pin.
    assert worker._recv_failures == {"slow"} and "slow" not in worker._recving_transfers
    assert worker.nixl_wrapper.released == [] and len(conn.late_reads) == 1
    report = conn.build_connector_worker_meta()
    assert report.given_up == {"slow": ([5, 6], 1)} and report.ended == {}
    assert conn.reads_timed_out == 1 and "fast" not in conn._read_started
    conn._fail_slow_reads(worker, 300.0)
    assert conn.reads_timed_out == 1  # once
    conn.late_reads.poll(worker)
    assert conn.build_connector_worker_meta() is None  # still in flight: nothing new
    worker.nixl_wrapper.states[12] = "DONE"
    conn.late_reads.poll(worker)
    assert worker.nixl_wrapper.released == [11, 12] and len(conn.late_reads) == 0
    assert conn.build_connector_worker_meta().ended == {"slow": 1}
