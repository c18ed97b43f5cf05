"""The soak's pure parts: the hostile requests it sends (each one malformed in the way it names,
with the status a correct router answers) and its verdicts — which failures a fault excuses,
per-tenant counts by cause, answers against the plain replay, memory growth, the targets — on
made-up runs."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest

from benchmarks.history import soak, soak_abuse, soak_report
from benchmarks.history.soak import normalized, replay_body
from sdk.contract import check_id
from sdk.contract.wire import has_lone_surrogate

INFO = dict.fromkeys(
    ["cpu", "cores", "ram", "kernel", "python", "vllm", "torch", "transformers"], "x"
)


def _cases() -> dict[str, soak_abuse.AbuseCase]:
    return {c.name: c for c in soak_abuse.abuse_cases("m", random.Random(0))}


def _parsed(case: soak_abuse.AbuseCase):
    return json.loads(case.body)


def test_each_hostile_body_is_malformed_as_it_says():
    cases = _cases()
    assert has_lone_surrogate(_parsed(cases["session-surrogate"])["session_id"])
    branch = _parsed(cases["branch-surrogate"])["vllm_xargs"]["kvbranch_branch"]
    assert has_lone_surrogate(branch)
    assert has_lone_surrogate(_parsed(cases["content-surrogate"])["messages"][0]["content"])
    assert _parsed(cases["stream-int"])["stream"] == 1
    for name in ("session-path-id", "session-long-id"):
        with pytest.raises(ValueError):
            check_id(_parsed(cases[name])["session_id"])
    with pytest.raises(RecursionError):
        json.loads(cases["deep-json"].body)
    with pytest.raises(ValueError):
        json.loads(cases["not-json"].body)
    over = _parsed(cases["min-over-max"])
    assert over["min_tokens"] > over["max_tokens"]
    assert cases["header-session-byte"].headers["X-Session-ID"] == b"\xe9"


def test_unkeyed_cases_expect_401_and_keyed_ones_400():
    for case in _cases().values():
        if case.keyed:
            assert case.expect == {400}, case.name
        elif case.name != "header-auth-byte":  # a non-ASCII header: 400 before any key check
            assert case.expect == {401}, case.name
            assert "Authorization" not in case.headers or "not-a-key" in str(
                case.headers["Authorization"]
            )


def test_well_formed_parts_of_the_cases_stay_well_formed():
    """Only the named field is wrong: every other case parses and carries a valid model."""
    for case in _cases().values():
        if case.name in ("deep-json", "not-json"):
            continue
        body = _parsed(case)
        assert isinstance(body, dict), case.name


def test_ids_are_fresh_each_round():
    rng = random.Random(1)
    first = soak_abuse.abuse_cases("m", rng)[0].body
    assert soak_abuse.abuse_cases("m", rng)[0].body != first


def _ev(tenant, status, t0=10.0, t1=11.0, router=0, kind="turn", case="t1", **extra):
    return {
        "tenant": tenant,
        "kind": kind,
        "case": case,
        "router": router,
        "t0": t0,
        "t1": t1,
        "status": status,
        "error": None if status else "ReadError: x",
        **extra,
    }


FAULTS = [
    {"role": "router", "victim": "router1", "t_kill": 20.0, "t_back": 30.0, "only": False},
    {"role": "decode", "victim": "decode0", "t_kill": 50.0, "t_back": 90.0, "only": True},
]


def test_a_fault_excuses_only_the_only_instance_or_the_own_router():
    assert soak_report.in_fault(_ev("A", None, 60, 61), FAULTS)  # the only D was down
    assert soak_report.in_fault(_ev("A", None, 19, 21, router=1), FAULTS)  # its router killed
    assert not soak_report.in_fault(_ev("A", None, 19, 21, router=0), FAULTS)  # the other one
    assert not soak_report.in_fault(_ev("A", 503, 95, 96), FAULTS)  # after recovery
    never_back = [dict(FAULTS[1], t_back=None)]
    assert soak_report.in_fault(_ev("A", 503, 500, 501), never_back)


def test_outcome_of_hostile_requests_follows_their_expected_statuses():
    assert soak_report.outcome(_ev("C", 400, expected=[400])) == "ok"
    assert soak_report.outcome(_ev("C", 200, expected=[400])) == "unexpected"
    assert soak_report.outcome(_ev("C", 500, expected=[400])) == "5xx"
    assert soak_report.outcome(_ev("C", 429, expected=[200, 429], no_retry_after=True)) == (
        "unexpected"
    )
    assert soak_report.outcome(_ev("A", 404)) == "4xx"
    assert soak_report.outcome(_ev("A", None)) == "lost"


def test_tenant_summary_counts_by_cause_and_splits_faults():
    events = [
        _ev("A", 200),
        _ev("A", 503, 60, 61),  # during the only D's fault
        _ev("A", 500, 100, 101),  # outside any fault: a failure
        _ev("A", 404, kind="session", case="fork"),
        _ev("C", 400, kind="malformed", case="stream-int", expected=[400]),
        _ev("C", 200, kind="malformed", case="deep-json", expected=[400]),
    ]
    s = soak_report.tenant_summary(events, FAULTS)
    assert (s["A"]["requests"], s["A"]["ok"], s["A"]["failed"], s["A"]["failed_in_fault"]) == (
        4,
        1,
        1,
        1,
    )
    assert s["A"]["by_cause"] == Counter(
        {"503 turn/t1": 1, "500 turn/t1": 1, "404 session/fork": 1}
    )
    assert s["C"]["unexpected"] == 1 and s["C"]["ok"] == 1
    assert s["C"]["by_cause"]["400 malformed/stream-int"] == 1


def test_answers_compare_content_and_tool_calls():
    a = {"content": "x", "tool_calls": [["f", "{}"]]}
    served = [
        {"kind": "turn", "t0": 1.0, "answer": a, "plain": dict(a)},
        {"kind": "tool", "t0": 2.0, "answer": a, "plain": {"content": "x", "tool_calls": []}},
        {"kind": "turn", "t0": 3.0, "answer": a, "plain": None},
    ]
    out = soak_report.compare_answers(served)
    assert (out["compared"], out["same"], out["not_replayed"]) == (2, 1, 1)
    assert [w["kind"] for w in out["wrong"]] == ["tool"]


def test_normalized_answers_ignore_tool_call_ids_and_replay_drops_session_fields():
    m1 = {"content": None, "tool_calls": [{"id": "a", "function": {"name": "f", "arguments": "1"}}]}
    m2 = {"content": "", "tool_calls": [{"id": "b", "function": {"name": "f", "arguments": "1"}}]}
    assert normalized(m1) == normalized(m2)
    body = {
        "model": "m",
        "messages": [],
        "session_id": "s",
        "vllm_xargs": {},
        "stream": True,
        "stream_options": {},
        "max_tokens": 3,
    }
    assert replay_body(body) == {"model": "m", "messages": [], "max_tokens": 3}


def _samples():
    return [
        {"t": 0.0, "rss": {"router0": 100.0, "router1": 100.0, "decode0": 900.0}, "redis_keys": 10},
        {
            "t": 5.0,
            "rss": {"router0": 130.0, "router1": None, "decode0": 950.0},
            "redis_keys": None,
        },
        {"t": 10.0, "rss": {"router0": 150.0, "router1": 90.0, "decode0": 940.0}, "redis_keys": 30},
    ]


def test_memory_growth_only_for_processes_never_killed():
    mem = soak_report.memory_summary(_samples(), FAULTS)
    assert mem["procs"]["router0"]["growth"] == 50.0
    assert mem["procs"]["router1"]["growth"] is None  # killed: its series restarts
    assert mem["procs"]["decode0"]["peak"] == 950.0
    assert mem["redis_keys"] == {"min": 10, "max": 30, "last": 30}


def _record(events, served, end=None):
    return {
        "config": {
            "prefills": 1,
            "decodes": 1,
            "agents": 2,
            "tenant_inflight": 3,
            "fault_every_s": 20,
            "fault_cycle": ["router", "decode"],
            "traffic_s": 120,
        },
        "events": events,
        "served": served,
        "faults": FAULTS,
        "samples": _samples(),
        "end": end or {"whole": True, "keys": 30, "keys_without_ttl": 0},
    }


GOOD = [
    _ev("A", 200),
    _ev("B", 200),
    _ev("C", 429, kind="over-share", case="burst", expected=[200, 429]),
    _ev("anonymous", 401, kind="flood", case="no-key", expected=[401]),
]
SERVED = [{"kind": "turn", "t0": 1.0, "answer": {"content": "x"}, "plain": {"content": "x"}}]


def _verdicts(record) -> dict[str, bool]:
    text = soak_report.section(record, INFO, 60.0, "benchmarks/soak_quick.png")
    return {
        line.split(" — ")[0]: line.endswith(": met.")
        for line in text.splitlines()
        if line.startswith("- Target:")
    }


def test_a_clean_run_meets_every_target():
    verdicts = _verdicts(_record(GOOD, SERVED))
    assert len(verdicts) == 9 and all(verdicts.values()), verdicts


@pytest.mark.parametrize(
    ("change", "target"),
    [
        (lambda r: r["events"].append(_ev("B", 502, 100, 101)), "legitimate requests failed"),
        (lambda r: r["served"][0].update(plain={"content": "y"}), "wrong answers"),
        (lambda r: r["events"].append(_ev("A", 429)), "legitimate tenants never throttled"),
        (
            lambda r: r["events"].append(_ev("anonymous", 500, 100, 101, expected=[401])),
            "hostile requests",
        ),
        (lambda r: r["events"].__setitem__(2, _ev("C", 200, expected=[200, 429])), "the tenant"),
        (lambda r: r["faults"].__setitem__(1, dict(FAULTS[1], t_back=None)), "the cluster"),
        (lambda r: r["samples"][2]["rss"].update(router0=400.0), "a router never killed"),
        (lambda r: r["end"].update(keys_without_ttl=3), "every Redis key"),
        (lambda r: r["end"].update(died={"decode0": 8.0}), "no process died"),
    ],
)
def test_each_target_fails_on_its_own_fault(change, target):
    record = _record([dict(e) for e in GOOD], [dict(s) for s in SERVED])
    record["faults"] = [dict(f) for f in FAULTS]
    change(record)
    verdicts = _verdicts(record)
    failed = [k for k, met in verdicts.items() if not met]
    assert len(failed) == 1 and target in failed[0], verdicts


def test_no_answers_compared_is_not_a_pass():
    assert not _verdicts(_record(GOOD, []))[
        "- Target: wrong answers against the plain vLLM replay: 0"
    ]


# --- the aggregated topology (--replicas) ---------------------------------------------------


def _args(*argv: str):
    import argparse

    ap = argparse.ArgumentParser()
    soak.add_arguments(ap)
    return ap.parse_args(list(argv))


def test_replicas_argument_checks_refuse_what_cannot_run():
    for argv, why in [
        (["--replicas", "1"], "N >= 2"),
        (["--replicas", "0"], "N >= 2"),
        (["--replicas", "2", "--prefills", "1"], "drop --prefills"),
        (["--replicas", "2", "--decodes", "2"], "drop --prefills/--decodes"),
        (["--agents", "4", "--tenant-inflight", "3"], "--tenant-inflight"),
        (["--prefills", "0"], "at least 1"),
    ]:
        with pytest.raises(SystemExit, match=why):
            soak.check_args(_args(*argv))


def test_replicas_argument_checks_fill_each_topologys_defaults():
    pd = _args()
    soak.check_args(pd)
    assert (pd.prefills, pd.decodes, pd.replicas, pd.router_policies) == (1, 1, None, None)
    agg = _args("--replicas", "3")
    soak.check_args(agg)
    assert (agg.prefills, agg.decodes) == (0, 0)
    assert agg.router_policies == ["cache-aware", "round-robin"]
    both_ours = _args("--replicas", "2", "--router-policies", "cache-aware", "cache-aware")
    soak.check_args(both_ours)
    assert both_ours.router_policies == ["cache-aware", "cache-aware"]
    with pytest.raises(SystemExit):  # argparse: not a policy
        _args("--replicas", "2", "--router-policies", "cache-aware", "random")


def _members(cycle, **counts):
    out = {"router": ["router0", "router1"], "redis": ["redis"]}
    for role in cycle:
        if role not in out:
            out[role] = [f"{role}{n}" for n in range(counts.get(role, 1))]
    return {role: soak.faulted_members(role, names) for role, names in out.items()}


def test_replica_faults_cycle_router_redis_then_each_replica_in_turn():
    cycle = soak.fault_cycle(2)
    members = _members(cycle, replica=2)
    wanted = soak.faults_to_cover(cycle, members)
    victims = [soak.fault_victim(i, cycle, members)[1] for i in range(wanted)]
    # router0 is never killed: the report judges its growth over the whole soak
    assert victims == ["router1", "redis", "replica0", "router1", "redis", "replica1"]
    three = _members(cycle, replica=3)
    killed = {
        soak.fault_victim(i, cycle, three)[1] for i in range(soak.faults_to_cover(cycle, three))
    }
    assert {"replica0", "replica1", "replica2", "redis", "router1"} <= killed
    assert "router0" not in killed


def test_pd_faults_keep_router0_alive_too():
    cycle = soak.fault_cycle(None)
    members = _members(cycle)
    victims = {soak.fault_victim(i, cycle, members)[1] for i in range(3 * len(cycle))}
    assert "router0" not in victims and "router1" in victims


def test_pd_faults_keep_their_cycle_and_length():
    cycle = soak.fault_cycle(None)
    assert cycle == ("router", "redis", "decode", "prefill")
    members = _members(cycle)
    assert soak.faults_to_cover(cycle, members) == 4  # one cycle, as before --replicas
    two_p = _members(cycle, prefill=2)
    wanted = soak.faults_to_cover(cycle, two_p)
    assert "prefill1" in {soak.fault_victim(i, cycle, two_p)[1] for i in range(wanted)}


REPLICA_FAULTS = [
    {"role": "replica", "victim": "replica0", "t_kill": 40.0, "t_back": 100.0, "only": False},
]


def test_a_replica_fault_excuses_its_door_and_requests_in_flight_at_the_kill():
    # hostile traffic sent to replica0's own port while it is down
    assert soak_report.in_fault(_ev("C", None, 60, 61, router=2, door="replica0"), REPLICA_FAULTS)
    # a turn through a router, in flight when a replica was killed: it may have been serving it
    assert soak_report.in_fault(_ev("A", 503, 39, 41), REPLICA_FAULTS)
    # a turn that began after the kill must go to the live replica
    assert not soak_report.in_fault(_ev("A", 503, 41, 42), REPLICA_FAULTS)
    # a P/D instance that is not the only one of its role excuses nothing in flight
    two_ds = [dict(REPLICA_FAULTS[0], role="decode", victim="decode1")]
    assert not soak_report.in_fault(_ev("A", 503, 39, 41), two_ds)


METRICS = """# HELP kvbranch_peer_turns_total Session turns ...
# TYPE kvbranch_peer_turns_total counter
kvbranch_peer_turns_total{source="peer"} 5.0
kvbranch_peer_turns_total{source="revived"} 2.0
kvbranch_peer_turns_total{source="revived_run"} 1.0
kvbranch_peer_turns_total{source="own_hold"} 9.0
kvbranch_peer_turns_created{source="peer"} 1.7e+09
kvbranch_prompt_tokens_total{source="remote"} 4096.0
kvbranch_prompt_tokens_total{source="device"} 100.0
kvbranch_connector_up 1.0
"""


def test_peer_pull_counts_read_a_replicas_metrics():
    assert soak_report.peer_pull_counts(METRICS) == {
        "peer": 5.0,
        "revived": 2.0,
        "revived_run": 1.0,
        "own_hold": 9.0,
        "remote_tokens": 4096.0,
        "connector_up": 1.0,
    }
    assert soak_report.peer_pull_counts("# nothing\n") == {}


def test_readings_without_the_connectors_stats_are_counted_and_said():
    # a replica whose connector did not answer gives no prompt-token row: its pulled tokens
    # read as 0, which the report must not pass off as none pulled
    down = {"t": 3, "member": "replica1", "life": 0, "counts": {"peer": 2.0, "connector_up": 0.0}}
    readings = [_reading(5, "replica0", 0, 1, 100), down]
    readings[0]["counts"]["connector_up"] = 1.0
    totals = soak_report.pull_totals(readings)
    assert (totals["readings"], totals["connector_down"]) == (2, 1)
    assert "connector_up" not in totals and totals["pulled"] == 3
    line = soak_report.pull_line(totals)
    assert "missing in 1 of 2 readings" in line and "readings 2" not in line
    assert "missing" not in soak_report.pull_line(soak_report.pull_totals(readings[:1]))


def _reading(t, member, life, peer, remote=0.0, own=0.0):
    counts = {"peer": peer, "revived": 0.0, "remote_tokens": remote, "own_hold": own}
    return {"t": t, "member": member, "life": life, "counts": counts}


def test_pull_totals_add_every_process_life_once():
    readings = [
        _reading(5, "replica0", 0, 1, 100),
        _reading(10, "replica0", 0, 3, 300),  # replica0's last reading before its kill
        _reading(15, "replica0", 1, 1, 50),  # restarted: its counters began again
        _reading(10, "replica1", 0, 2, 200),
        _reading(20, "replica1", 0, 4, 400, own=6),
    ]
    totals = soak_report.pull_totals(readings)
    assert totals["pulled"] == 3 + 1 + 4
    assert totals["remote_tokens"] == 300 + 50 + 400
    assert totals["own_hold"] == 6
    assert soak_report.pull_totals([])["pulled"] == 0


def _replica_record(pulled: float):
    record = _record([dict(e) for e in GOOD], [dict(s) for s in SERVED])
    record["faults"] = [dict(f) for f in FAULTS]
    record["config"].update(
        prefills=0,
        decodes=0,
        replicas=2,
        router_policies=["cache-aware", "round-robin"],
        doors=["router0", "router1", "replica0"],
    )
    record["pulls"] = [_reading(30.0, "replica1", 0, pulled, 64 * pulled)]
    return record


def test_a_clean_replica_run_meets_every_target_pulls_included():
    record = _replica_record(4)
    verdicts = _verdicts(record)
    assert len(verdicts) == 10 and all(verdicts.values()), verdicts
    text = soak_report.section(record, INFO, 60.0, "plots/soak_replicas_quick.png")
    assert "2 aggregated replicas" in text and "pulled from a peer: 4 turns" in text
    names = {r.config for r in soak_report.records_of(record, "")}
    assert names == {"2 replicas"}
    assert {r.config for r in soak_report.records_of(_record(GOOD, SERVED), "")} == {"cluster"}


def test_no_pull_in_a_replica_run_fails_that_target_alone():
    verdicts = _verdicts(_replica_record(0))
    failed = [k for k, met in verdicts.items() if not met]
    assert len(failed) == 1 and "pulled their history" in failed[0], verdicts
