"""tests/prestart.py's rules: a server is stopped right after the last collected test that uses
it, and not before; a module's own servers launch while the module before it runs, within the
engine budget (pure bookkeeping over stand-in items and processes)."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field

import pytest

from tests import prestart


@dataclass
class FakeItem:
    nodeid: str
    fixturenames: list[str] = field(default_factory=list)


class FakeProcess:
    def __init__(self) -> None:
        self.stops = 0
        self.launches = 0

    def launch(self) -> None:
        self.launches += 1

    def wait_ready(self) -> None:
        pass

    def stop(self) -> None:
        self.stops += 1


@pytest.fixture
def bookkeeping(monkeypatch):
    for name in ("_shared", "_launched", "_held", "_last_user", "_ahead", "_serving", "_reserved"):
        monkeypatch.setattr(prestart, name, {})
    monkeypatch.setattr(prestart, "_pending", [])
    monkeypatch.setattr(prestart, "_borrowed", set())
    monkeypatch.setattr(prestart, "_modules_started", set())
    monkeypatch.setattr(prestart, "_lane", None)
    monkeypatch.setattr(prestart, "_progress", prestart._Progress())


def test_a_server_is_released_after_its_last_user_only(bookkeeping):
    items = [
        FakeItem("a", ["big", "plain"]),
        FakeItem("b", ["plain"]),
        FakeItem("c", ["big"]),
        FakeItem("d", ["plain", "other"]),
    ]
    prestart.plan(items)  # no factories: nothing to launch, only the last users noted
    big, plain = FakeProcess(), FakeProcess()
    with prestart.held("big", (big,)), prestart.held("plain", (plain,)):
        stops = []
        for item in items:
            prestart.release_after(item)
            stops.append((big.stops, plain.stops))
        assert stops == [(0, 0), (0, 0), (1, 0), (1, 1)]
    # the fixture's own stop at the end of its scope is not a second release
    assert "big" not in prestart._held and "plain" not in prestart._held


def test_a_server_no_later_test_uses_is_not_released_by_an_unrelated_test(bookkeeping):
    items = [FakeItem("a", ["big"]), FakeItem("b", [])]
    prestart.plan(items)
    big = FakeProcess()
    with prestart.held("big", (big,)):
        prestart.release_after(items[1])
        assert big.stops == 0
        prestart.release_after(items[0])
        assert big.stops == 1


def _register(name: str, engines: int, scope: str = "module") -> list[FakeProcess]:
    made: list[FakeProcess] = []

    def factory() -> tuple[FakeProcess, ...]:
        made.append(FakeProcess())
        made[-1].engines = engines
        return (made[-1],)

    prestart.register(name, factory, scope=scope, engines=engines)
    return made


def test_a_modules_servers_launch_once_a_module_before_it_has_started(bookkeeping):
    shared = _register("shared", 1, scope="session")
    second = _register("second", 2)
    third = _register("third", 1)
    items = [
        FakeItem("m1.py::a", ["shared"]),
        FakeItem("m1.py::b", ["shared"]),
        FakeItem("m2.py::a", ["second"]),
        FakeItem("m3.py::a", []),
        FakeItem("m4.py::a", ["third"]),
    ]
    prestart.plan(items)
    assert len(shared) == 1 and shared[0].launches == 1  # the session's: at collection
    assert (second, third) == ([], [])  # a module's own: not yet
    prestart.launch_ahead(items[0])  # every later module's, in order, within the budget
    assert [len(second), len(third)] == [1, 1]
    assert second[0].launches == third[0].launches == 1
    prestart.launch_ahead(items[1])  # the same module again: nothing more
    prestart.launch_ahead(items[2])  # nor a later module: they are launched already
    assert [len(second), len(third)] == [1, 1]
    assert prestart.take("second") == (second[0],)  # taken, not launched a second time
    assert len(second) == 1


def test_a_session_fixture_shared_ahead_launches_before_its_first_module_and_lives_through_both(
    bookkeeping,
):
    """A cluster two adjacent modules share (``scope="session", ahead=True``): not launched when
    the lane starts, as a session's servers are, but while the module before its first user
    runs; once, for both modules; released after the second module's last test."""
    made: list[FakeProcess] = []
    prestart.register(
        "cluster", lambda: (made.append(FakeProcess()) or made[-1],), scope="session", ahead=True
    )
    items = [
        FakeItem("m1.py::a", []),
        FakeItem("m2.py::a", ["cluster"]),
        FakeItem("m3.py::a", ["cluster"]),
        FakeItem("m3.py::b", ["cluster"]),
        FakeItem("m4.py::a", []),
    ]
    prestart.plan(items)
    assert made == []  # not with the lane's shared servers
    prestart.launch_ahead(items[0])
    assert len(made) == 1 and made[0].launches == 1
    procs = prestart.take("cluster")
    with prestart.held("cluster", procs):
        for item in items[1:3]:
            prestart.launch_ahead(item)
            prestart.release_after(item)
        assert len(made) == 1 and made[0].stops == 0  # the second module still uses it
        prestart.release_after(items[3])
        assert made[0].stops == 1


def test_servers_that_would_pass_the_engine_budget_wait_and_so_do_those_after(bookkeeping):
    _register("big", prestart.ENGINE_BUDGET - 2, scope="session")
    small = _register("small", 1)
    large = _register("large", 2)
    after = _register("after", 1)
    items = [
        FakeItem("m1.py::a", ["big"]),
        FakeItem("m2.py::a", ["big", "small"]),
        FakeItem("m3.py::a", ["large"]),
        FakeItem("m4.py::a", ["after"]),
    ]
    prestart.plan(items)
    prestart.launch_ahead(items[0])
    assert len(small) == 1  # budget - 2 + 1 fits
    assert large == []  # budget + 2 does not
    prestart.launch_ahead(items[1])
    assert large == [] and after == []  # nor the module after it, which would have fit
    (proc,) = prestart.take("large")  # launched when its module takes it
    assert proc.launches == 1


def test_a_fixture_whose_processes_hold_more_engines_than_declared_is_refused(bookkeeping):
    """The budget is only as good as the counts: a pair of instances declared as one engine
    (the default) let seven engines start on 24 GB."""
    prestart.register("pair", lambda: (FakeProcess(), FakeProcess()))  # engines=1 by default
    with pytest.raises(ValueError, match="declared 1 engine"):
        prestart.take("pair")
    router = FakeProcess()
    router.args = ["--role", "router"]
    prestart.register("instances", lambda: (FakeProcess(), FakeProcess(), router), engines=2)
    assert len(prestart.take("instances")) == 3  # a router is no engine


# --- lanes: two pytest-xdist workers on one machine (tests/conftest.py LANES) ---------------


def _peer(directory, name: str, **state) -> None:
    (directory / name).write_text(json.dumps({"engines": 0, "waiting": False, **state}))


def test_another_lanes_engines_count_against_the_one_budget(bookkeeping, tmp_path):
    prestart.join_lane(tmp_path, "gw0")
    _peer(tmp_path, "gw1", engines=prestart.ENGINE_BUDGET - 1)
    second = _register("second", 2)
    third = _register("third", 1)
    items = [FakeItem("m1.py::a"), FakeItem("m2.py::a", ["second"]), FakeItem("m3.py::a")]
    items.append(FakeItem("m4.py::a", ["third"]))
    prestart.plan(items)
    prestart.launch_ahead(items[0])
    assert second == []  # alone it would fit; beside the other lane's it does not
    _peer(tmp_path, "gw1", engines=1)
    prestart.launch_ahead(items[1])
    assert len(third) == 1
    assert json.loads((tmp_path / "gw0").read_text())["engines"] == 1  # published for the peer
    (tmp_path / "gw1").unlink()  # the other lane has left
    prestart.leave_lane()
    assert not tmp_path.exists()  # the last lane out removes the directory


def test_a_fixture_waits_until_the_other_lane_releases_its_engines(bookkeeping, tmp_path):
    prestart.join_lane(tmp_path, "gw1")
    _peer(tmp_path, "gw0", engines=prestart.ENGINE_BUDGET)
    made = _register("big", 2)
    release = threading.Timer(0.5, _peer, (tmp_path, "gw0"))
    release.start()
    started = time.monotonic()
    prestart.take("big")
    assert time.monotonic() - started >= 0.5 and len(made) == 1
    release.join()


def test_engines_a_test_launches_itself_wait_for_room_and_count_until_its_block_ends(
    bookkeeping, tmp_path
):
    prestart.join_lane(tmp_path, "gw1")
    _peer(tmp_path, "gw0", engines=prestart.ENGINE_BUDGET - 1)
    release = threading.Timer(0.5, _peer, (tmp_path, "gw0"), {"engines": 1})
    release.start()
    started = time.monotonic()
    with prestart.reserved("a launch of P and D", engines=2):
        assert time.monotonic() - started >= 0.5  # waited for the other lane's engines
        mine = json.loads((tmp_path / "gw1").read_text())
        assert mine["engines"] == 2  # the other lane counts them while they run
        made = _register("more", prestart.ENGINE_BUDGET - 2)
        items = [FakeItem("m1.py::a"), FakeItem("m2.py::a", ["more"])]
        prestart.plan(items)
        prestart.launch_ahead(items[0])
        assert not made  # nor does this lane launch past them (2 + 1 + 3 > 5)
    assert json.loads((tmp_path / "gw1").read_text())["engines"] == 0
    prestart.take("more")  # room now: launched at once
    assert len(made) == 1
    release.join()


def test_two_lanes_waiting_for_each_other_let_the_first_name_go(bookkeeping, tmp_path, monkeypatch):
    monkeypatch.setattr(prestart, "ROOM_WAIT_S", 1.5)
    prestart.join_lane(tmp_path, "gw0")
    _peer(tmp_path, "gw1", engines=prestart.ENGINE_BUDGET, waiting=True)
    _register("first", 1)
    started = time.monotonic()
    prestart.take("first")  # gw0 sorts first: it goes
    assert time.monotonic() - started < 1.0
    prestart.leave_lane()
    prestart.join_lane(tmp_path, "gw2")
    _register("second", 1)
    with pytest.warns(UserWarning, match="past the engine budget"):
        prestart.take("second")  # gw1 goes first: gw2 waits for it, until the deadline
    assert time.monotonic() - started >= 1.5


def test_a_lanes_servers_are_bound_to_its_cores_until_the_other_lane_is_done(
    bookkeeping, tmp_path, monkeypatch
):
    monkeypatch.delenv(prestart.BIND_ENV, raising=False)
    seen: list[str | None] = []

    def factory() -> tuple[FakeProcess, ...]:
        seen.append(os.environ.get(prestart.BIND_ENV))
        return (FakeProcess(),)

    prestart.register("one", factory)
    prestart.register("two", factory)
    prestart.join_lane(tmp_path, "gw0")
    _peer(tmp_path, "gw1", engines=1)
    prestart.bind_lane("1")
    prestart.take("one")
    _peer(tmp_path, "gw1", done=True)  # the other lane's tests are over: all cores
    prestart.take("two")
    assert seen == ["1", None]
    assert os.environ[prestart.BIND_ENV] == "1"  # this lane's other launches stay bound


class FakeServer(FakeProcess):
    def __init__(self, url: str = "http://127.0.0.1:1") -> None:
        super().__init__()
        self.url = url


def test_a_lane_borrows_the_reference_another_lane_serves(bookkeeping, tmp_path):
    prestart.join_lane(tmp_path, "gw1")
    _peer(tmp_path, "gw0", engines=1, serves={"ref": "http://127.0.0.1:4242"})
    made: list[FakeServer] = []
    prestart.register(
        "ref", lambda: (made.append(FakeServer()) or made[-1],), scope="session", borrow=FakeServer
    )
    (ref,) = prestart.take("ref")
    assert ref.url == "http://127.0.0.1:4242" and made == []  # nothing launched here
    assert json.loads((tmp_path / "gw1").read_text())["engines"] == 0  # nor counted twice


def test_the_lane_serving_the_reference_keeps_it_while_another_lane_needs_it(bookkeeping, tmp_path):
    prestart.join_lane(tmp_path, "gw0")
    prestart.register(
        "ref", lambda: (FakeServer("http://127.0.0.1:4242"),), scope="session", borrow=FakeServer
    )
    items = [FakeItem("m1.py::a", ["ref"]), FakeItem("m2.py::a")]
    prestart.plan(items)  # launched at once, and served
    mine = json.loads((tmp_path / "gw0").read_text())
    assert mine["serves"] == {"ref": "http://127.0.0.1:4242"} and mine["needs"] == ["ref"]
    (ref,) = prestart.take("ref")
    _peer(tmp_path, "gw1", needs=["ref"])
    prestart.release_after(items[0])  # this lane's last user: the other lane still needs it
    assert ref.stops == 0 and json.loads((tmp_path / "gw0").read_text())["engines"] == 1
    _peer(tmp_path, "gw1", needs=[])
    prestart.release_after(items[1])  # no lane needs it: stopped
    assert ref.stops == 1 and json.loads((tmp_path / "gw0").read_text())["serves"] == {}


def test_the_serving_lane_waits_at_its_end_until_no_lane_needs_the_reference(bookkeeping, tmp_path):
    prestart.join_lane(tmp_path, "gw0")
    prestart.register(
        "ref", lambda: (FakeServer("http://127.0.0.1:4242"),), scope="session", borrow=FakeServer
    )
    items = [FakeItem("m1.py::a", ["ref"])]
    prestart.plan(items)
    (ref,) = prestart.take("ref")
    _peer(tmp_path, "gw1", needs=["ref"])
    prestart.release_after(items[0])
    assert ref.stops == 0
    release = threading.Timer(0.5, _peer, (tmp_path, "gw1"))
    release.start()
    started = time.monotonic()
    prestart.stop_untaken()  # the session's end: waits for the other lane, then stops it
    assert time.monotonic() - started >= 0.5 and ref.stops == 1
    release.join()
