"""Whether an aggregated replica pulls a turn's history or recomputes it (server/plugin/
pull_cost.py): the priors, measured speeds, the peer's load, and how measurements move the
estimates. Pure logic; the wiring is in test_peer_pull.py."""

from __future__ import annotations

import pytest

from server.plugin.pull_cost import (
    EWMA_WEIGHT,
    EXPLORE_EVERY,
    MIN_PULL_TOKENS,
    MIN_SAMPLE_S,
    MIN_SAMPLE_TOKENS,
    PATHS,
    PRIOR_LINK_TOKENS_PER_S,
    PRIOR_PREFILL_TOKENS_PER_S,
    PULL_OVERHEAD_S,
    REVIVE_WAIT_PER_PEER_REQUEST_S,
    PullCostModel,
)


def measured(prefill_tps: float, link_tps: float, kind: str = "hold") -> PullCostModel:
    """A model that measured ``prefill_tps`` and a ``kind`` link of ``link_tps`` many times
    over (the averages have converged)."""
    model = PullCostModel()
    for _ in range(100):
        model.observe_prefill(1000, 1000 / prefill_tps)
    path = "hold" if kind == "hold" else "revive"
    for _ in range(100):
        model.observe_pull(path, 1200, 0, PULL_OVERHEAD_S + 1200 / link_tps, 0)
    return model


@pytest.mark.parametrize("path", PATHS)
def test_before_any_measurement_an_idle_peer_is_pulled_from_at_the_old_floor(path):
    model = PullCostModel()
    assert [model.estimate(path, t, 0).pull for t in (0, 1, 16, MIN_PULL_TOKENS - 1)] == [False] * 4
    assert all(model.estimate(path, t, 0).pull for t in (MIN_PULL_TOKENS, 33, 600, 100_000))


def test_a_slow_link_makes_recompute_win_for_a_short_prefix_but_not_a_long_one():
    # prefill 5,000 tokens/s, link 6,000: the overhead is paid back from 300 tokens on
    model = measured(prefill_tps=5000, link_tps=6000)
    assert model.prefill.value == pytest.approx(5000, rel=1e-3)
    assert model.links["hold"].value == pytest.approx(6000, rel=1e-3)
    short, long = model.estimate("hold", 200, 0), model.estimate("hold", 1000, 0)
    assert not short.pull and short.recompute_s == pytest.approx(0.04, rel=1e-3)
    assert long.pull and long.pull_s == pytest.approx(PULL_OVERHEAD_S + 1000 / 6000, rel=1e-3)
    # the prior would have pulled the short one
    assert PullCostModel().estimate("hold", 200, 0).pull


def test_a_link_slower_than_the_prefill_never_wins():
    model = measured(prefill_tps=5000, link_tps=4000)
    assert not any(model.estimate("hold", t, 0).pull for t in (32, 1000, 100_000))


def test_a_revive_measures_its_own_link():
    model = measured(prefill_tps=5000, link_tps=6000, kind="revive")
    assert model.links["hold"].value == PRIOR_LINK_TOKENS_PER_S  # claims keep the prior
    assert not model.estimate("run", 200, 0).pull and not model.estimate("revive", 200, 0).pull
    assert model.estimate("hold", 200, 0).pull


def test_a_busy_peer_flips_a_revive_to_recompute():
    model = PullCostModel()
    idle, busy = model.estimate("revive", 400, 0), model.estimate("revive", 400, 3)
    assert idle.pull and not busy.pull
    assert busy.pull_s - idle.pull_s == pytest.approx(3 * REVIVE_WAIT_PER_PEER_REQUEST_S)
    assert not model.estimate("run", 400, 3).pull
    # a longer history still pays the busy peer's wait back
    assert model.estimate("revive", 2000, 3).pull


def test_a_busy_peer_weighs_less_on_a_claim_than_on_a_revive():
    model = PullCostModel()
    assert model.estimate("hold", 400, 3).pull  # the reads do not wait in the peer's queue
    assert not model.estimate("hold", 400, 100).pull
    assert model.peer_wait_s("hold", 3) < model.peer_wait_s("revive", 3)
    assert model.peer_wait_s("hold", -5) == 0  # a record's load is never a credit


def test_a_prefill_sample_moves_the_average_by_its_weight():
    model = PullCostModel()
    assert model.prefill.samples == 0
    assert model.observe_prefill(2000, 2.0)
    expected = PRIOR_PREFILL_TOKENS_PER_S + EWMA_WEIGHT * (1000 - PRIOR_PREFILL_TOKENS_PER_S)
    assert model.prefill.value == pytest.approx(expected)
    assert model.observe_prefill(500, 1.0)
    assert model.prefill.value == pytest.approx(expected + EWMA_WEIGHT * (500 - expected))
    assert model.prefill.samples == 2


@pytest.mark.parametrize(
    ("tokens", "seconds"), [(MIN_SAMPLE_TOKENS - 1, 1.0), (1000, 0.0), (1000, -1.0)]
)
def test_samples_too_small_or_timeless_are_not_measured(tokens, seconds):
    model = PullCostModel()
    assert not model.observe_prefill(tokens, seconds)
    assert not model.observe_pull("hold", tokens, 0, seconds, 0)
    assert model.prefill.samples == 0 and model.links["hold"].samples == 0
    assert model.prefill.value == PRIOR_PREFILL_TOKENS_PER_S


def test_a_pull_sample_is_credited_with_its_time_net_of_prefill_overhead_and_peer_wait():
    model = PullCostModel()
    model.prefill.value = 1000.0
    # 500 tokens recomputed (0.5 s), the overhead, 2 requests on the peer, 0.1 s of transfer
    seconds = 0.5 + PULL_OVERHEAD_S + 2 * REVIVE_WAIT_PER_PEER_REQUEST_S + 0.1
    assert model.observe_pull("run", 2000, 500, seconds, 2)
    link = model.links["revive"]
    assert link.samples == 1
    assert link.value == pytest.approx(
        PRIOR_LINK_TOKENS_PER_S + EWMA_WEIGHT * (20_000 - PRIOR_LINK_TOKENS_PER_S)
    )


def test_a_pull_whose_estimated_parts_fill_its_time_is_credited_the_shortest_time():
    model = PullCostModel()
    model.prefill.value = 1000.0
    model.links["hold"].weight = 1.0
    assert model.observe_pull("hold", 100, 5000, 1.0, 0)  # 5 s of estimated prefill in 1 s
    assert model.links["hold"].value == pytest.approx(100 / MIN_SAMPLE_S)


def test_decisions_are_counted_by_path_and_outcome_and_reported_with_the_estimates():
    model = PullCostModel()
    model.decide("hold", 600, 0)
    model.decide("hold", 8, 0)
    model.decide("run", 400, 9)
    snap = model.snapshot()
    assert snap["decisions"] == {
        "hold": {"pull": 1, "recompute": 1, "explore": 0},
        "revive": {"pull": 0, "recompute": 0, "explore": 0},
        "run": {"pull": 0, "recompute": 1, "explore": 0},
    }
    assert snap["prefill_tokens_per_s"] == PRIOR_PREFILL_TOKENS_PER_S
    assert snap["link_tokens_per_s"] == {
        "hold": PRIOR_LINK_TOKENS_PER_S,
        "revive": PRIOR_LINK_TOKENS_PER_S,
    }
    assert snap["link_samples"] == {"hold": 0, "revive": 0} and snap["prefill_samples"] == 0


def test_a_link_measured_too_slow_is_pulled_again_now_and_then_to_measure_it():
    model = measured(prefill_tps=5000, link_tps=4000)
    choices = [model.decide("hold", 600, 0) for _ in range(2 * EXPLORE_EVERY)]
    explored = [i for i, c in enumerate(choices) if c.pull]
    assert explored == [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1]
    assert all(choices[i].explore for i in explored)
    assert model.snapshot()["decisions"]["hold"] == {
        "pull": 0,
        "recompute": 2 * EXPLORE_EVERY - 2,
        "explore": 2,
    }
    # revives keep their own count: the hold's exploring does not make them pull
    model.links["revive"].value = 4000.0
    assert not any(model.decide("revive", 600, 0).pull for _ in range(EXPLORE_EVERY - 1))


@pytest.mark.parametrize(
    ("tokens", "peer_load", "why"),
    [
        (MIN_PULL_TOKENS - 1, 0, "too few tokens: no pull would pay, whatever the link"),
        (400, 3, "the busy peer decided it: an idle one would have been pulled from"),
    ],
)
def test_no_exploring_where_the_link_is_not_why_a_pull_lost(tokens, peer_load, why):
    model = PullCostModel()
    choices = [model.decide("revive", tokens, peer_load) for _ in range(3 * EXPLORE_EVERY)]
    assert not any(c.pull for c in choices), why


def test_a_pull_resets_the_count_towards_exploring():
    model = measured(prefill_tps=5000, link_tps=6000)  # 200 tokens: recompute; 1000: pull
    for _ in range(EXPLORE_EVERY - 1):
        assert not model.decide("hold", 200, 0).pull
    assert model.decide("hold", 1000, 0).pull
    assert not model.decide("hold", 200, 0).pull  # the count started over
