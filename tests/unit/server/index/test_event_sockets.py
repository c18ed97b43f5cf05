"""KV events stay on the machine unless the operator opts in (server/index/event_sockets.py and the
launcher's check in server/launcher/cli.py): vLLM's KV-event socket has no authentication and the
events carry every tenant's token ids."""

from __future__ import annotations

import json

import pytest

from server.index.event_sockets import exposed_endpoints, is_private
from server.launcher.cli import plan_launch
from server.launcher.settings import LaunchError, build_parser


@pytest.fixture(autouse=True)
def private_tmp(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # plan_launch's socket directories


def config(**fields: object) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", **fields})


@pytest.mark.parametrize(
    "endpoint",
    [
        "ipc:///run/kvb/events.sock",
        "inproc://events",
        "tcp://127.0.0.1:5557",
        "tcp://127.1.2.3:5557",
        "tcp://[::1]:5557",
        "tcp://localhost:5557",
        "tcp://LOCALHOST:5557",
        "tcp://eth0;127.0.0.1:5557",
    ],
)
def test_local_endpoints_are_private(endpoint: str) -> None:
    assert is_private(endpoint)


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://*:5557",
        "tcp://0.0.0.0:5557",
        "tcp://[::]:5557",
        "tcp://10.0.0.5:5557",
        "tcp://indexer.example:5557",
        "tcp://eth0:5557",  # zmq binds to an interface by name
        "tcp://127.0.0.1;10.0.0.9:5557",  # the destination decides, not the source
        "pgm://eth0;239.192.1.1:5555",
        "ws://0.0.0.0:5557",
        "5557",
        "",
    ],
)
def test_anything_else_is_exposed(endpoint: str) -> None:
    assert not is_private(endpoint)


@pytest.mark.parametrize(
    ("passthrough", "expected"),
    [
        ([], []),
        (["--kv-events-config", config(endpoint="ipc:///x/e.sock")], []),
        (["--kv-events-config", config(endpoint="tcp://*:5557")], ["tcp://*:5557"]),
        (["--kv-events-config=" + config(endpoint="tcp://*:5557")], ["tcp://*:5557"]),
        (["--kv_events_config", config(endpoint="tcp://0.0.0.0:1")], ["tcp://0.0.0.0:1"]),
        # no endpoint: vLLM's default listens on every interface
        (["--kv-events-config", config()], ["tcp://*:5557"]),
        # the replay socket always binds
        (
            [
                "--kv-events-config",
                config(endpoint="ipc:///x/e", replay_endpoint="tcp://*:5558"),
            ],
            ["tcp://*:5558"],
        ),
        # events off: nothing is published
        (["--kv-events-config", json.dumps({"endpoint": "tcp://*:5557"})], []),
        (["--kv-events-config", config(publisher="null")], []),
        # vLLM's dotted form, alone or over a JSON value
        (["--kv-events-config.enable_kv_cache_events", "true"], ["tcp://*:5557"]),
        (
            [
                "--kv-events-config",
                config(endpoint="ipc:///x/e"),
                "--kv-events-config.endpoint=tcp://*:6000",
            ],
            ["tcp://*:6000"],
        ),
        # the last JSON value wins, as in vLLM's parser
        (
            [
                "--kv-events-config",
                config(endpoint="tcp://*:5557"),
                "--kv-events-config",
                config(endpoint="ipc:///x/e"),
            ],
            [],
        ),
    ],
)
def test_exposed_endpoints_read_the_flags_as_vllm_does(
    passthrough: list[str], expected: list[str]
) -> None:
    assert exposed_endpoints(passthrough) == expected


def plan(model_dir, *ours: str, passthrough: tuple[str, ...] = ()):
    args = build_parser().parse_args(["--model", str(model_dir), *ours])
    return plan_launch(args, list(passthrough), cuda=False)


def test_the_launcher_refuses_a_wildcard_kv_events_socket_without_the_opt_in(model_dir) -> None:
    wildcard = ("--kv-events-config", config(endpoint="tcp://*:5557"))
    with pytest.raises(LaunchError, match=r"tcp://\*:5557.*--allow-remote-kv-events"):
        plan(model_dir, "--index", "redis://127.0.0.1:6379/0", passthrough=wildcard)
    with pytest.raises(LaunchError, match="every tenant's token ids"):
        plan(model_dir, passthrough=wildcard)  # with or without an index
    p = plan(model_dir, "--allow-remote-kv-events", passthrough=wildcard)
    assert p.vllm_argv[p.vllm_argv.index("--kv-events-config") + 1] == wildcard[1]


def test_the_launchers_own_kv_events_and_a_loopback_one_pass(model_dir) -> None:
    p = plan(model_dir, "--index", "redis://127.0.0.1:6379/0")
    own = json.loads(p.vllm_argv[p.vllm_argv.index("--kv-events-config") + 1])
    assert own["endpoint"].startswith("ipc://") and own["replay_endpoint"].startswith("ipc://")
    loopback = (
        "--kv-events-config",
        config(endpoint="ipc:///x/e", replay_endpoint="tcp://127.0.0.1:5558"),
    )
    plan(model_dir, "--index", "redis://127.0.0.1:6379/0", passthrough=loopback)
