"""The warm-first scheduler's preemption (server/engine/scheduler.py) on vLLM's real ``Scheduler``:
a cold prefill that holds the device blocks is preempted for a warmer waiting request, never
for a colder one, and never while it decodes. Pure rules with small fakes at the end."""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from transformers import LlamaConfig
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from server.common.env import ENV_PAUSE_COLDS, ENV_SPLIT_BURSTS
from server.common.priority_code import encode
from server.engine.scheduler import (
    WarmFirstScheduler,
    blocks_needed,
    colds_to_pause,
    colds_to_queue,
    preemption_victim,
    requests_to_pass,
)

BS = 16
#: Priorities as the plugin encodes them (deadline s, level): a cold 1-4k-token prefill, a
#: resumed turn that arrived later but ranks ahead, colder work, a short prefill ranked behind.
COLD, WARM, COLDER, SHORT = encode(10, 2), encode(3, 0), encode(20, 3), encode(12, 1)
NUM_BLOCKS = 20  # one is vLLM's null block: 19 usable
STEP_TOKENS = 256


@functools.cache
def model_folder() -> Path:
    """A model folder of the tests' own, with a config only: the scheduler reads the model's
    config, never its weights or tokenizer, so these tests need neither the embedded model nor a
    way to skip when it is not built."""
    folder = Path(tempfile.mkdtemp(prefix="kvb-scheduler-model-"))
    atexit.register(shutil.rmtree, folder, True)
    LlamaConfig(
        vocab_size=256,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        max_position_embeddings=1024,
    ).save_pretrained(folder)
    return folder


def make(
    cls: type[Scheduler] = WarmFirstScheduler, policy: str = "priority", chunk: int = 0
) -> Scheduler:
    model = ModelConfig(
        model=str(model_folder()), dtype="float32", max_model_len=1024, skip_tokenizer_init=True
    )
    sched = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=STEP_TOKENS,
        max_model_len=1024,
        enable_chunked_prefill=True,
        policy=policy,
        is_encoder_decoder=False,
        long_prefill_token_threshold=chunk,
    )
    cache = CacheConfig(block_size=BS, enable_prefix_caching=True)
    cache.num_gpu_blocks = NUM_BLOCKS
    config = VllmConfig(model_config=model, scheduler_config=sched, cache_config=cache)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=NUM_BLOCKS,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)],
    )
    return cls(
        vllm_config=config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BS,
    )


def request(
    rid: str,
    tokens: int | list[int],
    priority: int,
    arrival: float,
    first: int = 1,
) -> Request:
    init_none_hash(sha256)
    return Request(
        rid,
        tokens if isinstance(tokens, list) else list(range(first, first + tokens)),
        SamplingParams(max_tokens=4),
        None,
        arrival_time=arrival,
        priority=priority,
        block_hasher=get_request_block_hasher(BS, sha256),
    )


def cold_holding_blocks(sched: Scheduler, prompt: int = 18 * BS) -> Request:
    """A cold prefill after its first step: 16 of the 19 blocks held, still prefilling."""
    cold = request("cold", prompt, priority=COLD, arrival=1.0)
    sched.add_request(cold)
    sched.schedule()
    assert cold.status == RequestStatus.RUNNING
    assert 0 < cold.num_computed_tokens < cold.num_prompt_tokens
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 3
    return cold


def scheduled_ids(output) -> set[str]:
    return set(output.num_scheduled_tokens)


def test_warmer_request_preempts_a_cold_prefill_that_holds_the_blocks():
    sched = make()
    cold = cold_holding_blocks(sched)
    warm = request("warm", 5 * BS, priority=WARM, arrival=2.0, first=1000)
    sched.add_request(warm)
    out = sched.schedule()
    assert "warm" in scheduled_ids(out)
    assert cold.status == RequestStatus.PREEMPTED and cold.num_computed_tokens == 0
    assert "cold" in out.preempted_req_ids
    assert sched.kvb_counters.preemptions == 1
    # vLLM's own scheduler leaves the warm request waiting for blocks in the same state.
    plain = make(Scheduler)
    cold_holding_blocks(plain)
    plain.add_request(request("warm", 5 * BS, priority=WARM, arrival=2.0, first=1000))
    assert "warm" not in scheduled_ids(plain.schedule())


def test_a_colder_or_equal_request_does_not_preempt():
    for priority, arrival in ((COLDER, 2.0), (COLD, 2.0)):
        sched = make()
        cold = cold_holding_blocks(sched)
        sched.add_request(request("later", 5 * BS, priority=priority, arrival=arrival, first=900))
        out = sched.schedule()
        assert "later" not in scheduled_ids(out)
        assert cold.status == RequestStatus.RUNNING and sched.kvb_counters.preemptions == 0


def test_no_preemption_when_the_warm_request_fits():
    sched = make()
    cold = cold_holding_blocks(sched)
    sched.add_request(request("small", BS - 2, priority=WARM, arrival=2.0, first=2000))
    out = sched.schedule()
    assert "small" in scheduled_ids(out)
    assert cold.status == RequestStatus.RUNNING and sched.kvb_counters.preemptions == 0


def test_a_decoding_request_is_not_preempted():
    sched = make()
    cold = request("cold", 15 * BS, priority=COLD, arrival=1.0)
    sched.add_request(cold)
    sched.schedule()  # its whole prompt in one step: it decodes from now on
    assert cold.num_computed_tokens == cold.num_prompt_tokens
    sched.add_request(request("warm", 8 * BS, priority=WARM, arrival=2.0, first=1000))
    sched.schedule()
    assert cold.status == RequestStatus.RUNNING and sched.kvb_counters.preemptions == 0


def test_fcfs_keeps_vllm_rules():
    sched = make(policy="fcfs")
    cold = request("cold", 18 * BS, priority=0, arrival=1.0)
    sched.add_request(cold)
    sched.schedule()
    sched.add_request(request("warm", 5 * BS, priority=0, arrival=2.0, first=1000))
    sched.schedule()
    assert cold.status == RequestStatus.RUNNING and sched.kvb_counters.preemptions == 0


def fake(priority: int, computed: int, prompt: int, arrival: float = 0.0, tokens: int = 0):
    return SimpleNamespace(
        priority=priority,
        arrival_time=arrival,
        num_computed_tokens=computed,
        num_prompt_tokens=prompt,
        num_tokens=tokens or prompt,
        status=RequestStatus.RUNNING,
    )


def test_victim_is_the_worst_ranked_long_prefill_behind_the_head():
    head = fake(WARM, 0, 100, arrival=5.0)
    a, b = fake(COLD, 10, 900, arrival=1.0), fake(COLD, 10, 900, arrival=2.0)
    decoding = fake(COLDER, 900, 900)
    ahead = fake(encode(1, 2), 10, 900)
    assert preemption_victim([a, b, decoding, ahead], head) is b  # same priority: the later
    assert preemption_victim([decoding, ahead], head) is None
    assert preemption_victim([fake(WARM, 10, 900, arrival=6.0)], head) is None  # short
    assert preemption_victim([fake(SHORT, 10, 900, arrival=6.0)], head) is None  # short
    assert preemption_victim([fake(COLDER, 10, 9000)], head) is not None


def test_a_short_prefill_is_not_preempted():
    """Resumed turns are never preempted for each other, whatever their rank."""
    sched = make()
    short = request("short", 18 * BS, priority=SHORT, arrival=1.0)
    sched.add_request(short)
    sched.schedule()
    assert 0 < short.num_computed_tokens < short.num_prompt_tokens
    sched.add_request(request("warm", 5 * BS, priority=WARM, arrival=2.0, first=1000))
    sched.schedule()
    assert short.status == RequestStatus.RUNNING and sched.kvb_counters.preemptions == 0


def test_blocks_needed_covers_the_prompt_and_the_first_token():
    assert blocks_needed(fake(0, 0, 128), 128) == 2
    assert blocks_needed(fake(0, 0, 127), 128) == 1


def test_an_unranked_request_ranks_coldest_not_first():
    """Priority 0 (a route whose vLLM body has no ``priority``, e.g. /v1/messages) would be
    vLLM's first place: it ranks as the coldest request arriving now instead."""
    from server.common.priority_code import COLDEST, encode, level_in

    sched = make()
    cold = cold_holding_blocks(sched)
    now = time.monotonic()
    cold.priority = encode(now + 1.0, COLDEST)  # a ranked cold that arrived a moment ago
    unranked = request("unranked", 5 * BS, priority=0, arrival=2.0, first=1000)
    sched.add_request(unranked)
    assert level_in(unranked.priority) == COLDEST and unranked.priority > cold.priority
    sched.schedule()
    assert cold.status == RequestStatus.RUNNING and sched.kvb_counters.preemptions == 0


# --- backfill: a request that fits is admitted past one that does not ----------------------


def branch_decoding(sched: Scheduler) -> Request:
    """A forked branch running: a 13-block prompt in one step, decoding from then on; it holds
    13 of the 19 blocks (the slot of its first output token comes with the next step)."""
    branch = request("branch", 13 * BS, priority=SHORT, arrival=time.time() - 1)
    sched.add_request(branch)
    sched.schedule()
    assert branch.num_computed_tokens == branch.num_prompt_tokens
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == 6
    return branch


def sibling(arrival: float) -> Request:
    """The other branch of the same fork: the first 12 blocks shared, 2 of its own."""
    tokens = list(range(1, 12 * BS + 1)) + list(range(5000, 5000 + 2 * BS))
    return request("sibling", tokens, priority=SHORT + 4 * 100, arrival=arrival)


def test_a_sibling_branch_that_fits_is_admitted_past_a_head_that_does_not():
    now = time.time()
    sched = make()
    branch_decoding(sched)
    head = request("head", 8 * BS, priority=WARM, arrival=now, first=3000)  # 9 blocks > 6
    sched.add_request(head)
    sched.add_request(sibling(now + 0.1))
    assert sched.waiting.peek_request() is head
    out = sched.schedule()
    assert "sibling" in scheduled_ids(out) and "head" not in scheduled_ids(out)
    assert head.status == RequestStatus.WAITING and sched.waiting.peek_request() is head
    assert sched.kvb_counters.backfills == 1 and sched.kvb_counters.preemptions == 0
    # vLLM's own priority scheduler stops at the head: the sibling waits with it.
    plain = make(Scheduler)
    branch_decoding(plain)
    plain.add_request(request("head", 8 * BS, priority=WARM, arrival=now, first=3000))
    plain.add_request(sibling(now + 0.1))
    assert "sibling" not in scheduled_ids(plain.schedule())


def test_a_request_waiting_longer_than_the_aging_is_not_passed():
    """...by a request that shares nothing (a sibling may still pass it, twice: below)."""
    sched = make()
    branch_decoding(sched)
    overdue = time.time() - sched._kvb_aging_s - 1
    sched.add_request(request("head", 8 * BS, priority=WARM, arrival=overdue, first=3000))
    sched.add_request(
        request("other", 2 * BS, priority=SHORT + 400, arrival=time.time(), first=7000)
    )
    assert "other" not in scheduled_ids(sched.schedule())
    assert sched.kvb_counters.backfills == 0


def test_no_backfill_under_fcfs():
    sched = make(policy="fcfs")
    branch = request("branch", 13 * BS, priority=0, arrival=time.time() - 1)
    sched.add_request(branch)
    sched.schedule()
    sched.add_request(request("head", 8 * BS, priority=0, arrival=time.time(), first=3000))
    sib = sibling(time.time() + 0.1)
    sib.priority = 0
    sched.add_request(sib)
    assert "sibling" not in scheduled_ids(sched.schedule())


def waiting_fake(rid: str, need: int, priority: int, arrival: float, computed: int = 0):
    request = fake(priority, computed, 900, arrival=arrival)
    request.request_id, request.need, request.status = rid, need, RequestStatus.WAITING
    return request


def passes(
    waiting, free: int = 5, now: float = 10.0, lookahead: int = 16, late_left: int = 0
) -> set[str]:
    passed, late = requests_to_pass(
        waiting, fake_assess, free, now, 8.0, lookahead, lambda r: late_left
    )
    assert late <= passed
    return passed


def fake_assess(request, admitted) -> tuple[int, bool]:
    """The fakes carry their net blocks (``need``) and whether they are a sibling (``pairs``)."""
    return request.need, getattr(request, "pairs", False)


def test_requests_to_pass_rules():
    head = waiting_fake("head", 9, WARM, arrival=9.0)
    second = waiting_fake("second", 7, WARM, arrival=9.5)
    fits = waiting_fake("fits", 3, SHORT, arrival=9.8)
    assert passes([head, second, fits]) == {"head", "second"}
    assert passes([fits, head]) == set()  # the head fits, the one behind fits nothing after it
    assert passes([head, second]) == set()  # nothing fits: nothing to pass for
    assert passes([head, second, fits], lookahead=2) == set()
    overdue = waiting_fake("overdue", 9, WARM, arrival=1.0)  # waited 9 s > 8 s
    assert passes([overdue, fits]) == set()
    assert passes([head, overdue, fits]) == set()  # cannot pass the overdue one either
    cold_fits = waiting_fake("cold", 3, COLD, arrival=9.8)  # a long prefill: never backfilled
    assert passes([head, cold_fits, fits]) == set()
    blocked = waiting_fake("grammar", 3, SHORT, arrival=9.8)
    blocked.status = RequestStatus.WAITING_FOR_STRUCTURED_OUTPUT_GRAMMAR
    assert passes([head, blocked, fits]) == set()  # vLLM skips those itself


def test_admissions_ahead_count_and_a_late_pass_is_only_for_a_sibling():
    """The blocks admitted requests take come off the free ones; a request that waited longer
    than the aging is passed only for a fork's sibling (``pairs``), within its late passes."""
    first = waiting_fake("first", 4, WARM, arrival=9.0)
    big = waiting_fake("big", 9, WARM, arrival=9.5)
    two = waiting_fake("two", 2, SHORT, arrival=9.8)
    assert passes([first, big, two]) == set()  # 5 - 4 = 1 block left: 2 do not fit
    assert passes([first, big, two], free=6) == {"big"}  # admitted behind the first
    overdue = waiting_fake("overdue", 9, WARM, arrival=1.0)
    assert passes([first, overdue, two], free=6, late_left=2) == set()  # not a sibling
    two.pairs = True
    assert passes([first, overdue, two], free=6, late_left=2) == {"overdue"}
    assert passes([first, overdue, two], free=6, late_left=0) == set()  # its passes are spent
    passed, late = requests_to_pass(
        [first, overdue, two], fake_assess, 6, 10.0, 8.0, 16, lambda r: 1
    )
    assert passed == late == {"overdue"}


def test_a_sibling_is_admitted_beside_its_branch_past_a_head_that_waited_long():
    """Both branches of a fork waiting: the one admitted first holds the shared history, so
    its sibling fits beside it even past a long-waiting request that does not fit (a late pass,
    at most MAX_LATE_PASSES times per request). vLLM's own scheduler admits only the first."""
    from server.engine.scheduler import MAX_LATE_PASSES

    long_ago = time.time() - 60

    def fork_waiting(sched: Scheduler) -> Request:
        """A branch, a long-waiting head (9 blocks: 6 are left beside the branch), the sibling."""
        sched.add_request(request("branch", 13 * BS, priority=SHORT, arrival=long_ago))
        head = request("head", 8 * BS, priority=SHORT + 100, arrival=long_ago + 1, first=3000)
        sched.add_request(head)
        sched.add_request(sibling(long_ago + 2))
        return head

    for cls in (WarmFirstScheduler, Scheduler):
        sched = make(cls)
        head = fork_waiting(sched)
        ids = scheduled_ids(sched.schedule())
        assert "branch" in ids and "head" not in ids
        assert ("sibling" in ids) is (cls is WarmFirstScheduler)
        assert head.status == RequestStatus.WAITING
    spent = make()
    spent._kvb_late_passes["head"] = MAX_LATE_PASSES  # its late passes are spent
    fork_waiting(spent)
    assert "sibling" not in scheduled_ids(spent.schedule())


def test_two_colds_sharing_a_prompt_go_one_after_the_other_and_share_its_blocks():
    """With warmer work running every prefill is capped and the step keeps its budget; a cold
    prefill waiting behind a running one is not admitted beside it (vLLM's scheduler would
    admit it and both would compute their common tools prompt). When the first has prefilled,
    the second is admitted and finds the shared blocks cached."""
    tools = list(range(1, 1 + 8 * BS))  # the common part: 8 blocks

    def run(cls: type[Scheduler]) -> tuple[int, int]:
        sched = make(cls, chunk=2 * BS)
        warm = request("warm", BS, priority=WARM, arrival=0.5, first=900)
        first = request("first", tools + list(range(500, 500 + 2 * BS)), COLD, arrival=1.0)
        second = request("second", tools + list(range(700, 700 + 2 * BS)), encode(11, 2), 2.0)
        for r in (warm, first, second):
            sched.add_request(r)
        beside = computed = 0  # steps with both colds scheduled; the second's tokens computed
        for _ in range(20):
            out = sched.schedule()
            beside += {"first", "second"} <= scheduled_ids(out)
            computed += out.num_scheduled_tokens.get("second", 0)
            if second.num_computed_tokens >= second.num_prompt_tokens:
                break
        assert second.num_computed_tokens >= second.num_prompt_tokens
        return beside, second.num_prompt_tokens - computed

    beside, hit = run(WarmFirstScheduler)
    assert beside == 0
    assert hit >= 8 * BS  # the tools prompt came from the first's blocks
    beside_vllm, hit_vllm = run(Scheduler)
    assert beside_vllm > 0 and hit_vllm < 8 * BS  # what vLLM's own scheduler does


def test_colds_to_queue_rule():
    running_long = fake(COLD, 64, 2000, arrival=1.0)
    later = waiting_fake("later", 40, encode(20, 2), arrival=3.0)
    later.num_computed_tokens, later.num_prompt_tokens = 0, 2000
    earlier = waiting_fake("earlier", 40, encode(5, 2), arrival=0.5)  # e.g. preempted for warm
    earlier.num_computed_tokens, earlier.num_prompt_tokens = 0, 2000
    short = waiting_fake("short", 2, WARM, arrival=4.0)
    assert colds_to_queue([running_long], [short, later]) == {"later"}
    assert colds_to_queue([running_long], [earlier, later]) == {"later"}
    assert colds_to_queue([], [earlier, later]) == {"later"}  # behind the one admitted first
    assert colds_to_queue([fake(WARM, 10, 10)], [short]) == set()


def test_a_lone_cold_runs_short_steps_only_while_an_agent_may_be_back():
    """A cold prefill alone on an idle server takes vLLM's whole step; once a turn has finished
    lately (its agent is likely in a tool call), the same cold runs short steps, so the agent's
    next turn waits one short step for it, not a whole one."""
    chunk = 64
    idle = make(chunk=chunk)
    idle.add_request(request("cold", 18 * BS, priority=COLD, arrival=1.0))
    assert idle.schedule().num_scheduled_tokens["cold"] == STEP_TOKENS

    busy = make(chunk=chunk)
    busy.add_request(request("turn", 2 * BS, priority=WARM, arrival=0.5, first=500))
    busy.schedule()
    busy.finish_requests("turn", RequestStatus.FINISHED_STOPPED)
    busy.add_request(request("cold", 18 * BS, priority=COLD, arrival=1.0))
    assert busy.schedule().num_scheduled_tokens["cold"] == chunk


def test_a_resumed_turn_starts_in_a_step_without_the_cold_chunks(monkeypatch):
    """A running cold prefill sits out the step in which a resumed turn that outranks it
    starts (so the turn's first token does not wait for someone else's chunk), and only that
    step; with ``KVBRANCH_PAUSE_COLDS=0`` (or vLLM's scheduler) both share the step."""

    def starting_step(pause: bool):
        monkeypatch.setenv(ENV_PAUSE_COLDS, "1" if pause else "0")
        sched = make(chunk=2 * BS)
        cold = cold_holding_blocks(sched)
        sched.add_request(request("warm", BS - 2, priority=WARM, arrival=2.0, first=2000))
        return sched, cold, sched.schedule()

    sched, cold, out = starting_step(pause=True)
    assert scheduled_ids(out) == {"warm"}
    assert sched.kvb_counters.paused_steps == 1
    after = sched.schedule()  # the turn decodes: the cold goes on
    assert "cold" in scheduled_ids(after) and cold.status == RequestStatus.RUNNING
    assert sched.kvb_counters.paused_steps == 1 and sched.kvb_counters.preemptions == 0
    _, _, out = starting_step(pause=False)
    assert scheduled_ids(out) == {"warm", "cold"}


def test_a_cold_is_not_paused_for_a_turn_vllm_will_not_admit(monkeypatch):
    """No room for another running request (vLLM's admission bound): the resumed turn waits,
    and the cold prefill goes on instead of sitting out a step for nothing."""
    monkeypatch.setenv(ENV_PAUSE_COLDS, "1")
    sched = make(chunk=2 * BS)
    cold_holding_blocks(sched)
    sched.max_num_active_reqs = 1
    sched.add_request(request("warm", BS - 2, priority=WARM, arrival=2.0, first=2000))
    assert scheduled_ids(sched.schedule()) == {"cold"}
    assert sched.kvb_counters.paused_steps == 0


def test_colds_to_pause_rule():
    cold = fake(COLD, 64, 2000, arrival=1.0)
    colder = fake(COLDER, 64, 2000, arrival=0.5)
    decoding = fake(COLD, 2000, 2000, arrival=1.0)
    warm = waiting_fake("warm", 2, WARM, arrival=4.0)
    warm.num_prompt_tokens = 100
    fits, full = (lambda r: True), (lambda r: False)
    assert colds_to_pause([cold, colder, decoding], [warm], fits) == [cold, colder]
    assert colds_to_pause([cold], [warm], full) == []  # it would not be admitted this step
    assert colds_to_pause([cold], [], fits) == []
    # The head of the queue is another cold: vLLM admits (or stops at) it first.
    waiting_cold = waiting_fake("waiting-cold", 40, encode(1, 2), arrival=0.2)
    waiting_cold.num_prompt_tokens = 2000
    assert colds_to_pause([cold], [waiting_cold, warm], fits) == []
    # A short prefill ranked behind the cold does not pause it; one ranked ahead, running, does.
    assert colds_to_pause([cold], [waiting_fake("short", 2, SHORT, 4.0)], fits) == []
    running_warm = fake(WARM, 10, 200, arrival=4.0)
    assert colds_to_pause([cold, running_warm], [], full) == [cold]


def test_a_burst_of_resumed_turns_runs_in_rank_order_small_ones_still_together(monkeypatch):
    """Several resumed turns ready at once: with vLLM's budget they share one long step and all
    get their first token at its end; split, the first-ranked is computed first in a short
    step (the chunk), and turns small enough still share one."""

    def first_step(split: bool, tokens: int) -> tuple[dict[str, int], list[Request]]:
        monkeypatch.setenv(ENV_SPLIT_BURSTS, "1" if split else "0")
        sched = make(chunk=2 * BS)
        turns = [
            request(f"turn{k}", tokens, encode(3 + k, 0), arrival=1.0 + k, first=100 * (k + 1))
            for k in range(3)
        ]
        for turn in turns:
            sched.add_request(turn)
        return sched.schedule().num_scheduled_tokens, turns

    scheduled, turns = first_step(split=True, tokens=BS + 8)
    assert scheduled["turn0"] == BS + 8 and turns[0].num_computed_tokens == BS + 8
    assert "turn2" not in scheduled  # the budget (one chunk) went to the better-ranked first
    scheduled, _ = first_step(split=False, tokens=BS + 8)
    assert scheduled == {"turn0": BS + 8, "turn1": BS + 8, "turn2": BS + 8}
    scheduled, _ = first_step(split=True, tokens=8)  # small turns: one step for all three
    assert scheduled == {"turn0": 8, "turn1": 8, "turn2": 8}
