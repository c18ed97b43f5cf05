"""Shared fixtures: the real kvbranch server (real vLLM, real model, real connector), started
once per test session and stopped with all its child processes at the end. The unit tests run
first; the shared servers the collected integration tests need start meanwhile
(:mod:`tests.prestart`).

``kvbranch_server`` — connector on; small device KV cache (0.5 GiB) and host store (0.25 GiB,
about 45 blocks of 128 tokens; pin budget 0.05 GiB, 9 blocks) so that eviction and pin-budget
behaviour is reachable in tests with short prompts;
``VLLM_SERVER_DEV_MODE=1`` so tests can drop the device prefix cache (``POST
/reset_prefix_cache``) and make the host store the only source.
``plain_server`` — vLLM's own server with no kvbranch code on its request path (no plugin,
no middleware, no connector; :mod:`tests.vanilla_vllm`), configured like the others: the
reference for greedy outputs.
(``no_connector_server``, kvbranch's launcher with ``--no-connector``, is test_server.py's own.)
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests import lanes, prestart
from tests.redis_server import RedisServer
from tests.server_process import ServerProcess

KVBRANCH_ARGS = [
    "--kv-cache-gib",
    "0.5",
    "--host-store-gib",
    "0.25",
    "--pin-budget-gib",
    "0.05",
    "--max-model-len",
    "4096",
]


kvbranch_server = prestart.fixture(
    "kvbranch_server", lambda: (ServerProcess(KVBRANCH_ARGS, name="kvbranch"),)
)


PLAIN_ARGS = ["--kv-cache-gib", "0.5", "--max-model-len", "4096", "--no-connector"]


class VanillaVLLM(ServerProcess):
    """vLLM's own server (``python -m tests.vanilla_vllm``), started and stopped like ours."""

    module = "tests.vanilla_vllm"


class BorrowedVLLM(VanillaVLLM):
    """The plain vLLM another lane runs (tests/lanes.py): one reference per run, not one per
    lane (a server is ~3 GB of CI's 24). Launched and stopped by that lane."""

    def __init__(self, url: str) -> None:
        super().__init__(PLAIN_ARGS, name="plain", port=int(url.rsplit(":", 1)[1]))

    def launch(self) -> BorrowedVLLM:
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError(f"the other lane's plain vLLM at {self.url} is not ready")

    def stop(self, timeout: float = 30.0) -> None:
        pass


def _plain_vllm() -> tuple[VanillaVLLM]:
    """In lanes, the reference serves both: one OpenMP thread on no core of its own (the
    scheduler puts it where a core is free) — bound to the launching lane's core, it queued
    behind that lane's engines while the other lane's core waited for its answers."""
    floating = {prestart.BIND_ENV: "nobind", "OMP_NUM_THREADS": "1"}
    env = floating if prestart.lanes_bound() else None
    return (VanillaVLLM(PLAIN_ARGS, name="plain", env=env),)


plain_vllm = prestart.fixture("plain_vllm", _plain_vllm, borrow=BorrowedVLLM)


@pytest.fixture(scope="session")
def plain_server(plain_vllm):
    # the reference has none of kvbranch's routes (nor, so, its plugin)
    r = httpx.get(f"{plain_vllm.url}/v1/kvbranch/health", timeout=30)
    assert r.status_code == 404, f"the vLLM reference serves kvbranch's routes: {r.text}"
    return plain_vllm


@pytest.fixture(scope="session")
def redis_server():
    """A real redis-server on a unix socket for the cluster index's tests. Missing is a failure,
    not a skip: CI installs it, and a skipped backend would pass untested."""
    if shutil.which("redis-server") is None:
        pytest.fail(
            "redis-server is not installed: run scripts/setup.sh as root "
            "(or apt-get install redis-server) for the cluster index tests"
        )
    with RedisServer() as server:
        yield server


#: Log lines that tell what a server was doing when a test failed (engine load, KV usage,
#: connector decisions, errors).
LOG_SIGNALS = ("Engine 000", "kvbranch:", "WARNING", "ERROR", "Traceback")
#: Start-up lines that match the signals and say nothing about the failure.
LOG_NOISE = ("Route:", "plugin", "SECURITY WARNING", "[vllm.py:", "[cpu.py:", "[base.py:")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test carries the log tails of the servers still running: CI keeps nothing else
    (the logs are in the runner's temporary directory)."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed:
        for server in list(ServerProcess.running):
            lines = server.log_tail(2000, LOG_SIGNALS).splitlines()
            lines = [line for line in lines if not any(word in line for word in LOG_NOISE)]
            report.sections.append(
                (f"log of server {server.name} ({server.url})", "\n".join(lines[-25:]))
            )


def _group(item: pytest.Item) -> int:
    """Where an integration test's module runs: with the keyed package's server, then with the
    kvbranch server (those that also use the keyed P/D pair last), then with the keyed P/D
    pair, then the modules with only servers of their own, then those marked ``alone`` — so
    that each group's shared servers are released (tests/prestart.py) before the next group's
    servers start."""
    if item.get_closest_marker("alone") is not None:
        return 5
    names = set(item.fixturenames)
    if "keyed_server" in names:
        return 0
    if "kvbranch_server" in names:
        return 2 if "keyed_pd_instances" in names else 1
    return 3 if "keyed_pd_instances" in names else 4


def pytest_collection_modifyitems(config, items):
    """Integration tests marked, and moved after the unit tests (a stable sort: each part keeps
    its order), so that the shared servers start while the unit tests run; the integration
    modules, each kept whole, ordered by :func:`_group`. In lanes (pytest-xdist), each lane's
    part of a module is grouped by what that part uses (test_server's no-connector test went
    first in the other lane, as its module's kvbranch tests do, and waited 223 s there for
    memory the keyed server held), and each test's lane is written for the controller
    (:mod:`tests.lanes`)."""
    worker = _workerinput(config)

    def part(item: pytest.Item) -> tuple[str, str]:
        return (lanes.lane_of(item) if worker else "", prestart.module_of(item))

    part_group: dict[tuple[str, str], int] = {}
    for item in items:
        if prestart.is_integration(item):
            item.add_marker(pytest.mark.integration)
            part_group[part(item)] = min(part_group.get(part(item), 9), _group(item))

    def order(item: pytest.Item) -> tuple[bool, int]:
        integration = prestart.is_integration(item)
        return integration, part_group[part(item)] if integration else 0

    items.sort(key=order)
    if worker is not None:
        lanes.write(Path(os.environ[lanes.LANES_DIR_ENV]), items, worker["workerid"])


def _workerinput(config: pytest.Config) -> dict | None:
    """What pytest-xdist gives a worker (its id, the run's id); None in the controller or in a
    run of one process."""
    return getattr(config, "workerinput", None)


def pytest_configure(config: pytest.Config) -> None:
    """The controller of a run in lanes makes the lanes' directory; its workers inherit it."""
    if _workerinput(config) is None and config.getoption("numprocesses", None):
        os.environ[lanes.LANES_DIR_ENV] = tempfile.mkdtemp(prefix="kvbranch-lanes-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _workerinput(config) is None and lanes.LANES_DIR_ENV in os.environ:
        shutil.rmtree(os.environ.pop(lanes.LANES_DIR_ENV), ignore_errors=True)


def pytest_xdist_make_scheduler(config: pytest.Config, log):
    return lanes.LaneScheduling(config, log)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    worker = _workerinput(session.config)
    if worker is None:  # one process runs everything: plan it all now
        prestart.plan(session.items)
        return
    # a lane learns which it is from the first test it is sent (pytest_runtest_setup); the
    # engine count is shared from now on, so that no lane launches as if it were alone
    prestart.join_lane(Path(os.environ[lanes.LANES_DIR_ENV]) / "engines", worker["workerid"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item):
    if prestart.lane_unplanned():
        lane = lanes.lane_of(item)
        chosen = prestart.BIND_ENV in os.environ  # the user's binding is left alone
        prestart.bind_lane(None if chosen else lanes.cores_of(lane, list(os.sched_getaffinity(0))))
        prestart.plan([i for i in item.session.items if lanes.lane_of(i) == lane])
    yield
    prestart.launch_ahead(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    yield
    prestart.release_after(item)


def pytest_sessionfinish(session: pytest.Session) -> None:
    prestart.stop_untaken()
    prestart.leave_lane()
