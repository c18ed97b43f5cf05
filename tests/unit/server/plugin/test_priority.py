"""Agent-aware priority (server/plugin/priority.py): warm before cold, aging, no queue jumping,
bounded state, and the launcher's vLLM flags for it."""

from __future__ import annotations

import pytest

from server.common.env import ENV_PRIORITY_AGING_S
from server.common.priority_code import LEVEL_BOUNDS, LEVELS, TICK_S, encode, level_in, unranked
from server.launcher.cli import WARM_FIRST_SCHEDULER, scheduling_plan
from server.launcher.settings import build_parser
from server.plugin.priority import (
    MAX_CLIENT_LEVELS,
    PriorityPolicy,
    level_of,
    policy_from_env,
    prefix_digests,
    prompt_text,
)

CHAT = "/v1/chat/completions"
TOOLS = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def chat(*contents: str, **extra) -> dict:
    messages = [{"role": "system", "content": "You are an agent. " * 200}]
    for i, text in enumerate(contents):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": text})
    return {"model": "m", "messages": messages, "tools": TOOLS, **extra}


def words(n: int, tag: str) -> str:
    return " ".join(f"{tag}{i}" for i in range(n))


def test_resumed_turn_ranks_ahead_of_a_cold_prefill():
    clock = Clock()
    policy = PriorityPolicy(2.0, clock=clock)
    history = words(3000, "obs")
    first = policy.assign(chat(history), CHAT)
    assert first is not None and first.cached_units == 0 and first.level == len(LEVEL_BOUNDS)
    # The same agent's next turn: its history plus a reply and a short tool output.
    resumed = policy.assign(chat(history, "ok", "short tool output"), CHAT)
    cold = policy.assign(chat(words(3000, "other")), CHAT)
    assert resumed is not None and cold is not None
    assert resumed.cached_units > 0.9 * resumed.prompt_units
    assert resumed.level == 0 and cold.level == len(LEVEL_BOUNDS)
    assert resumed.priority < cold.priority


def test_a_turn_pulling_its_history_from_a_peer_ranks_as_a_resumed_one():
    """An aggregated replica never saw a moved session's prompt (its turns ran elsewhere): the
    history its claimed hold brings counts as cached, the rest as new, never more."""
    policy = PriorityPolicy(2.0, clock=Clock())
    body = chat(words(3000, "obs"), "ok", "short tool output")
    total = policy.assign(dict(body), CHAT, tenant="t-other")
    assert total is not None and total.level == len(LEVEL_BOUNDS)
    held = total.new_tokens - 100  # all but the last ~100 tokens are pulled
    moved = policy.assign(dict(body), CHAT, tenant="t", held_tokens=held)
    cold = policy.assign(chat(words(3000, "other")), CHAT, tenant="t")
    assert moved is not None and cold is not None
    assert moved.new_tokens == 100 and moved.level == 0 and moved.priority < cold.priority
    short = policy.assign(dict(body), CHAT, tenant="u", held_tokens=600)
    assert short is not None and short.new_tokens == total.new_tokens - 600
    assert short.level == level_of(short.new_tokens)
    # More held than the prompt has: nothing left, never negative.
    over = policy.assign(dict(body), CHAT, tenant="v", held_tokens=10**6)
    assert over is not None and over.new_tokens == 0


def test_fork_and_shared_prefix_count_as_cached():
    policy = PriorityPolicy(2.0, clock=Clock())
    history = words(2000, "h")
    policy.assign(chat(history, "answer", "branch a"), CHAT)
    fork = policy.assign(chat(history, "answer", "branch b: try something else"), CHAT)
    assert fork is not None and fork.level == 0


def test_same_length_different_prompt_is_cold():
    """An attacker resends a prompt of the same length with other text: no digest matches."""
    policy = PriorityPolicy(2.0, clock=Clock())
    policy.assign(chat(words(3000, "a")), CHAT)
    fake = policy.assign(chat(words(3000, "b")), CHAT)
    assert fake is not None and fake.level == len(LEVEL_BOUNDS)


def test_client_priority_cannot_jump_the_queue_but_may_go_later():
    clock = Clock()
    policy = PriorityPolicy(2.0, clock=clock)
    cold = chat(words(3000, "x"), priority=-(2**63))
    est = policy.assign(cold, CHAT)
    plain = chat(words(3000, "w"))
    assert est is not None and cold["priority"] == est.priority
    assert policy.assign(plain, CHAT).priority == est.priority  # as if it had sent none
    assert est.priority == encode(clock.now + len(LEVEL_BOUNDS) * 2.0, len(LEVEL_BOUNDS))
    assert level_in(est.priority) == len(LEVEL_BOUNDS)
    late = chat(words(10, "y"), priority=3)
    ref = policy.assign(chat(words(10, "v")), CHAT)
    got = policy.assign(late, CHAT)
    assert got is not None and ref is not None and got.level == ref.level
    assert late["priority"] == ref.priority + LEVELS * round(3 * 2.0 / TICK_S)  # 3 levels later
    assert level_in(late["priority"]) == ref.level  # the work estimate is the plugin's own
    huge = chat(words(10, "u"), priority=2**200)
    policy.assign(huge, CHAT)
    assert huge["priority"] == ref.priority + LEVELS * round(MAX_CLIENT_LEVELS * 2.0 / TICK_S)
    for n, junk in enumerate(("0", True, 1.5, None, 0, -7)):
        body = chat(words(3000, f"z{n}"), priority=junk)
        policy.assign(body, CHAT)
        assert body["priority"] == est.priority


def test_other_tenant_or_salt_does_not_match():
    policy = PriorityPolicy(2.0, clock=Clock())
    history = words(3000, "h")
    policy.assign(chat(history), CHAT, tenant="alice")
    assert policy.assign(chat(history, "ok", "t"), CHAT, tenant="bob").level > 0
    assert policy.assign(chat(history, "ok", "t", cache_salt="s"), CHAT, tenant="alice").level > 0
    assert policy.assign(chat(history, "ok", "t"), CHAT, tenant="alice").level == 0


def test_aging_bounds_how_long_warmer_requests_can_pass():
    clock = Clock()
    policy = PriorityPolicy(2.0, clock=clock)
    policy.assign(chat(words(3000, "warm")), CHAT)
    cold = policy.assign(chat(words(3000, "cold")), CHAT)
    assert cold is not None
    passed_by = []
    for step in range(40):  # warm turns arriving every 0.5 s after the cold one
        clock.now += 0.5
        warm = policy.assign(chat(words(3000, "warm"), "ok", f"turn {step}"), CHAT)
        assert warm is not None and warm.level == 0
        # vLLM: (priority, arrival) — an equal priority arriving later goes after.
        if warm.priority < cold.priority:
            passed_by.append(0.5 * (step + 1))
    # Exactly the warm turns that arrive by the cold one's deadline (3 levels x 2 s).
    assert passed_by == [0.5 * (k + 1) for k in range(12)]
    assert policy.max_wait_s == len(LEVEL_BOUNDS) * 2.0 == 6.0


def test_state_is_bounded_per_tenant_and_in_tenants():
    policy = PriorityPolicy(2.0, max_digests=50, max_tenants=3, clock=Clock())
    for i in range(20):
        policy.assign(chat(words(2000, f"s{i}-")), CHAT, tenant=f"t{i % 5}")
        assert policy.digests_held() <= 3 * 50
    assert len(policy._tenants) == 3
    # The oldest digests are gone: a tenant's early prompt is cold again.
    policy = PriorityPolicy(2.0, max_digests=20, clock=Clock())
    first = words(2000, "first")
    policy.assign(chat(first), CHAT)
    for i in range(5):
        policy.assign(chat(words(2000, f"n{i}-")), CHAT)
    assert policy.assign(chat(first, "ok", "t"), CHAT).level > 0


def test_routes_and_prompts_it_does_not_handle_are_untouched():
    policy = PriorityPolicy(2.0, clock=Clock())
    body = {"model": "m", "messages": [], "priority": -5}
    assert policy.assign(dict(body), "/v1/messages") is None
    several = {"model": "m", "prompt": ["a", "b"], "priority": -5}
    # Not ranked, and the client's own value does not pass through: the coldest, now.
    assert policy.assign(several, "/v1/completions") is None
    assert several["priority"] == unranked(1000.0, 2.0) and level_in(several["priority"]) == 3


def test_token_id_and_text_prompts():
    policy = PriorityPolicy(2.0, clock=Clock())
    ids = list(range(5000))
    first = policy.assign({"model": "m", "prompt": ids}, "/v1/completions")
    assert first is not None and first.new_tokens == 5000
    more = policy.assign({"model": "m", "prompt": ids + [7] * 100}, "/v1/completions")
    assert more is not None and more.new_tokens <= 256 and more.level == 0
    text = policy.assign({"model": "m", "prompt": "x" * 400}, "/v1/completions")
    assert text is not None and text.new_tokens == 100
    assert prompt_text({"input": "hi"}, "/v1/responses") is not None


def test_turn_text_is_a_prefix_of_the_next_turn():
    one, _ = prompt_text(chat("a"), CHAT)
    two, _ = prompt_text(chat("a", "b", "c"), CHAT)
    assert two.startswith(one)
    d1, d2 = prefix_digests("s", one), prefix_digests("s", two)
    assert d1[-2] in d2  # every full chunk of turn 1 is a prefix digest of turn 2


def test_levels():
    assert [level_of(n) for n in (0, 256, 257, 1024, 4096, 4097)] == [0, 0, 1, 1, 2, 3]


def test_policy_from_env(monkeypatch):
    monkeypatch.delenv(ENV_PRIORITY_AGING_S, raising=False)
    assert policy_from_env() is None
    monkeypatch.setenv(ENV_PRIORITY_AGING_S, "junk")
    assert policy_from_env() is None
    monkeypatch.setenv(ENV_PRIORITY_AGING_S, "3")
    policy = policy_from_env()
    assert policy is not None and policy.aging_s == 3.0
    with pytest.raises(ValueError):
        PriorityPolicy(0)


#: The prefill chunk the warm-first scheduler gets when none is given.
CHUNK = ["--long-prefill-token-threshold", "256"]


@pytest.mark.parametrize(
    ("ours", "passthrough", "argv", "aging"),
    [
        # The default: on with the CPU backend (cuda=False here), with the by-need chunk.
        (
            [],
            [],
            ["--scheduling-policy", "priority", *CHUNK, "--scheduler-cls", WARM_FIRST_SCHEDULER],
            8.0,
        ),
        (
            ["--agent-priority"],
            [],
            ["--scheduling-policy", "priority", *CHUNK, "--scheduler-cls", WARM_FIRST_SCHEDULER],
            8.0,
        ),
        (["--agent-priority"], ["--scheduling-policy", "fcfs"], [], None),
        (
            ["--agent-priority"],
            ["--scheduling_policy=priority"],
            [*CHUNK, "--scheduler-cls", WARM_FIRST_SCHEDULER],
            8.0,
        ),
        (["--no-agent-priority"], [], [], None),
        (
            ["--agent-priority", "--cold-prefill-chunk", "0"],
            [],
            ["--scheduling-policy", "priority", "--scheduler-cls", WARM_FIRST_SCHEDULER],
            8.0,
        ),
        (
            ["--no-agent-priority", "--cold-prefill-chunk", "256"],
            [],
            ["--long-prefill-token-threshold", "256"],
            None,
        ),
        (
            ["--no-agent-priority", "--cold-prefill-chunk", "256"],
            ["--long-prefill-token-threshold", "64"],
            [],
            None,
        ),
    ],
)
def test_scheduling_plan(ours, passthrough, argv, aging):
    args = build_parser().parse_args(ours)
    assert scheduling_plan(args, passthrough) == (argv, aging)


def test_warm_first_scheduler_with_the_priority_on_cpu_only():
    args = build_parser().parse_args(["--agent-priority", "--cold-prefill-chunk", "256"])
    argv, _ = scheduling_plan(args, [])
    assert argv[-2:] == ["--scheduler-cls", WARM_FIRST_SCHEDULER]
    assert "--long-prefill-token-threshold" in argv
    assert "--scheduler-cls" not in scheduling_plan(args, [], cuda=True)[0]
    # On CUDA, without the scheduler, no chunk unless asked for (vLLM's static threshold
    # would make cold prefills share every step).
    asked = build_parser().parse_args(["--agent-priority"])
    assert scheduling_plan(asked, [], cuda=True)[0] == ["--scheduling-policy", "priority"]
    assert scheduling_plan(build_parser().parse_args([]), [], cuda=True) == ([], None)
    # Plain vLLM (the baseline) keeps vLLM's own order unless asked.
    assert scheduling_plan(build_parser().parse_args(["--no-connector"]), []) == ([], None)
    # P/D instances keep vLLM's order unless asked (measured no better there: RESULTS.md
    # agent_workload 2026-12-03 08:31 and 09:05).
    for role in ("prefill", "decode"):
        assert scheduling_plan(build_parser().parse_args(["--role", role]), []) == ([], None)
        on = build_parser().parse_args(["--role", role, "--agent-priority"])
        assert scheduling_plan(on, [])[0][-2:] == ["--scheduler-cls", WARM_FIRST_SCHEDULER]
    assert scheduling_plan(build_parser().parse_args(["--role", "single"]), [])[1] == 8.0
    assert "--scheduler-cls" not in scheduling_plan(args, ["--scheduler-cls", "x.Y"])[0]


class Req:
    def __init__(self, priority: int, computed: int, prompt: int) -> None:
        self.priority = priority
        self.num_computed_tokens = computed
        self.num_prompt_tokens = prompt


def test_cap_only_for_warmer_work():
    from server.engine.scheduler import QUALNAME, cap_needed

    assert QUALNAME == WARM_FIRST_SCHEDULER
    cold = Req(10, 512, 4000)
    assert not cap_needed([cold], [])  # alone
    assert not cap_needed([cold], [Req(12, 0, 3000)])  # only colder (or later) work waits
    assert not cap_needed([cold, Req(10, 0, 3000)], [])  # equal: first come, first served
    assert cap_needed([cold], [Req(3, 0, 4100)])  # a resumed turn waits
    assert cap_needed([cold, Req(3, 4100, 4100)], [])  # a warm turn decodes beside it
    assert not cap_needed([Req(3, 4100, 4100)], [Req(1, 0, 50)])  # no prefill running


def test_scheduler_config_threshold_is_assignable():
    from vllm.config import SchedulerConfig

    config = SchedulerConfig(max_model_len=4096, is_encoder_decoder=False)
    config.long_prefill_token_threshold = 0
    config.long_prefill_token_threshold = 256
    assert config.long_prefill_token_threshold == 256


def test_step_limits():
    from vllm.v1.request import RequestStatus

    from server.engine.scheduler import step_limits

    def req(deadline: float, level: int, computed: int, prompt: int, waiting: bool = False):
        r = Req(encode(deadline, level), computed, prompt)
        r.status = RequestStatus.WAITING if waiting else RequestStatus.RUNNING
        return r

    cold, other = req(10, 2, 512, 4000), req(11, 2, 0, 3000, waiting=True)
    warm = req(3, 0, 0, 4100, waiting=True)
    assert step_limits([cold], [], 256, 2048) == (0, 2048)  # alone: vLLM's full step
    # alone, but a turn finished lately (its agent is in a tool call): short steps
    assert step_limits([cold], [], 256, 2048, expecting=True) == (0, 257)
    assert step_limits([], [other], 256, 2048, expecting=True) == (0, 256)
    assert step_limits([req(19, 0, 2000, 3000)], [], 256, 2048, expecting=True) == (0, 2048)
    assert step_limits([cold], [other], 256, 2048) == (0, 257)  # colds: short steps, in order
    assert step_limits([cold], [warm], 256, 2048) == (256, 2048)  # warm waits: cold capped
    decodes = [req(3, 0, 50, 50), req(4, 1, 60, 60)]
    assert step_limits(decodes, [], 256, 2048) == (0, 2048)
    # Colds waiting with nothing running: the first admitted one starts with a short step too.
    assert step_limits([], [other, req(12, 3, 0, 5000, waiting=True)], 256, 2048) == (0, 256)
    assert step_limits(decodes[:1], [other], 256, 2048) == (0, 257)
    assert step_limits([], [other], 256, 2048) == (0, 2048)  # alone
    # Resumed turns only (short prefills, however long their prompts): vLLM's budget, so that
    # several batch into one step.
    resumed = [req(20 + k, 0, 0, 3000, waiting=True) for k in range(3)]
    assert step_limits([req(19, 0, 2000, 3000)], resumed, 256, 2048) == (0, 2048)
    # ... unless bursts are split: then short steps, which the first-ranked fill first.
    decoding = req(19, 0, 3000, 3000)
    assert step_limits([decoding], resumed, 256, 2048, split_bursts=True) == (0, 257)
    assert step_limits([decoding], resumed[:1], 256, 2048, split_bursts=True) == (0, 2048)
    assert step_limits([cold], [warm, resumed[0]], 256, 2048, split_bursts=True) == (256, 257)
