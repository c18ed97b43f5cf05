"""Issue 22: the host store never serves KV a request must not read — prompt logprobs (vLLM
computes every prompt position for them), and KV of weights or adapters that changed since —
driven through the real scheduler side and planner with small fake requests."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from vllm.sampling_params import SamplingParams

from server.connector.config import ConnectorConfig
from server.connector.core.planner import BRANCH_XARG
from server.connector.core.sessions import DEFAULT_BRANCH
from server.connector.core.tails import identity_of
from server.connector.engine.scheduler_side import KVBranchScheduler
from server.engine import weight_changes as engine_changes
from tests.unit.server.connector.fakes import BS, FakeRequest


def make_side(num_slots: int = 64) -> KVBranchScheduler:
    return KVBranchScheduler(
        block_size=BS,
        block_bytes=1,
        num_slots=num_slots,
        enabled=True,
        config=ConnectorConfig(host_store_bytes=num_slots, pin_budget_bytes=32),
    )


HISTORY = list(range(1, 11))  # blocks [1-4] [5-8], then 9, 10
REPLY = [50, 51]


def run_turn(side: KVBranchScheduler, rid: str, prompt: list[int], output: list[int], **kw):
    """A finished request of session ``s`` (branch ``kw['branch']``): blocks saved, tail
    copied out."""
    tokens = prompt + output
    xargs = {BRANCH_XARG: kw["branch"]} if kw.get("branch") else None
    req = FakeRequest(
        rid,
        tokens,
        len(prompt),
        num_computed_tokens=len(tokens) - 1,
        session_id="s",
        sampling_params=SimpleNamespace(extra_args=xargs),
    )
    planner = side.planner
    planner.on_new_request(req)
    blocks = list(range(100, 100 + -(-len(tokens) // BS)))
    req.num_computed_tokens = 0
    planner.plan_saves({rid: len(tokens) - 1}, lambda _: [blocks], set())
    req.num_computed_tokens = len(tokens) - 1
    side.request_finished(req, blocks)
    planner.plan_tail_saves(set())
    return req


def logprob_params(**extra: Any) -> SamplingParams:
    """What vLLM builds for ``prompt_logprobs`` (and for ``echo`` + ``logprobs``)."""
    return SamplingParams(prompt_logprobs=1, max_tokens=1, extra_args=extra or None)


# --- 1. prompt logprobs: nothing from outside ---------------------------------------------------
def test_vllm_marks_prompt_logprob_requests_to_skip_the_prefix_cache():
    assert logprob_params().skip_reading_prefix_cache is True
    assert SamplingParams(max_tokens=1).skip_reading_prefix_cache is False


def test_prompt_logprobs_get_no_host_blocks_and_no_tail():
    side = make_side()
    run_turn(side, "t1", HISTORY, REPLY)
    prompt = HISTORY + REPLY + [60, 61, 62]
    plain = FakeRequest("p", prompt, len(prompt))
    side.planner.on_new_request(plain)
    # The control: blocks 0-1 from the store, then the tail's 9, 10, 50, 51... (capped).
    assert side.num_new_matched_tokens(plain, 0) > 2 * BS
    logp = FakeRequest("lp", prompt, len(prompt), sampling_params=logprob_params())
    side.planner.on_new_request(logp)
    assert side.num_new_matched_tokens(logp, 0) == 0
    side.planner.after_alloc(logp, [], 0)
    assert side.planner.pending_loads == []
    split = side.planner.plans["lp"].split
    assert split["host_hit_tokens"] == 0 and split["recomputed_tokens"] == len(prompt)


def test_prompt_logprobs_get_no_tail_alone():
    """A prompt inside the first block: only the tail could match."""
    side = make_side()
    run_turn(side, "t1", [1, 2], [3, 4])  # tail (1, 2, 3) at token 0
    prompt = [1, 2, 3, 9]
    plain = FakeRequest("p", prompt, len(prompt))
    side.planner.on_new_request(plain)
    assert side.num_new_matched_tokens(plain, 0) == 3
    logp = FakeRequest("lp", prompt, len(prompt), sampling_params=logprob_params())
    side.planner.on_new_request(logp)
    assert side.num_new_matched_tokens(logp, 0) == 0


def test_prompt_logprobs_in_a_fork_get_nothing_either():
    side = make_side()
    run_turn(side, "t1", HISTORY, REPLY)
    side.planner.registry.fork("s", DEFAULT_BRANCH, "alt", token_offset=10)
    prompt = HISTORY + [70, 71]
    logp = FakeRequest(
        "lp",
        prompt,
        len(prompt),
        session_id="s",
        sampling_params=logprob_params(**{BRANCH_XARG: "alt"}),
    )
    side.planner.on_new_request(logp)
    assert side.num_new_matched_tokens(logp, 0) == 0


def test_requests_vllm_marks_skip_reading_get_nothing():
    """Pooling with all-token pooling: vLLM's ``Request.skip_reading_prefix_cache``."""
    side = make_side()
    run_turn(side, "t1", HISTORY, REPLY)
    req = FakeRequest("pool", HISTORY + REPLY, 12)
    req.skip_reading_prefix_cache = True  # type: ignore[attr-defined]
    side.planner.on_new_request(req)
    assert side.num_new_matched_tokens(req, 0) == 0


# --- 2. a reset forgets pins and tails; weight and adapter changes reset ------------------------
def test_reset_external_forgets_pinned_blocks_tails_and_pins():
    side = make_side()
    run_turn(side, "t1", HISTORY, REPLY)
    planner, index, reg = side.planner, side.planner.index, side.planner.registry
    branch = reg.get_branch("s", DEFAULT_BRANCH)
    assert branch.pinned and index.pinned_stored_slots == 3  # 2 blocks + the tail
    assert side.reset_cache() is True
    assert index.used_slots == 0 and index.pinned_stored_slots == 0
    assert index.pinned_hashes == 0
    # The session stays, with its tokens (for prefetch), unpinned: its KV went.
    branch = reg.get_branch("s", DEFAULT_BRANCH)
    assert branch.token_ids == HISTORY + REPLY and not branch.pinned
    req = FakeRequest("again", HISTORY + REPLY + [7], 13)
    planner.on_new_request(req)
    assert side.num_new_matched_tokens(req, 0) == 0
    # The next request of the branch stores and pins again.
    run_turn(side, "t2", HISTORY + REPLY + [7], [8, 9])
    assert reg.get_branch("s", DEFAULT_BRANCH).pinned and index.pinned_stored_slots > 0


def test_reset_store_op_is_the_same_full_reset():
    side = make_side()
    run_turn(side, "t1", HISTORY, REPLY)
    assert side.handle_control({"op": "reset_store"}) == {"dropped_blocks": 3}
    assert side.planner.index.used_slots == 0


def test_running_requests_save_nothing_after_a_reset_until_restarted():
    side = make_side()
    planner = side.planner
    req = FakeRequest("r", HISTORY + REPLY, 10)
    planner.on_new_request(req)
    side.num_new_matched_tokens(req, 0)
    planner.after_alloc(req, [], 0)
    side.reset_cache()
    req.num_computed_tokens = 0
    assert planner.plan_saves({"r": 10}, lambda _: [[1, 2, 3]], set()) == []
    # vLLM restarts it from token 0 (preempted by the reset): its KV is fresh again.
    side.num_new_matched_tokens(req, 0)
    assert len(planner.plan_saves({"r": 10}, lambda _: [[1, 2, 3]], set())) == 2


def test_a_tail_waiting_for_its_copy_is_dropped_by_a_reset_but_reported_done():
    side = make_side()
    planner = side.planner
    req = FakeRequest("r", HISTORY + REPLY, 10, num_computed_tokens=11)
    planner.on_new_request(req)
    _, delay = planner.finish(req, [1, 2, 3])
    assert delay
    side.reset_cache()
    saves, done = planner.plan_tail_saves(set())
    assert saves == [] and done == ["r"]
    assert planner.index.used_slots == 0


def test_tail_identity_includes_the_lora_path():
    a = SimpleNamespace(lora_request=SimpleNamespace(lora_name="x", lora_path="/a"))
    b = SimpleNamespace(lora_request=SimpleNamespace(lora_name="x", lora_path="/b"))
    assert identity_of(a) != identity_of(b)


class FakeCore:
    """The parts of vLLM's ``EngineCore`` that ``engine_changes`` wraps."""

    def __init__(self) -> None:
        self.resets = 0
        self.loras: set[int] = set()
        core = self

        class Sched:
            def reset_connector_cache(self) -> bool:
                core.resets += 1
                return True

        self.scheduler = Sched()

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        return [None]

    def add_lora(self, lora_request) -> bool:
        self.loras.add(lora_request.lora_int_id)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self.loras.discard(lora_id)
        return True

    def list_loras(self) -> set[int]:
        return set(self.loras)


def test_engine_changes_reset_the_store_after_weight_and_adapter_changes():
    cls = type("Core", (FakeCore,), {})
    assert engine_changes.install(cls) and engine_changes.install(cls)  # idempotent
    core = cls()
    core.collective_rpc("compute_weight_checksums")
    assert core.resets == 0
    core.collective_rpc("reload_weights")
    assert core.resets == 1
    core.collective_rpc("update_weights", None, (), {"update_info": {}})
    core.collective_rpc("finish_weight_update")
    assert core.resets == 3
    lora = SimpleNamespace(lora_name="x", lora_int_id=1, lora_path="/a", load_inplace=False)
    core.add_lora(lora)  # a new adapter: its keys are new, nothing stored is stale
    assert core.resets == 3
    core.add_lora(lora)  # the same id again: a reload
    assert core.resets == 4
    core.add_lora(SimpleNamespace(lora_name="y", lora_int_id=2, lora_path="/b", load_inplace=True))
    assert core.resets == 5
    core.remove_lora(1)
    assert core.resets == 6


def test_engine_changes_patch_vllm_engine_core():
    from vllm.v1.engine.core import EngineCore

    assert engine_changes.install()
    for name in ("collective_rpc", "add_lora", "remove_lora"):
        assert getattr(getattr(EngineCore, name), "_kvbranch_engine_changes", False)


def test_the_scheduler_side_resets_through_vllms_connector_hook():
    """``Scheduler.reset_connector_cache`` calls the connector's ``reset_cache``: ours."""
    side = make_side()
    run_turn(side, "t1", HISTORY, REPLY)
    sched = SimpleNamespace(
        connector=SimpleNamespace(reset_cache=side.reset_cache), log_stats=False
    )
    from vllm.v1.core.sched.scheduler import Scheduler

    assert Scheduler.reset_connector_cache(sched) is True  # type: ignore[arg-type]
    assert side.planner.index.used_slots == 0
