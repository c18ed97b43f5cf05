"""The connectors' typed configs: defaults written once, unknown keys refused, the launcher's
dict parsed back to what it built."""

from __future__ import annotations

import json

import pytest

from server.connector.config import (
    DEFAULT_HOST_STORE_BYTES,
    ConnectorConfig,
    ConnectorConfigError,
    NixlChildConfig,
)
from server.connector.core.branches import (
    DEFAULT_IDLE_TTL_S,
    DEFAULT_MAX_BRANCHES_PER_SESSION,
    DEFAULT_MAX_SESSIONS_PER_TENANT,
)
from server.connector.pd.hold_registry import CLAIM_MARGIN_S


def test_defaults():
    for extra in (None, {}):
        c = ConnectorConfig.from_extra(extra)
        assert c.host_store_bytes == DEFAULT_HOST_STORE_BYTES
        assert c.pin_budget == DEFAULT_HOST_STORE_BYTES // 2  # half the store
        assert c.pin_ttl_s == 300.0
        assert c.control_socket is None
        assert c.tenants is False
        assert c.max_sessions_per_tenant == DEFAULT_MAX_SESSIONS_PER_TENANT
        assert c.max_branches_per_session == DEFAULT_MAX_BRANCHES_PER_SESSION
        assert c.tenant_pin_share == 1.0
        assert c.session_idle_ttl_s == DEFAULT_IDLE_TTL_S
    n = NixlChildConfig.from_extra(None)
    assert n.nixl_progress_thread is False
    assert n.claim_ttl_s == 30.0
    assert n.decoder_kv_blocks_ttl == 480  # upstream NixlConnector's default
    assert n.pull_timeout_s == CLAIM_MARGIN_S


def test_pin_budget_default_follows_the_store():
    assert ConnectorConfig(host_store_bytes=100).pin_budget == 50
    assert ConnectorConfig(host_store_bytes=100, pin_budget_bytes=7).pin_budget == 7


def test_unknown_key_is_a_clear_error():
    with pytest.raises(ConnectorConfigError) as e:
        ConnectorConfig.from_extra({"pin_tll_s": 5})
    text = str(e.value)
    assert "unknown key 'pin_tll_s'" in text
    assert "KVBranchConnector" in text and "pin_ttl_s" in text  # the known keys are listed


@pytest.mark.parametrize(
    "extra",
    [
        {"host_store_bytes": -1},
        {"tenant_pin_share": 2.0},
        {"pin_ttl_s": "soon"},
        {"max_sessions_per_tenant": 0},
    ],
)
def test_bad_values_name_the_key(extra):
    with pytest.raises(ConnectorConfigError, match=next(iter(extra))):
        ConnectorConfig.from_extra(extra)


def test_strings_parse_as_their_type():
    """JSON from a hand-written --kv-transfer-config: "false" is False (bool("false") was True)."""
    c = ConnectorConfig.from_extra({"tenants": "false", "pin_ttl_s": "12"})
    assert c.tenants is False and c.pin_ttl_s == 12.0


def test_round_trip_through_json():
    c = ConnectorConfig(host_store_bytes=1 << 20, pin_ttl_s=12.0, control_socket="/x/c.sock")
    extra = json.loads(json.dumps(c.to_extra()))
    assert "pin_budget_bytes" not in extra  # None is left out: the default resolves on read
    assert ConnectorConfig.from_extra(extra) == c


def test_nixl_child_passes_upstream_keys_through():
    n = NixlChildConfig(decoder_kv_blocks_ttl=60, bidirectional_kv_xfer=True, backends=["UCX"])
    extra = n.to_extra()
    assert extra["bidirectional_kv_xfer"] is True and extra["backends"] == ["UCX"]
    assert NixlChildConfig.from_extra(extra).decoder_kv_blocks_ttl == 60
    with pytest.raises(ConnectorConfigError, match="claim_ttl_s"):
        NixlChildConfig.from_extra({"claim_ttl_s": 0})


@pytest.mark.parametrize("role", ["both", "prefill"])
def test_launcher_dicts_parse(model_dir, tmp_path, monkeypatch, role):
    """What server/launcher/cli.py writes is what the connectors read back (P/D: each child's
    dict)."""
    from server.launcher.cli import plan_launch
    from server.launcher.settings import build_parser

    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    argv = ["--model", str(model_dir), "--pin-ttl-s", "12"]
    if role != "both":
        argv += ["--role", role]
    plan = plan_launch(build_parser().parse_args(argv), [], cuda=False)
    flag = plan.vllm_argv.index("--kv-transfer-config")
    config = json.loads(plan.vllm_argv[flag + 1])
    if role == "both":
        kvbranch, nixl = config, None
    else:
        nixl, kvbranch = config["kv_connector_extra_config"]["connectors"]
    c = ConnectorConfig.from_extra(kvbranch["kv_connector_extra_config"])
    assert c.pin_ttl_s == 12.0 and c.control_socket == plan.control_socket
    assert c.to_extra() == kvbranch["kv_connector_extra_config"]
    if nixl is not None:
        n = NixlChildConfig.from_extra(nixl["kv_connector_extra_config"])
        assert n.model_extra == {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0}
