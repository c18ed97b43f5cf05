"""The KV-event endpoint plugin: vLLM's real publisher of a data-parallel engine past 0 binds its
``ipc://`` sockets beside engine 0's (vLLM alone refuses to start it)."""

from __future__ import annotations

from pathlib import Path

import pytest
from vllm.distributed.kv_events import ZmqEventPublisher

from server.engine import event_endpoints


@pytest.fixture
def restore_offset():
    """vLLM's own offset for the test (the plugin may have run in this process already: vLLM
    loads its general plugins once per process), the process's one again after it."""
    current = ZmqEventPublisher.__dict__["offset_endpoint_port"]
    vllms = getattr(current.__func__, "__wrapped__", current.__func__)
    ZmqEventPublisher.offset_endpoint_port = staticmethod(vllms)
    yield
    ZmqEventPublisher.offset_endpoint_port = current


def publisher(folder: Path, rank: int) -> ZmqEventPublisher:
    return ZmqEventPublisher(
        rank,
        endpoint=f"ipc://{folder}/events.sock",
        replay_endpoint=f"ipc://{folder}/replay.sock",
        topic="kvbranch",
    )


def test_vllm_alone_cannot_start_engine_1_on_ipc(tmp_path, restore_offset):
    with pytest.raises(ValueError, match="inproc' or 'tcp"):
        publisher(tmp_path, 1)


def test_each_engine_binds_its_own_sockets_in_the_same_folder(tmp_path, restore_offset):
    assert event_endpoints.install()
    engines = [publisher(tmp_path, rank) for rank in (0, 1)]
    try:
        configs = [p.get_publisher_config() for p in engines]
        assert [c.endpoint for c in configs] == [
            f"ipc://{tmp_path}/events.sock",
            f"ipc://{tmp_path}/events.sock_dp1",
        ]
        assert configs[1].replay_endpoint == f"ipc://{tmp_path}/replay.sock_dp1"
        assert {p.name for p in tmp_path.iterdir()} == {
            "events.sock",
            "replay.sock",
            "events.sock_dp1",
            "replay.sock_dp1",
        }
    finally:
        for p in engines:
            p.shutdown()


def test_tcp_and_inproc_keep_vllms_offsets(restore_offset):
    event_endpoints.install()
    offset = ZmqEventPublisher.offset_endpoint_port
    assert offset("tcp://127.0.0.1:5557", 2) == "tcp://127.0.0.1:5559"
    assert offset("inproc://cache", 1) == "inproc://cache_dp1"
    assert offset("ipc:///run/x.sock", 0) == "ipc:///run/x.sock"
    assert offset(None, 1) is None


def test_install_twice_wraps_once(restore_offset):
    event_endpoints.install()
    first = ZmqEventPublisher.__dict__["offset_endpoint_port"]
    assert event_endpoints.install()
    assert ZmqEventPublisher.__dict__["offset_endpoint_port"] is first
