"""vLLM started by its own CLI: the plugin's settings read from the kv-transfer-config
(server/plugin/vllm_serve.py) and the control socket both sides find by the engine id
(server/common/control_path.py). Pure logic: vLLM's parsed arguments are stood in for by a
namespace with the same fields (tests/integration/test_vllm_serve.py runs the real CLI)."""

from __future__ import annotations

import os
import stat
from types import SimpleNamespace

import pytest

from server.common.control_path import default_control_socket, runtime_dir
from server.common.env import (
    ENV_ADVERTISE_URL,
    ENV_CLUSTER_NAME,
    ENV_CONTROL_SOCKET,
    ENV_INDEX_URL,
    ENV_ROLE,
)
from server.connector.config import ConnectorConfigError
from server.plugin.vllm_serve import (
    VllmServeConfigError,
    apply_kv_transfer_config,
    environment,
    find_kvbranch,
)

LAUNCHER_ENV = (ENV_CONTROL_SOCKET, ENV_ROLE, ENV_INDEX_URL, ENV_CLUSTER_NAME, ENV_ADVERTISE_URL)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    """No launcher environment, no keys, and a private runtime directory of the test's own."""
    for name in (*LAUNCHER_ENV, "VLLM_API_KEY"):
        monkeypatch.setenv(name, "")  # recorded: what apply sets is undone after the test
        monkeypatch.delenv(name)
    runtime = tmp_path / "run"
    runtime.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))


def kvbranch(extra=None, **fields):
    return {"kv_connector": "KVBranchConnector", "kv_connector_extra_config": extra or {}, **fields}


def args_with(kv_transfer_config, api_key=None):
    """vLLM's parsed arguments as far as the plugin reads them."""
    return SimpleNamespace(kv_transfer_config=kv_transfer_config, api_key=api_key)


def top(connector="KVBranchConnector", extra=None, kv_role="kv_both", engine_id="e-1"):
    """A ``KVTransferConfig`` (attributes, as vLLM's parser gives it)."""
    return SimpleNamespace(
        kv_connector=connector,
        kv_connector_extra_config=extra or {},
        kv_role=kv_role,
        engine_id=engine_id,
    )


def pd(kvbranch_child, kv_role="kv_both"):
    nixl = {"kv_connector": "VerifiedNixlConnector", "kv_connector_extra_config": {}}
    return top("KVBranchPDConnector", {"connectors": [nixl, kvbranch_child]}, kv_role)


def test_single_instance_gets_socket_role_and_nothing_else():
    env = environment(args_with(top(extra={"host_store_bytes": 1 << 20})))
    assert env == {ENV_CONTROL_SOCKET: default_control_socket("e-1"), ENV_ROLE: "single"}
    assert os.path.dirname(env[ENV_CONTROL_SOCKET]) == runtime_dir()


def test_launcher_settings_in_the_extra_config_reach_the_plugin():
    extra = {
        "control_socket": "/private/c.sock",
        "role": "decode",
        "index_url": "redis://127.0.0.1:6379/0",
        "cluster_name": "blue",
        "advertise_url": "http://10.0.0.7:8000",
    }
    assert environment(args_with(top(extra=extra))) == {
        ENV_CONTROL_SOCKET: "/private/c.sock",
        ENV_ROLE: "decode",
        ENV_INDEX_URL: "redis://127.0.0.1:6379/0",
        ENV_CLUSTER_NAME: "blue",
        ENV_ADVERTISE_URL: "http://10.0.0.7:8000",
    }


def test_pd_child_is_found_under_the_composing_connector():
    env = environment(args_with(pd(kvbranch({"role": "prefill"}))))
    assert env[ENV_ROLE] == "prefill"
    # a MultiConnector's child runs under its parent's engine id (unless it names its own)
    assert env[ENV_CONTROL_SOCKET] == default_control_socket("e-1")
    own = environment(args_with(pd(kvbranch(engine_id="child"))))
    assert own[ENV_CONTROL_SOCKET] == default_control_socket("child")


@pytest.mark.parametrize(
    "kv_role, role", [("kv_producer", "prefill"), ("kv_consumer", "decode"), ("kv_both", "single")]
)
def test_role_from_kv_role_when_the_config_names_none(kv_role, role):
    assert environment(args_with(pd(kvbranch(), kv_role=kv_role)))[ENV_ROLE] == role
    named = environment(args_with(pd(kvbranch({"role": "single"}), kv_role=kv_role)))
    assert named[ENV_ROLE] == "single"  # the config's own key wins


@pytest.mark.parametrize(
    "config",
    [None, top("NixlConnector"), top("MultiConnector", {"connectors": "not a list"})],
)
def test_no_kvbranch_connector_sets_nothing(config):
    assert environment(args_with(config)) == {}
    assert apply_kv_transfer_config(args_with(config)) == {}


def test_a_config_that_nests_itself_ends():
    loop: dict = {"kv_connector": "MultiConnector", "kv_connector_extra_config": {}}
    loop["kv_connector_extra_config"]["connectors"] = [loop]
    assert find_kvbranch(loop) is None


@pytest.mark.parametrize(
    "extra, word",
    [
        ({"rol": "prefill"}, "unknown key 'rol'"),
        ({"role": "router"}, "role"),
        ({"index_url": "http://x"}, "index_url"),
        ({"advertise_url": "10.0.0.7:8000"}, "advertise_url"),
        ({"cluster_name": ""}, "cluster_name"),
    ],
)
def test_bad_keys_stop_the_plugin_with_their_names(extra, word):
    with pytest.raises(ConnectorConfigError, match=word):
        environment(args_with(top(extra=extra)))


def test_keys_without_tenants_are_refused(monkeypatch):
    with pytest.raises(VllmServeConfigError, match='"tenants": true'):
        environment(args_with(top(), api_key=["k1"]))
    monkeypatch.setenv("VLLM_API_KEY", "k2")  # vLLM's other way to give a key
    with pytest.raises(VllmServeConfigError):
        environment(args_with(top()))
    assert environment(args_with(top(extra={"tenants": True})))[ENV_ROLE] == "single"


def test_data_parallel_ranks_share_the_first_engines_path():
    first = default_control_socket("abc")
    assert default_control_socket("abc_dp3") == first
    assert default_control_socket("abd") != first
    with pytest.raises(ValueError):
        default_control_socket("")


def test_engine_core_makes_a_private_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "fresh"))
    (tmp_path / "fresh").mkdir(mode=0o700)
    path = default_control_socket("e", create=True)
    info = os.stat(os.path.dirname(path))
    assert stat.S_IMODE(info.st_mode) & 0o077 == 0
    for odd in ("relative/dir", str(tmp_path / "missing")):  # not systemd's: the temp folder
        monkeypatch.setenv("XDG_RUNTIME_DIR", odd)
        assert runtime_dir().endswith(f"kvbranch-{os.getuid()}")


def test_apply_fills_what_the_launcher_did_not_set(monkeypatch):
    os.makedirs(runtime_dir(), mode=0o700)
    monkeypatch.setenv(ENV_ROLE, "decode")  # the launcher's, wins
    added = apply_kv_transfer_config(args_with(top(extra={"role": "prefill"})))
    assert added == {ENV_CONTROL_SOCKET: default_control_socket("e-1")}
    assert os.environ[ENV_CONTROL_SOCKET] == default_control_socket("e-1")
    assert os.environ[ENV_ROLE] == "decode"


def test_apply_refuses_a_socket_directory_others_can_reach(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o755)
    extra = {"control_socket": str(folder / "c.sock")}
    with pytest.raises(PermissionError, match="not private"):
        apply_kv_transfer_config(args_with(top(extra=extra)))
    assert ENV_CONTROL_SOCKET not in os.environ
