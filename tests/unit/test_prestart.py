"""tests/prestart.py's release rule: a shared server is stopped right after the last collected
test that uses it, and not before (pure bookkeeping over stand-in items and processes)."""

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

    def stop(self) -> None:
        self.stops += 1


@pytest.fixture
def bookkeeping(monkeypatch):
    for name in ("_factories", "_launched", "_held", "_last_user"):
        monkeypatch.setattr(prestart, name, {})


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
