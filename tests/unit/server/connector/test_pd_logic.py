"""Pure logic of prefill/decode: the token-prefix check, launcher helpers (the router's index:
tests/unit/server/index/)."""

from __future__ import annotations

import argparse

import pytest

from server.connector.pd.transfer_params import verified_prefix
from server.launcher.cli import LaunchError, build_parser, pd_environment, pd_transfer_config
from server.router.launch import instance_argv, router_ttl, split_cores


def test_verified_prefix_stops_at_the_first_different_token():
    assert verified_prefix([1, 2, 3, 4, 5], [1, 2, 3, 9, 5, 6]) == 3


def test_verified_prefix_leaves_the_last_prompt_token_to_compute():
    assert verified_prefix([1, 2, 3, 4], [1, 2, 3, 4]) == 3
    assert verified_prefix([1, 2, 3, 4, 5, 6], [1, 2, 3, 4]) == 3


def test_verified_prefix_without_token_ids_pulls_nothing():
    assert verified_prefix(None, [1, 2, 3]) == 0
    assert verified_prefix("1,2,3", [1, 2, 3]) == 0
    assert verified_prefix([1, 2], []) == 0


def test_instance_argv_removes_cluster_flags_only():
    argv = [
        "--disagg",
        "--port",
        "9000",
        "--kv-cache-gib",
        "0.5",
        "--role=router",
        "--cpu-cores",
        "0",
        "--api-key",
        "k",
    ]
    assert instance_argv(argv) == ["--kv-cache-gib", "0.5", "--api-key", "k"]


def test_split_cores():
    assert split_cores(2) == ("0", "1")
    assert split_cores(8) == ("0-3", "4-7")
    assert split_cores(3) == ("0", "1-2")
    with pytest.raises(LaunchError):
        split_cores(1)


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(list(argv))


def test_pd_transfer_config_composes_nixl_first_and_recomputes_on_failure():
    kvb = {"kv_connector": "KVBranchConnector"}
    cfg = pd_transfer_config(_args("--role", "prefill"), kvb)
    assert cfg["kv_connector"] == "KVBranchPDConnector"
    assert cfg["kv_load_failure_policy"] == "recompute"
    first, second = cfg["kv_connector_extra_config"]["connectors"]
    assert first["kv_connector"] == "VerifiedNixlConnector" and second is kvb
    assert first["kv_connector_extra_config"]["bidirectional_kv_xfer"] is True
    base = pd_transfer_config(_args("--role", "decode", "--no-bidirectional"), None)
    assert base["kv_connector"] == "VerifiedNixlConnector"
    assert base["kv_connector_extra_config"]["bidirectional_kv_xfer"] is False


def test_both_p_d_kinds_pace_nixls_progress_thread_unless_told_not_to():
    # a peer's read is served during a forward, for kvbranch P/D and its upstream baseline alike
    kvb = {"kv_connector": "KVBranchConnector"}
    ours = pd_transfer_config(_args("--role", "prefill"), kvb)
    nixl = ours["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]
    assert nixl["nixl_progress_delay_us"] == 1000
    base = pd_transfer_config(_args("--role", "prefill", "--no-bidirectional"), None)
    assert base["kv_connector_extra_config"]["nixl_progress_delay_us"] == 1000
    off = pd_transfer_config(_args("--role", "decode", "--nixl-progress-us", "0"), kvb)
    assert (
        off["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"][
            "nixl_progress_delay_us"
        ]
        == 0
    )
    with pytest.raises(SystemExit):
        _args("--role", "decode", "--nixl-progress-us", "-5")


def test_nixls_threads_are_watched_unless_asked_lowered_from_the_start():
    kvb = {"kv_connector": "KVBranchConnector"}

    def nixl(*argv: str) -> dict:
        cfg = pd_transfer_config(_args(*argv), kvb)
        return cfg["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"]

    assert nixl("--role", "prefill")["nixl_threads_lowered"] is False
    assert nixl("--role", "decode", "--nixl-threads", "lowered")["nixl_threads_lowered"] is True
    with pytest.raises(SystemExit):
        _args("--role", "decode", "--nixl-threads", "idle")


def test_pd_environment_ports_and_loopback_transport(monkeypatch):
    monkeypatch.delenv("UCX_TLS", raising=False)
    env = pd_environment(_args("--role", "decode", "--port", "8100"))
    assert env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "18100"
    assert env["UCX_TLS"] == "tcp,self,sm"
    with pytest.raises(LaunchError, match="--nixl-port"):
        pd_environment(_args("--role", "decode", "--port", "60000"))


def test_router_ttl_stays_below_the_decode_hold():
    assert router_ttl(_args("--pd-hold-ttl-s", "30")) == 25
    assert router_ttl(_args("--pd-hold-ttl-s", "4")) == 2
