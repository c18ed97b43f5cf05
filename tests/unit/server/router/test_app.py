"""The assembled app: its lifespan sweeps the index on a timer."""

from __future__ import annotations

import time

from starlette.testclient import TestClient

from server.router.app import build_app
from tests.unit.server.router.fakes import D, Fakes, make_router, put


def test_the_app_sweeps_the_index_on_a_timer_without_any_read():
    router = make_router(Fakes(), ttl=0.05)
    with TestClient(build_app(router)):
        put(router, ("t", "s", "main"), D, "x", {"remote_num_tokens": 5})
        deadline = time.monotonic() + 5
        while router.index.counters()["entries"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert router.index.counters()["entries"] == 0, "expired entry never swept"
