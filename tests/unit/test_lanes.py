"""tests/lanes.py: which lane a test runs in, the cores each lane's engines are bound to, and
the controller's scheduler sending each lane whole to one worker (stand-in items)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests import lanes


@dataclass
class FakeItem:
    nodeid: str
    fspath: str
    fixturenames: list[str] = field(default_factory=list)


ITEMS = [
    FakeItem("tests/unit/test_a.py::t", "/r/tests/unit/test_a.py", ["kvbranch_server"]),
    FakeItem(
        "tests/integration/test_b.py::t", "/r/tests/integration/test_b.py", ["kvbranch_server"]
    ),
    FakeItem(
        "tests/integration/keyed/c.py::t", "/r/tests/integration/keyed/c.py", ["keyed_server"]
    ),
    FakeItem("tests/integration/test_d.py::t", "/r/tests/integration/test_d.py", ["keyed_pd"]),
]


def test_unit_kvbranch_and_keyed_servers_tests_share_a_lane_and_the_rest_the_other():
    assert [lanes.lane_of(item) for item in ITEMS] == ["kvbranch", "kvbranch", "kvbranch", "others"]


def test_each_lane_is_bound_to_its_share_of_the_cpus():
    assert [lanes.cores_of(lane, [0, 1]) for lane in lanes.LANES] == ["0", "1"]
    assert [lanes.cores_of(lane, [3, 2, 1, 0]) for lane in lanes.LANES] == ["0,1", "2,3"]
    assert lanes.cores_of("others", [0]) is None  # one CPU: vLLM's own binding


class ControllerConfig:
    """What pytest-xdist's scheduler reads of the controller's config under ``-n 2``."""

    def getvalue(self, name: str) -> list[str]:
        assert name == "tx"
        return ["2*popen"]


def test_the_scheduler_takes_each_lane_as_one_unit_of_work(tmp_path):
    lanes.write(tmp_path, ITEMS, "gw0")
    scheduler = lanes.LaneScheduling(ControllerConfig(), directory=tmp_path)
    scopes = [scheduler._split_scope(item.nodeid) for item in ITEMS]
    assert scopes == ["kvbranch", "kvbranch", "kvbranch", "others"]
