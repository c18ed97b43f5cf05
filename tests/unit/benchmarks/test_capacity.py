"""The capacity sweep's rules, on hand-made numbers: who replays what, the SLO from the turns run
alone, one count's percentiles and totals, the stop rule, the capacity it reports, the
token-identity check and the records (pure logic: no server, no clock)."""

from __future__ import annotations

import math

import pytest

from benchmarks.capacity import sweep
from benchmarks.capacity.sweep import StepSummary, Turn
from benchmarks.traces import Conversation, Step


def _turn(step: int, ttft: float, conv: str = "c", copy: int = 0, answer: str = "a", **kw) -> Turn:
    base = dict(
        agent=0,
        conv=conv,
        copy=copy,
        step=step,
        ttft_s=ttft,
        total_s=ttft + 1,
        prompt_tokens=100,
        completion_tokens=8,
        recomputed_tokens=10,
        answer=answer,
    )
    base.update(kw)
    return Turn(**base)


def _summary(agents: int, p90: float, slo: float = 1.0) -> StepSummary:
    turns = [_turn(1, p90)]
    return sweep.summarize(agents, turns, wall_s=1.0, slo_s=slo)


def _convs(n: int) -> list[Conversation]:
    return [Conversation(f"c{i}", (Step({"prompt": [1]}, 1),)) for i in range(n)]


# --- who replays what -----------------------------------------------------------------------------
def test_assign_gives_each_agent_its_own_conversations_and_new_copies_past_the_pool() -> None:
    got = sweep.assign(_convs(3), agents=2, per_agent=2)
    assert got == [[(0, 0), (2, 0)], [(1, 0), (0, 1)]]
    flat = [item for agent in sweep.assign(_convs(5), agents=4, per_agent=3) for item in agent]
    assert len(flat) == len(set(flat)) == 12  # no two agents replay the same copy


def test_assign_refuses_an_empty_sweep() -> None:
    with pytest.raises(ValueError):
        sweep.assign(_convs(2), agents=0, per_agent=1)
    with pytest.raises(ValueError):
        sweep.assign([], agents=1, per_agent=1)


# --- the SLO --------------------------------------------------------------------------------------
def test_slo_is_the_multiple_of_the_median_resumed_turn_alone() -> None:
    ref, slo = sweep.slo_from_alone([0.3, 0.1, 0.2, 5.0], 4.0)
    assert ref == pytest.approx(0.25)
    assert slo == pytest.approx(1.0)


def test_slo_needs_a_reference_and_a_positive_multiple() -> None:
    with pytest.raises(ValueError):
        sweep.slo_from_alone([], 4.0)
    with pytest.raises(ValueError):
        sweep.slo_from_alone([0.2], 0.0)


# --- one count ------------------------------------------------------------------------------------
def test_summarize_splits_resumed_from_cold_and_takes_percentiles() -> None:
    turns = [_turn(0, 9.0), _turn(0, 7.0)] + [_turn(1, float(i)) for i in range(1, 11)]
    s = sweep.summarize(4, turns, wall_s=2.0, slo_s=9.5)
    assert (s.resumed_n, s.cold_n) == (10, 2)
    assert s.resumed_p50 == pytest.approx(5.5)
    assert s.resumed_p90 == pytest.approx(9.1)
    assert s.resumed_p99 == pytest.approx(9.91)
    assert s.cold_p50 == pytest.approx(8.0)
    assert s.output_tps == pytest.approx(12 * 8 / 2.0)
    assert s.requests_per_s == pytest.approx(6.0)
    assert (s.recomputed_tokens, s.prompt_tokens) == (120, 1200)
    assert s.meets_slo


def test_a_count_meets_the_slo_at_the_bound_and_not_past_it_nor_without_resumed_turns() -> None:
    assert sweep.meets(1.0, 1.0)
    assert not sweep.meets(1.0001, 1.0)
    assert not sweep.meets(math.nan, 1.0)
    only_cold = sweep.summarize(1, [_turn(0, 0.1)], wall_s=1.0, slo_s=5.0)
    assert not only_cold.meets_slo


# --- stop rule and capacity -----------------------------------------------------------------------
def test_the_sweep_goes_on_while_every_count_meets_and_stops_at_the_first_that_fails() -> None:
    done = [_summary(1, 0.2), _summary(2, 0.5)]
    assert not sweep.should_stop(done)
    done.append(_summary(4, 1.5))
    assert sweep.should_stop(done)


def test_capacity_is_the_largest_count_before_the_first_failure() -> None:
    assert sweep.capacity([_summary(1, 0.2), _summary(2, 0.9), _summary(4, 1.2)]) == 2
    # a noisy pass above a failure does not count: the curve has already crossed the SLO
    assert sweep.capacity([_summary(1, 0.2), _summary(2, 1.2), _summary(4, 0.9)]) == 1
    assert sweep.capacity([_summary(1, 3.0)]) == 0
    assert sweep.capacity([_summary(4, 0.1), _summary(1, 0.1), _summary(2, 0.1)]) == 4


# --- token identity -------------------------------------------------------------------------------
def test_answers_compare_by_inputs_only_where_both_configurations_ran() -> None:
    plain = [_turn(0, 1, answer="x"), _turn(1, 1, answer="y"), _turn(1, 1, copy=1, answer="z")]
    kvb = [_turn(0, 1, answer="x"), _turn(1, 1, answer="Y"), _turn(2, 1, answer="w")]
    assert sweep.compare_answers(kvb, plain) == (1, 2)


# --- records --------------------------------------------------------------------------------------
def test_records_carry_the_slo_every_count_and_the_capacity_ratio_target() -> None:
    summaries = {
        "kvbranch": [_summary(1, 0.2), _summary(2, 0.4), _summary(4, 2.0)],
        "plain": [_summary(1, 0.5), _summary(2, 3.0)],
    }
    recs = sweep.build_records(
        "bfcl", summaries, 1.0, 0.25, 4.0, {"kvbranch": {1: (2, 2), 2: (1, 2)}}
    )
    by = {(r.config, r.metric): r for r in recs}
    slo = by[("all", "bfcl SLO: resumed p90 TTFT")]
    assert slo.value == 1.0 and "4x" in slo.note
    p90 = by[("kvbranch", "bfcl agents=4 resumed TTFT p90")]
    assert p90.value == 2.0 and p90.met is False
    assert by[("kvbranch", "bfcl agents=2 resumed TTFT p90")].met is True
    same = by[("kvbranch", "bfcl agents=2 answers identical to plain")]
    assert same.value == 0.5 and same.met is False
    assert by[("kvbranch", "bfcl agents=1 answers identical to plain")].met is True
    cap = by[("kvbranch", "bfcl capacity at the SLO")]
    assert cap.value == 2 and cap.met is False and ">= 10x" in cap.target
    assert by[("plain", "bfcl capacity at the SLO")].value == 1
    assert "lower bound" not in cap.note
    for metric in ("cold TTFT p99", "output throughput", "recomputed prompt tokens"):
        assert ("plain", f"bfcl agents=2 {metric}") in by


def test_a_sweep_that_never_failed_reports_a_lower_bound() -> None:
    done = [_summary(1, 0.2), _summary(2, 0.4)]
    assert sweep.lower_bound(done) and not sweep.lower_bound([*done, _summary(4, 2.0)])
    recs = sweep.build_records("bfcl", {"kvbranch": done}, 1.0, 0.25, 4.0, {})
    assert "lower bound" in recs[-1].note and recs[-1].value == 2


def test_the_ratio_target_is_not_judged_when_plain_meets_the_slo_nowhere() -> None:
    summaries = {"kvbranch": [_summary(1, 0.2)], "plain": [_summary(1, 3.0)]}
    recs = sweep.build_records("mooncake", summaries, 1.0, 0.25, 4.0, {})
    cap = next(
        r for r in recs if r.metric == "mooncake capacity at the SLO" and r.config == "kvbranch"
    )
    assert cap.met is None and "fewer agents" in cap.note and ">= 3x" in cap.target


def test_a_ratio_of_lower_bounds_is_judged_only_where_the_bound_decides_it() -> None:
    assert sweep.ratio_verdict(10, False, 1, False, 10.0) is True
    assert sweep.ratio_verdict(9, False, 1, False, 10.0) is False
    assert sweep.ratio_verdict(10, True, 1, False, 10.0) is True  # kvbranch may carry more
    assert sweep.ratio_verdict(9, True, 1, False, 10.0) is None
    assert sweep.ratio_verdict(9, False, 1, True, 10.0) is False  # plain may carry more
    assert sweep.ratio_verdict(10, False, 1, True, 10.0) is None
    assert sweep.ratio_verdict(2, True, 2, True, 3.0) is None
    assert sweep.ratio_verdict(5, False, 0, False, 3.0) is None


# --- when each agent starts ----------------------------------------------------------------------


def test_agents_start_one_stagger_apart_and_all_at_once_by_default(monkeypatch) -> None:
    import asyncio

    from benchmarks.capacity import replay

    waits: list[tuple[int, float]] = []  # (agents that had sent something, the wait asked)
    sent: list[str] = []

    async def fake_sleep(seconds: float) -> None:
        waits.append((len(sent), seconds))

    async def fake_send(oai, model, step, salt, cache_key) -> dict:
        sent.append(step.body["messages"][0]["content"])
        measured = dict.fromkeys(("ttft_s", "total_s"), 0.1)
        counts = dict.fromkeys(("prompt_tokens", "completion_tokens", "recomputed_tokens"), 1)
        return {**measured, **counts, "answer": "x"}

    monkeypatch.setattr(replay.asyncio, "sleep", fake_sleep)
    monkeypatch.setattr(replay, "send", fake_send)
    convs = [
        Conversation(
            id=f"c{i}", steps=(Step(body={"messages": [{"content": f"c{i}"}]}, max_tokens=1),)
        )
        for i in range(3)
    ]
    turns, _ = asyncio.run(replay.run_agents(None, "m", convs, 3, 1, "s", True, 1.5))
    assert sorted(w for _, w in waits) == [0.0, 1.5, 3.0]
    assert len(turns) == 3
    waits.clear()
    asyncio.run(replay.run_agents(None, "m", convs, 3, 1, "s", True))
    assert [w for _, w in waits] == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        replay.start_delay(1, -1.0)


def test_a_configuration_may_carry_one_environment_variable_of_its_own() -> None:
    from benchmarks.capacity import config_env

    assert config_env("kvbranch-sched") == ("kvbranch-sched", {})
    assert config_env("kvbranch-sched+KVBRANCH_PAUSE_COLDS=0") == (
        "kvbranch-sched",
        {"KVBRANCH_PAUSE_COLDS": "0"},
    )
    assert config_env("kvbranch-sched:--agent-priority+K=") == (
        "kvbranch-sched:--agent-priority",
        {"K": ""},
    )
    for bad in ("kvbranch+", "kvbranch+K", "kvbranch+=1"):
        with pytest.raises(SystemExit, match="config\\+KEY=VALUE"):
            config_env(bad)


def test_a_configuration_name_gives_the_connector_and_the_scheduling_flags() -> None:
    import argparse

    from benchmarks import capacity, common

    args = argparse.Namespace(sched_flags="--agent-priority --cold-prefill-chunk 256")
    assert capacity.config_flags("plain", args) == (False, common.SCHEDULER_OFF_FLAGS)
    assert capacity.config_flags("kvbranch", args) == (True, common.SCHEDULER_OFF_FLAGS)
    sched = ["--agent-priority", "--cold-prefill-chunk", "256"]
    assert capacity.config_flags("kvbranch-sched", args) == (True, sched)
    own = capacity.config_flags("kvbranch-sched:--cold-prefill-chunk 512", args)
    assert own == (True, ["--cold-prefill-chunk", "512"])


def _pass(p50: float, tps: float, agents: int = 4) -> StepSummary:
    return StepSummary(
        agents, 8, 4, p50, p50 * 2, p50 * 3, 1.0, 2.0, 3.0, 10.0, tps, 1.0, 5, 50, True
    )


def test_interleaved_passes_alternate_their_order() -> None:
    from benchmarks.capacity import interleave

    assert interleave.pass_order(["a", "b"], 0) == ["a", "b"]
    assert interleave.pass_order(["a", "b"], 1) == ["b", "a"]
    assert interleave.pass_order(["a", "b", "c"], 3) == ["c", "b", "a"]


def test_interleaved_ratios_are_above_one_where_the_other_is_better() -> None:
    from benchmarks.capacity import interleave

    passes = [{"off": _pass(2.0, 5.0), "on": _pass(1.0, 4.0)} for _ in range(4)]
    passes.append({"off": _pass(2.0, 5.0), "on": _pass(float("nan"), 4.0)})  # left out
    got = interleave.ratios(passes, "off", "on")
    assert got["resumed_p50"] == [2.0] * 4  # half the TTFT: 2x better
    assert got["output_tps"] == [0.8] * 5  # 80% of the throughput: worse
    recs = interleave.build_records("bfcl", 4, passes, {"on": (9, 10)})
    by_metric = {r.metric: r for r in recs}
    ttft = by_metric["bfcl agents=4 resumed TTFT p50, interleaved (median of passes)"]
    assert (ttft.config, ttft.value) == ("off/on", 2.0) and "4 passes" in ttft.note
    tps = by_metric["bfcl agents=4 output throughput, interleaved (median of passes)"]
    assert (tps.config, tps.value) == ("on/off", 0.8)
    same = by_metric["bfcl agents=4 answers identical to off, interleaved"]
    assert (same.value, same.met) == (0.9, False)


def test_interleaved_passes_run_every_server_in_turn_and_compare_answers(monkeypatch) -> None:
    """The orchestration with the servers and the replay replaced by recorders."""
    import argparse
    import asyncio
    import contextlib
    import types

    import openai

    from benchmarks import common
    from benchmarks.capacity import configs, interleave, replay

    class Client:
        def __init__(self, base_url: str, **_: object) -> None:
            self.url = base_url

            async def listed() -> object:
                return types.SimpleNamespace(data=[types.SimpleNamespace(id="m")])

            self.models = types.SimpleNamespace(list=listed)

    @contextlib.contextmanager
    def servers_up(specs):
        yield {n: types.SimpleNamespace(url=f"http://{n}") for n in specs}

    order: list[tuple[str, str]] = []

    async def run_agents(oai, model, convs, agents, per_agent, salt, sessions, stagger_s=0.0):
        order.append((oai.url, salt))
        answer = "x" if "on" in oai.url and salt == "p1" else "same"
        turns = [
            Turn(a, "c", 0, s, 0.5, 1.0, 100, 8, 10, answer) for a in range(agents) for s in (0, 1)
        ]
        return turns, 2.0

    monkeypatch.setattr(openai, "AsyncOpenAI", Client)
    monkeypatch.setattr(common, "servers_up", servers_up)
    monkeypatch.setattr(replay, "run_agents", run_agents)
    monkeypatch.setattr(configs, "config_spec", lambda name, args: name)
    args = argparse.Namespace(agents="3,6", interleave=3, per_agent=1, trace="bfcl", stagger_s=0.0)
    agents, passes, identical = asyncio.run(interleave.run_passes(args, [], ["off", "on"], print))
    assert agents == 3 and len(passes) == 3 and list(passes[1]) == ["off", "on"]
    assert order == [
        ("http://off/v1", "p0"),
        ("http://on/v1", "p0"),
        ("http://on/v1", "p1"),
        ("http://off/v1", "p1"),
        ("http://off/v1", "p2"),
        ("http://on/v1", "p2"),
    ]
    assert identical["on"] == (12, 18)  # pass 1's answers differ


def test_a_configuration_spec_carries_its_flags_environment_and_reservation() -> None:
    import argparse

    from benchmarks import capacity, common

    args = argparse.Namespace(
        sched_flags="--agent-priority",
        kv_cache_gib=0.4,
        host_store_gib=2.0,
        max_model_len=4096,
        reserved_cpus=-1,
    )
    spec = capacity.config_spec("kvbranch-sched+KVBRANCH_BACKFILL=0", args)
    assert spec.env == {"KVBRANCH_BACKFILL": "0"} and spec.reserved_cpus is None
    assert spec.args == common.server_args(True, 0.4, 2.0, 4096, ["--agent-priority"])
