"""The suite's two lanes: pytest-xdist workers (``-n 2`` in pyproject.toml) that each run their
share of the tests, with their engines bound to a core of their own.

Why: on CI's 2 cores one engine computing with two OpenMP threads is only ~15% faster than
with one (test_tail_reuse + test_store_freshness: 151 s on two threads, 173 s bound to one
core), so two lanes of one core each do nearly twice the work; and starts, sleeps and waits of
one lane overlap the other's tests.

* **Which lane** (:func:`lane_of`): the unit tests (while the servers start), the keyed package
  and every test of the kvbranch server run in the kvbranch lane; the keyed P/D pair's modules,
  the modules with servers of their own and the cluster in the other (the longer lane: its
  servers start one after the other, within the memory budget). Each lane starts only its own
  servers, but for the plain vLLM reference, which one lane serves to both.
* **How the tests get there**: a worker writes each collected test's lane to the run's lanes
  directory (:func:`write`); the controller's :class:`LaneScheduling` sends each lane, whole
  and in collection order, to one worker. (pytest-xdist's ``loadgroup`` cannot: it renames a
  test's node id, which pytest 9 computes.)
* **Memory**: the lanes count their engines against one budget through the same directory
  (:func:`tests.prestart.join_lane`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from xdist.scheduler import LoadScopeScheduling

from tests import prestart

LANES = ("kvbranch", "others")
#: The run's lanes directory, made by the controller and inherited by the workers.
LANES_DIR_ENV = "KVBRANCH_TEST_LANES_DIR"
_MAP = "lanes.json"


def lane_of(item: Any) -> str:
    if not prestart.is_integration(item):
        return LANES[0]  # the unit tests: while this lane's servers start
    if {"keyed_server", "kvbranch_server"} & set(item.fixturenames):
        return LANES[0]
    return LANES[1]


def cores_of(lane: str, cpus: list[int]) -> str | None:
    """The CPUs of ``cpus`` that ``lane``'s engines are bound to (vLLM's
    ``VLLM_CPU_OMP_THREADS_BIND``): an equal share; None where there are fewer CPUs than lanes."""
    if len(cpus) < len(LANES):
        return None
    share = len(cpus) // len(LANES)
    start = LANES.index(lane) * share
    return ",".join(str(cpu) for cpu in sorted(cpus)[start : start + share])


def write(directory: Path, items: list[Any], worker: str) -> None:
    """Each collected test's lane, for the controller's scheduler (every worker collects the
    same tests and writes the same map; the last one written stands)."""
    tmp = directory / f"{_MAP}.{worker}"
    tmp.write_text(json.dumps({item.nodeid: lane_of(item) for item in items}))
    os.replace(tmp, directory / _MAP)


class LaneScheduling(LoadScopeScheduling):
    """pytest-xdist's scope scheduling with a lane as the scope: each lane is one unit of work,
    sent whole to one worker, its tests in collection order."""

    def __init__(self, config: Any, log: Any = None, directory: Path | None = None) -> None:
        super().__init__(config, log)
        self._directory = directory or Path(os.environ[LANES_DIR_ENV])
        self._lanes: dict[str, str] | None = None

    def _split_scope(self, nodeid: str) -> str:
        if self._lanes is None:  # read once every worker has collected (and so written it)
            self._lanes = json.loads((self._directory / _MAP).read_text())
        return self._lanes.get(nodeid, LANES[1])
