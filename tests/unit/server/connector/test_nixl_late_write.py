"""Why a pull given up keeps its blocks pinned (``server/connector/pd/late_reads.py``), kept
measured against the NIXL this project installs: releasing a read in flight does not stop it,
and ``LateReads`` reports a given-up read ended only once NIXL wrote all it will write."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("nixl._api")

PROBE = Path(__file__).with_name("nixl_late_write.py")
ROOT = Path(__file__).resolve().parents[4]


def _probe() -> dict:
    # Over TCP a read needs the peer's progress; the launcher's one-box transports are these.
    env = dict(os.environ, UCX_TLS="tcp,self", PYTHONPATH=str(ROOT))
    done = subprocess.run(
        [sys.executable, str(PROBE)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def probe() -> dict:
    return _probe()


def test_a_released_read_still_writes_once_its_peer_progresses(probe):
    assert probe["wired"] == "DONE"
    assert probe["state_at_release"] == "PROC" and probe["before_release"] == 0
    assert probe["after_release"] == probe["size"]  # NIXL said "released"; it wrote anyway


def test_a_given_up_read_is_reported_ended_only_after_its_last_write(probe):
    assert probe["given_up"] == {"r": [1, 2]} and probe["in_flight_while_paused"] == 1
    assert probe["ended"] == ["r"]
    assert probe["written_when_ended"] == probe["size"] and probe["written_later"] == 0
