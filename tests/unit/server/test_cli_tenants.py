"""Issue 13 items 7 and 8 in the launcher: tenancy turns on however the keys are given (or the
launcher refuses an ambiguous setup with one line), and the tenant quota flags reach the
connector."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from server.common.env import ENV_API_KEYS
from server.launcher.cli import main, plan_launch
from server.launcher.settings import LaunchError, build_parser


@pytest.fixture(autouse=True)
def no_env_key(monkeypatch, tmp_path):
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # plan_launch's socket directories
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.delenv(ENV_API_KEYS, raising=False)
    monkeypatch.delenv("KVBRANCH_PARENT_PID", raising=False)  # main() must not watch pytest


def plan(model_dir, *ours: str, passthrough: tuple[str, ...] = ()):
    args = build_parser().parse_args(["--model", str(model_dir), *ours])
    return plan_launch(args, list(passthrough), cuda=False)


def connector_extra(p) -> dict:
    config = json.loads(p.vllm_argv[p.vllm_argv.index("--kv-transfer-config") + 1])
    return config["kv_connector_extra_config"]


@pytest.mark.parametrize(
    "passthrough",
    [
        ("--api-key", "k1", "k2"),
        ("--api-key=k1", "--api-key", "k2"),
        ("--api_key", "k1", "k2"),
        ("--seed", "1", "--api-key", "k1", "k2"),
    ],
)
def test_keys_after_double_dash_turn_tenancy_on(model_dir, passthrough):
    p = plan(model_dir, passthrough=passthrough)
    assert p.env[ENV_API_KEYS].split(",")[-1] == "k2"
    assert connector_extra(p)["tenants"] is True


def test_vllm_api_key_env_turns_tenancy_on(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "envkey")
    p = plan(model_dir)
    assert p.env[ENV_API_KEYS] == "envkey"
    assert connector_extra(p)["tenants"] is True


def test_no_keys_no_tenancy(model_dir):
    p = plan(model_dir)
    assert ENV_API_KEYS not in p.env
    assert connector_extra(p)["tenants"] is False


@pytest.mark.parametrize(
    "ours, passthrough, env, words",
    [
        (("--api-key", "k1"), ("--api-key", "k2"), None, "'--'"),
        (("--api-key", "k1"), (), "envkey", "VLLM_API_KEY"),
        ((), ("--api-key", "k2"), "envkey", "VLLM_API_KEY"),
    ],
)
def test_ambiguous_keys_are_refused(model_dir, monkeypatch, ours, passthrough, env, words):
    if env:
        monkeypatch.setenv("VLLM_API_KEY", env)
    with pytest.raises(LaunchError) as exc:
        plan(model_dir, *ours, passthrough=passthrough)
    message = str(exc.value)
    assert words in message and "\n" not in message


@pytest.mark.parametrize("extra_argv, env", [(["--", "--api-key", "k1"], None), ([], "envkey")])
def test_disagg_needs_keys_before_the_double_dash(monkeypatch, capsys, extra_argv, env):
    """The router must know the keys too: with --disagg they go through --api-key."""
    if env:
        monkeypatch.setenv("VLLM_API_KEY", env)
    started = []
    monkeypatch.setattr("server.router.launch.run_disagg", lambda *a: started.append(a))
    from server.launcher.process import free_port

    assert main(["--disagg", "--port", str(free_port()), *extra_argv]) == 2
    assert not started
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "--api-key" in err and "\n" not in err


def test_refusal_is_one_line_from_the_command_line(model_dir):
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "server",
            "--model",
            str(model_dir),
            "--api-key",
            "k1",
            "--",
            "--api-key",
            "k2",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), run.stderr


# --- item 8: quota and expiry flags -------------------------------------------------------------
def test_tenant_flags_defaults(model_dir):
    extra = connector_extra(plan(model_dir))
    assert extra["max_sessions_per_tenant"] == 1000
    assert extra["max_branches_per_session"] == 256
    assert extra["session_idle_ttl_s"] == 6 * 3600.0
    assert extra["tenant_pin_share"] == 1.0  # one tenant (or none): the whole budget
    two = connector_extra(plan(model_dir, "--api-key", "a", "--api-key", "b"))
    assert two["tenant_pin_share"] == 0.5  # several tenants: none takes it all by default


def test_tenant_flags_given(model_dir):
    extra = connector_extra(
        plan(
            model_dir,
            "--max-sessions-per-tenant",
            "3",
            "--max-branches-per-session",
            "4",
            "--session-idle-ttl-s",
            "60",
            "--tenant-pin-share",
            "0.25",
        )
    )
    assert extra["max_sessions_per_tenant"] == 3 and extra["max_branches_per_session"] == 4
    assert extra["session_idle_ttl_s"] == 60.0 and extra["tenant_pin_share"] == 0.25


@pytest.mark.parametrize(
    "argv",
    [
        ["--tenant-pin-share", "0"],
        ["--tenant-pin-share", "1.5"],
        ["--max-sessions-per-tenant", "0"],
        ["--max-branches-per-session", "-1"],
        ["--session-idle-ttl-s", "0"],
    ],
)
def test_bad_tenant_flags_are_refused(argv):
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)
