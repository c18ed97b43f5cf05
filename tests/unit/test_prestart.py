"""tests/prestart.py's rules: a server is stopped right after the last collected test that uses
it, and not before; a module's own servers launch while the module before it runs, within the
engine budget (pure bookkeeping over stand-in items and processes)."""

from __future__ import annotations

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
    for name in ("_shared", "_launched", "_held", "_last_user", "_ahead"):
        monkeypatch.setattr(prestart, name, {})
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
