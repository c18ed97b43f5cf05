"""The choice of an aggregated replica (server/router/replicas.py), as pure logic: the holder
keeps its session while it is live and not overloaded, an overloaded or dead holder loses it,
the home stands in for a hold that is taken or gone, and rendezvous hashing moves only a
departing replica's sessions."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from server.router.choice import rendezvous_weight
from server.router.replicas import LOAD_MARGIN, choose_replica, session_bytes


@dataclass
class _Replica:
    url: str
    instance_id: str | None
    load: int = 0
    requests: int = 0


def _fleet(n: int) -> list[_Replica]:
    return [_Replica(f"http://r{i}:8000", f"r{i}") for i in range(n)]


KEY = ("tenant-a", "sess-1", "main")


def test_the_holder_keeps_its_session():
    a, b, c = _fleet(3)
    for holder in (a, b, c):
        chosen = choose_replica([a, b, c], KEY, holder=holder.instance_id, home="r0")
        assert chosen.replica is holder and not chosen.moved


def test_a_holder_within_the_margin_keeps_it_and_one_past_it_loses_it():
    a, b = _fleet(2)
    a.load = LOAD_MARGIN  # at the margin above the least loaded: still fits
    assert choose_replica([a, b], KEY, holder="r0").replica is a
    a.load = LOAD_MARGIN + 1  # past it: the session moves to a replica that fits
    chosen = choose_replica([a, b], KEY, holder="r0")
    assert chosen.replica is b and chosen.moved


def test_the_margin_is_measured_from_the_least_loaded_replica():
    a, b = _fleet(2)
    a.load, b.load = 10 + LOAD_MARGIN, 10  # both busy: a is no worse than the margin
    assert choose_replica([a, b], KEY, holder="r0").replica is a


def test_a_dead_holder_loses_its_session():
    a, b, c = _fleet(3)
    chosen = choose_replica([b, c], KEY, holder="r0")  # a is not live
    assert chosen.replica in (b, c) and chosen.moved
    session = session_bytes(KEY)
    assert chosen.replica is max((b, c), key=lambda r: rendezvous_weight(session, r.url))


def test_without_a_hold_the_session_goes_home():
    a, b, c = _fleet(3)
    chosen = choose_replica([a, b, c], KEY, holder=None, home="r2")
    assert chosen.replica is c and not chosen.moved


def test_a_holder_gone_sends_the_session_home_and_that_is_a_move():
    a, b, c = _fleet(3)
    chosen = choose_replica([b, c], KEY, holder="r0", home="r2")
    assert chosen.replica is c and chosen.moved


def test_an_overloaded_home_is_left_like_an_overloaded_holder():
    a, b = _fleet(2)
    a.load = LOAD_MARGIN + 1
    chosen = choose_replica([a, b], KEY, home="r0")
    assert chosen.replica is b and chosen.moved


def test_nothing_known_is_rendezvous_and_not_a_move():
    fleet = _fleet(4)
    session = session_bytes(KEY)
    chosen = choose_replica(fleet, KEY)
    assert chosen.replica is max(fleet, key=lambda r: rendezvous_weight(session, r.url))
    assert not chosen.moved
    # Every branch of a session goes to the same replica: they share its history.
    branches = [(KEY[0], KEY[1], f"fork-{i}") for i in range(20)]
    assert {choose_replica(fleet, k).replica.url for k in branches} == {chosen.replica.url}
    # Another tenant's session of the same id is another session.
    others = {choose_replica(fleet, (f"t{i}", KEY[1], "main")).replica.url for i in range(40)}
    assert len(others) > 1


def test_a_departing_replica_moves_only_its_own_sessions():
    fleet = _fleet(4)
    keys = [("tenant-a", f"sess-{i}", "main") for i in range(400)]
    before = {k: choose_replica(fleet, k).replica.url for k in keys}
    gone = fleet[1]
    after = {k: choose_replica([r for r in fleet if r is not gone], k).replica.url for k in keys}
    moved = {k for k in keys if before[k] != after[k]}
    assert moved == {k for k in keys if before[k] == gone.url}
    assert 50 < len(moved) < 150  # about a quarter: the hashing spreads sessions
    # ... and when it comes back, they return.
    assert {k: choose_replica(fleet, k).replica.url for k in keys} == before


def test_a_session_less_request_goes_to_the_least_loaded():
    a, b, c = _fleet(3)
    a.load, b.load, c.load = 2, 0, 1
    assert choose_replica([a, b, c], None).replica is b
    a.load, b.load, c.load = 1, 2, 2
    a.requests = 9  # more requests taken, but fewer in flight
    assert choose_replica([a, b, c], None).replica is a
    a.load = c.load = b.load = 0  # a tie: the one that took fewer requests
    c.requests = 5
    assert choose_replica([a, b, c], None).replica is b


@pytest.mark.parametrize("holder", ["r0", None])
def test_a_replica_without_an_instance_id_is_never_taken_for_the_holder(holder):
    a, b = _fleet(2)
    a.instance_id = None  # not probed yet
    chosen = choose_replica([a, b], KEY, holder=holder, home=None)
    assert chosen.moved == (holder is not None)
