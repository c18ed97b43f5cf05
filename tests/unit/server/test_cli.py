"""The launcher's pure parts: flags, the vLLM argv and environment it plans, launch errors."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from server.common.env import ENV_API_KEYS, ENV_CONTROL_SOCKET, ENV_MODEL_NAME
from server.launcher import cli
from server.launcher.cli import (
    check_port_free,
    plan_launch,
    resolve_model,
    split_passthrough,
)
from server.launcher.settings import (
    CONNECTOR_CLASS,
    CONNECTOR_MODULE,
    GIB,
    LaunchError,
    build_parser,
)

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))  # plan_launch's socket directories


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


def flag_value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- parser -----------------------------------------------------------------------------------
def test_parser_defaults():
    args = parse()
    assert args.model is None
    assert args.host == "127.0.0.1"
    assert args.port == 8000
    assert args.kv_cache_gib == 1.0
    assert args.block_size is None
    assert args.host_store_gib == 2.0
    assert args.pin_budget_gib is None
    assert args.pin_ttl_s == 300.0
    assert args.max_model_len == 8192
    assert args.api_key is None
    assert args.log_level == "info"
    assert args.no_connector is False
    assert args.served_model_name is None


def test_help_lists_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--help")
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in (
        "--model",
        "--host",
        "--port",
        "--kv-cache-gib",
        "--block-size",
        "--api-key",
        "--log-level",
        "--host-store-gib",
        "--pin-budget-gib",
        "--pin-ttl-s",
        "--no-connector",
        "--served-model-name",
    ):
        assert flag in text
    assert "'--'" in text  # the passthrough convention is explained


def test_parser_values():
    args = parse(
        "--model",
        "m",
        "--host",
        "0.0.0.0",
        "--port",
        "9001",
        "--kv-cache-gib",
        "0.5",
        "--block-size",
        "16",
        "--host-store-gib",
        "0",
        "--pin-budget-gib",
        "0.25",
        "--pin-ttl-s",
        "1.5",
        "--api-key",
        "k1",
        "--api-key",
        "k2",
        "--log-level",
        "debug",
        "--no-connector",
        "--served-model-name",
        "x",
    )
    assert args.port == 9001 and args.kv_cache_gib == 0.5 and args.block_size == 16
    assert args.host_store_gib == 0.0 and args.pin_budget_gib == 0.25 and args.pin_ttl_s == 1.5
    assert args.api_key == ["k1", "k2"]
    assert args.log_level == "debug" and args.no_connector and args.served_model_name == "x"


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--kv-cache-gib", "abc"], "not a number"),
        (["--kv-cache-gib", "0"], "greater than 0"),
        (["--kv-cache-gib", "-1"], "greater than 0"),
        (["--kv-cache-gib", "nan"], "greater than 0"),
        (["--port", "0"], "1-65535"),
        (["--port", "65536"], "1-65535"),
        (["--port", "http"], "not a port number"),
        (["--block-size", "3"], "power of two"),
        (["--block-size", "0"], "power of two"),
        (["--block-size", "-16"], "power of two"),
        (["--block-size", "1.5"], "not an integer"),
        (["--host-store-gib", "-0.5"], "must not be negative"),
        (["--pin-budget-gib", "x"], "not a number"),
        (["--pin-ttl-s", "0"], "greater than 0"),
        (["--log-level", "verbose"], "invalid choice"),
        (["--max-model-len", "many"], "invalid int"),
        (["--bogus"], "unrecognized arguments"),
    ],
)
def test_bad_values_rejected(capsys, argv, needle):
    with pytest.raises(SystemExit) as exc:
        parse(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert needle in err


# --- split_passthrough ------------------------------------------------------------------------
def test_split_passthrough():
    assert split_passthrough(["--port", "1"]) == (["--port", "1"], [])
    assert split_passthrough(["--port", "1", "--", "--seed", "3", "--", "x"]) == (
        ["--port", "1"],
        ["--seed", "3", "--", "x"],
    )
    assert split_passthrough(["--"]) == ([], [])


# --- resolve_model ----------------------------------------------------------------------------
def test_resolve_existing_folder(model_dir):
    assert resolve_model(str(model_dir)) == str(model_dir.resolve())


def test_resolve_missing_folder_raises(tmp_path):
    with pytest.raises(LaunchError, match="no such model folder"):
        resolve_model(str(tmp_path / "absent"))
    with pytest.raises(LaunchError, match="no such model folder"):
        resolve_model("/nonexistent")
    with pytest.raises(LaunchError):
        resolve_model("./not-here")


def test_resolve_folder_without_config(tmp_path):
    with pytest.raises(LaunchError, match="no config.json"):
        resolve_model(str(tmp_path))


def test_resolve_file_is_not_a_folder(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_text("x")
    with pytest.raises(LaunchError, match="no such model folder"):
        resolve_model(str(f))


def test_resolve_hub_name_passes_through(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct") == (
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )


def test_resolve_default_uses_embedded_model(monkeypatch, model_dir):
    import server.launcher.model_cache as mc

    monkeypatch.setattr(mc, "ensure_model", lambda: model_dir)
    assert resolve_model(None) == str(model_dir)

    def broken():
        raise mc.ModelCacheError("no gguf")

    monkeypatch.setattr(mc, "ensure_model", broken)
    with pytest.raises(LaunchError, match="embedded model unavailable: no gguf"):
        resolve_model(None)


# --- plan_launch ------------------------------------------------------------------------------
def test_plan_cpu(model_dir):
    args = parse("--model", str(model_dir), "--port", "8123", "--kv-cache-gib", "0.5")
    plan = plan_launch(args, [], cuda=False)
    argv = plan.vllm_argv
    assert flag_value(argv, "--model") == str(model_dir.resolve())
    assert flag_value(argv, "--served-model-name") == "TinyModel"
    assert flag_value(argv, "--host") == "127.0.0.1"
    assert flag_value(argv, "--port") == "8123"
    assert flag_value(argv, "--dtype") == "float32"
    assert "--enforce-eager" in argv
    assert flag_value(argv, "--kv-cache-memory-bytes") == str(GIB // 2)
    assert flag_value(argv, "--max-model-len") == "8192"
    assert "--enable-prompt-tokens-details" in argv
    assert "--block-size" not in argv
    assert "--api-key" not in argv
    # The header gate, outside vLLM's own middleware (server/plugin/header_gate.py).
    assert flag_value(argv, "--middleware") == "server.plugin.header_gate.HeaderGate"
    config = json.loads(flag_value(argv, "--kv-transfer-config"))
    assert config["kv_connector"] == CONNECTOR_CLASS == "KVBranchConnector"
    assert config["kv_connector_module_path"] == CONNECTOR_MODULE == "server.connector.connector"
    assert config["kv_role"] == "kv_both"
    extra = config["kv_connector_extra_config"]
    assert extra["host_store_bytes"] == 2 * GIB
    assert extra["pin_budget_bytes"] == GIB  # half the store by default
    assert extra["pin_ttl_s"] == 300.0
    assert extra["control_socket"] == plan.control_socket
    assert plan.control_socket.endswith("/control.sock")  # in a fresh private directory
    assert "kvbranch" in plan.env["VLLM_PLUGINS"].split(",")
    assert plan.env[ENV_CONTROL_SOCKET] == plan.control_socket
    assert plan.env[ENV_MODEL_NAME] == "TinyModel"
    assert plan.env["VLLM_LOGGING_LEVEL"] == "INFO"
    assert ENV_API_KEYS not in plan.env
    assert plan.model_path == str(model_dir.resolve())
    assert plan.served_model_name == "TinyModel"
    assert all(isinstance(a, str) for a in argv)


def test_plan_cuda_omits_cpu_flags(model_dir):
    plan = plan_launch(parse("--model", str(model_dir)), [], cuda=True)
    assert "--enforce-eager" not in plan.vllm_argv
    assert "--dtype" not in plan.vllm_argv
    assert "--kv-transfer-config" in plan.vllm_argv
    assert "--kv-cache-memory-bytes" in plan.vllm_argv


def test_plan_no_connector(model_dir):
    plan = plan_launch(parse("--model", str(model_dir), "--no-connector"), [], cuda=False)
    assert "--kv-transfer-config" not in plan.vllm_argv
    assert not any("KVBranchConnector" in a for a in plan.vllm_argv)
    assert plan.control_socket is None
    assert ENV_CONTROL_SOCKET not in plan.env
    assert "--enable-prompt-tokens-details" in plan.vllm_argv


def test_plan_passthrough_appended_unchanged(model_dir):
    extra = ["--max-num-seqs", "8", "--seed", "1", "--weird=a b"]
    plan = plan_launch(parse("--model", str(model_dir)), list(extra), cuda=False)
    assert plan.vllm_argv[-len(extra) :] == extra


def test_plan_api_keys(model_dir):
    plan = plan_launch(
        parse("--model", str(model_dir), "--api-key", "k1", "--api-key", "k2"), [], cuda=False
    )
    assert plan.env[ENV_API_KEYS] == "k1,k2"
    # vLLM's own parser must see both keys (repeating its flag would keep only the last)
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    vllm_args = make_arg_parser(FlexibleArgumentParser()).parse_args(plan.vllm_argv)
    assert vllm_args.api_key == ["k1", "k2"]


def test_plan_options_flow_through(model_dir):
    args = parse(
        "--model",
        str(model_dir),
        "--block-size",
        "32",
        "--host-store-gib",
        "4",
        "--pin-budget-gib",
        "0.5",
        "--pin-ttl-s",
        "12",
        "--served-model-name",
        "alias",
        "--log-level",
        "warning",
        "--max-model-len",
        "2048",
        "--host",
        "0.0.0.0",
    )
    plan = plan_launch(args, [], cuda=False)
    argv = plan.vllm_argv
    assert flag_value(argv, "--block-size") == "32"
    assert flag_value(argv, "--served-model-name") == "alias"
    assert flag_value(argv, "--max-model-len") == "2048"
    assert flag_value(argv, "--host") == "0.0.0.0"
    assert flag_value(argv, "--uvicorn-log-level") == "warning"
    extra = json.loads(flag_value(argv, "--kv-transfer-config"))["kv_connector_extra_config"]
    assert extra["host_store_bytes"] == 4 * GIB
    assert extra["pin_budget_bytes"] == GIB // 2
    assert extra["pin_ttl_s"] == 12.0
    assert plan.env[ENV_MODEL_NAME] == "alias"
    assert plan.env["VLLM_LOGGING_LEVEL"] == "WARNING"


def test_plan_keeps_existing_plugins(model_dir, monkeypatch):
    monkeypatch.setenv("VLLM_PLUGINS", "other,thing")
    plan = plan_launch(parse("--model", str(model_dir)), [], cuda=False)
    assert (
        plan.env["VLLM_PLUGINS"]
        == "other,thing,kvbranch,kvbranch_mq_spin,kvbranch_logging,kvbranch_event_endpoints"
    )
    monkeypatch.setenv(
        "VLLM_PLUGINS", "kvbranch_logging,kvbranch_mq_spin,kvbranch,other,kvbranch_event_endpoints"
    )
    plan = plan_launch(parse("--model", str(model_dir)), [], cuda=False)
    assert (
        plan.env["VLLM_PLUGINS"]
        == "kvbranch_logging,kvbranch_mq_spin,kvbranch,other,kvbranch_event_endpoints"
    )


@pytest.mark.parametrize("extra", [[], ["--no-connector"]])
def test_plan_sets_the_message_queue_spin_with_or_without_connector(model_dir, extra):
    plan = plan_launch(parse("--model", str(model_dir), *extra), [], cuda=False)
    assert "kvbranch_mq_spin" in plan.env["VLLM_PLUGINS"].split(",")
    assert plan.env["KVBRANCH_MQ_SPIN_S"] == "0.002"  # --mq-spin-ms 2 by default
    plan = plan_launch(
        parse("--model", str(model_dir), "--mq-spin-ms", "1000", *extra), [], cuda=False
    )
    assert plan.env["KVBRANCH_MQ_SPIN_S"] == "1.0"  # vLLM's own window


def test_plan_missing_model_raises(tmp_path):
    with pytest.raises(LaunchError, match="no such model folder"):
        plan_launch(parse("--model", str(tmp_path / "gone")), [], cuda=False)


def test_plan_does_not_probe_cuda_for_bad_model(tmp_path, monkeypatch):
    def boom():
        raise AssertionError("CUDA probed before the model was checked")

    monkeypatch.setattr(cli, "_has_cuda", boom)
    with pytest.raises(LaunchError):
        plan_launch(parse("--model", str(tmp_path / "gone")), [])


def test_plan_probes_cuda_when_not_told(model_dir, monkeypatch):
    monkeypatch.setattr(cli, "_has_cuda", lambda: True)
    assert "--enforce-eager" not in plan_launch(parse("--model", str(model_dir)), []).vllm_argv
    monkeypatch.setattr(cli, "_has_cuda", lambda: False)
    assert "--enforce-eager" in plan_launch(parse("--model", str(model_dir)), []).vllm_argv


# --- ports ------------------------------------------------------------------------------------
def test_check_port_free_ok():
    check_port_free("127.0.0.1", free_port())


def test_check_port_free_busy():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        with pytest.raises(LaunchError, match=f"cannot listen on 127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)


# --- main, in process -------------------------------------------------------------------------
def test_main_reports_launch_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "run", lambda plan: pytest.fail("must not start vLLM"))
    code = cli.main(["--model", str(tmp_path / "gone"), "--port", str(free_port())])
    assert code == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"error: --model {tmp_path / 'gone'}: no such model folder"]


def test_main_hands_plan_to_run(model_dir, monkeypatch):
    seen = []
    monkeypatch.setattr(cli, "run", seen.append)
    monkeypatch.setattr(cli, "_has_cuda", lambda: False)
    assert (
        cli.main(["--model", str(model_dir), "--port", str(free_port()), "--", "--seed", "7"]) == 0
    )
    assert len(seen) == 1
    assert seen[0].vllm_argv[-2:] == ["--seed", "7"]


# --- python -m server, as a subprocess --------------------------------------------------------
def run_server(*argv: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("VLLM_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "server", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr and "Traceback" not in proc.stdout
    error_lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1, proc.stderr
    assert needle in error_lines[0]


def test_subprocess_bad_number():
    proc = run_server("--kv-cache-gib", "abc")
    assert proc.returncode == 2
    assert_one_line_error(proc, "--kv-cache-gib: 'abc' is not a number")


def test_subprocess_missing_model():
    proc = run_server("--model", "/nonexistent", "--port", str(free_port()))
    assert proc.returncode == 2
    assert_one_line_error(proc, "--model /nonexistent: no such model folder")
    assert proc.stderr.strip().count("\n") == 0  # exactly one line


def test_subprocess_busy_port(model_dir):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        proc = run_server("--model", str(model_dir), "--port", str(port))
    assert proc.returncode == 2
    assert_one_line_error(proc, f"cannot listen on 127.0.0.1:{port}")
    assert proc.stderr.strip().count("\n") == 0


def test_kv_cache_too_small_for_max_model_len_is_one_clear_error(tmp_path):
    """The embedded model's shape: 30 layers, 3 KV heads of 64 → 46,080 bytes/token in fp32."""
    from server.launcher.cli import check_kv_fits, kv_bytes_per_token

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "num_hidden_layers": 30,
                "num_attention_heads": 9,
                "num_key_value_heads": 3,
                "hidden_size": 576,
            }
        )
    )
    assert kv_bytes_per_token(str(tmp_path), cuda=False) == 46080
    check_kv_fits(str(tmp_path), 0.5, 8192, cuda=False)  # 11.6k tokens: fits
    with pytest.raises(LaunchError, match="raise --kv-cache-gib to at least 0.35"):
        check_kv_fits(str(tmp_path), 0.25, 8192, cuda=False)
    assert kv_bytes_per_token(str(tmp_path / "missing"), cuda=False) is None


# --- bounded stopping (issue 13) ----------------------------------------------------------------
def test_vllm_keeps_aborting_at_once_on_sigterm(model_dir):
    """vLLM 0.32's drain (--shutdown-timeout N) force-kills the engine core after N s but then
    waits for the HTTP stream it left hanging forever (measured: an instance stuck after
    "shutting down FastAPI HTTP server"); so the grace is the router's, not vLLM's."""
    plan = plan_launch(
        parse("--model", str(model_dir), "--shutdown-grace-s", "2.5"), [], cuda=False
    )
    assert "--shutdown-timeout" not in plan.vllm_argv
    assert plan.shutdown_grace_s == 2.5  # the reaper's grace for vLLM's children


def test_shutdown_grace_rejects_negative(capsys):
    with pytest.raises(SystemExit):
        parse("--shutdown-grace-s", "-1")
    assert "must not be negative" in capsys.readouterr().err


def test_the_router_cancels_hanging_requests_after_the_grace(monkeypatch):
    """uvicorn alone waits for a hanging stream forever on SIGTERM."""
    import uvicorn

    from server.router.launch import run_router

    seen: dict = {}

    def fake_run(self, sockets=None):
        seen.update(timeout_graceful_shutdown=self.config.timeout_graceful_shutdown)
        seen.update(sockets=sockets)
        self.started = True

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    run_router(
        parse(
            "--role",
            "router",
            "--prefill",
            "http://p:1",
            "--decode",
            "http://d:2",
            "--shutdown-grace-s",
            "2",
        )
    )
    assert seen["timeout_graceful_shutdown"] == 2.0
    assert seen["sockets"] is None  # --role router binds --host/--port itself


def test_disagg_binds_the_router_port_before_p_and_d_start():
    """P's and D's transports take ephemeral ports while they load; the router's is bound first
    and a taken port is a one-line launch error."""
    from server.router.launch import bind_listener

    sock = bind_listener("127.0.0.1", 0)
    port = sock.getsockname()[1]
    try:
        other = socket.socket()
        other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", port))  # even with SO_REUSEADDR: it is listening
        other.close()
        with pytest.raises(LaunchError, match=f"--port {port}: cannot bind"):
            bind_listener("127.0.0.1", port)
    finally:
        sock.close()


def test_a_launched_server_is_told_its_launcher(monkeypatch):
    """ServerProcess hands the child its pid, so the child stops when the launcher dies."""
    import subprocess

    from server.launcher.process import ENV_PARENT_DEATHSIG, ENV_PARENT_PID, ServerProcess

    seen: dict = {}

    class FakePopen:
        def __init__(self, argv, **kw):
            seen.update(kw)

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    server = ServerProcess(["--model", "x"], name="unit-env")
    server.launch()
    assert seen["env"][ENV_PARENT_PID] == str(os.getpid())
    assert seen["env"][ENV_PARENT_DEATHSIG] == "1"  # launched from the main thread


@pytest.mark.parametrize(
    ("passthrough", "reserved"),
    [
        ([], "1"),
        (["--tensor-parallel-size", "2"], "2"),
        (["-tp", "2", "--pipeline-parallel-size=2"], "4"),
        (["-pp=2"], "2"),
    ],
)
def test_plan_reserves_the_cores_plain_vllm_reserves(model_dir, monkeypatch, passthrough, reserved):
    # vLLM reserves one more core per rank for any KV connector: the kvbranch connector alone
    # would then run the model on other OpenMP threads than plain vLLM, and round differently
    monkeypatch.delenv(cli.ENV_RESERVED_CPUS, raising=False)
    plan = plan_launch(parse("--model", str(model_dir)), passthrough, cuda=False)
    assert plan.env[cli.ENV_RESERVED_CPUS] == reserved


@pytest.mark.parametrize("extra", [["--no-connector"], ["--role", "prefill"]])
def test_plan_leaves_the_reserved_cores_to_vllm_without_our_connector_alone(
    model_dir, monkeypatch, extra
):
    monkeypatch.delenv(cli.ENV_RESERVED_CPUS, raising=False)
    plan = plan_launch(parse("--model", str(model_dir), *extra), [], cuda=False)
    assert cli.ENV_RESERVED_CPUS not in plan.env
    plan = plan_launch(parse("--model", str(model_dir)), [], cuda=True)
    assert cli.ENV_RESERVED_CPUS not in plan.env
    monkeypatch.setenv(cli.ENV_RESERVED_CPUS, "0")  # the user's own choice stands
    plan = plan_launch(parse("--model", str(model_dir)), [], cuda=False)
    assert cli.ENV_RESERVED_CPUS not in plan.env


@pytest.mark.parametrize(
    ("ours", "passthrough"),
    [
        (["--role", "decode"], ["--data_parallel_size=2"]),
        (["--role", "prefill", "--index", "redis://127.0.0.1:6379/0"], ["-dp=4"]),
    ],
)
def test_plan_refuses_data_parallel_engines_of_a_pd_instance(model_dir, ours, passthrough):
    # our router's hand-off names an instance, not one of its engines
    with pytest.raises(LaunchError, match="one instance per engine"):
        plan_launch(parse("--model", str(model_dir), *ours), passthrough, cuda=False)


def test_an_aggregated_replica_may_run_several_engines_each_a_member(model_dir):
    plan = plan_launch(
        parse("--model", str(model_dir), "--index", "redis://127.0.0.1:6379/0", "--port", "8000"),
        ["--data-parallel-size", "2"],
        cuda=False,
    )
    # engine i's NIXL side channel is vLLM's port + i: the launcher names engine 0's
    assert plan.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "18000"
    assert plan.env[cli.ENV_PEER_PULL] == "1"
    with pytest.raises(LaunchError, match="past 65535"):
        plan_launch(
            parse("--model", str(model_dir), "--index", "redis://x:1/0", "--nixl-port", "65535"),
            ["-dp", "2"],
            cuda=False,
        )


@pytest.mark.parametrize(
    "split",
    [
        ["--data-parallel-external-lb"],
        ["-dph"],
        ["--data-parallel-rank", "1"],
        ["--data_parallel_size_local=1"],
        ["--headless"],
    ],
)
def test_plan_refuses_data_parallel_engines_an_api_server_does_not_all_front(model_dir, split):
    with pytest.raises(LaunchError, match="fronts all of them"):
        plan_launch(parse("--model", str(model_dir)), ["-dp", "2", *split], cuda=False)


@pytest.mark.parametrize(
    ("ours", "passthrough"),
    [([], ["--data-parallel-size", "2"]), (["--index", "redis://x:1/0"], ["-dp", "1"])],
)
def test_plan_keeps_data_parallel_engines_of_a_single_instance(model_dir, ours, passthrough):
    plan = plan_launch(parse("--model", str(model_dir), *ours), passthrough, cuda=False)
    assert plan.vllm_argv[-len(passthrough) :] == passthrough


def test_plan_tells_the_engine_cores_how_many_engines_there_are(model_dir):
    # vLLM resets data_parallel_size to 1 inside a dense model's engine core
    from server.common.env import ENV_DATA_PARALLEL_SIZE

    plan = plan_launch(parse("--model", str(model_dir)), ["-dp", "2"], cuda=False)
    assert plan.env[ENV_DATA_PARALLEL_SIZE] == "2"
    plan = plan_launch(parse("--model", str(model_dir)), [], cuda=False)
    assert ENV_DATA_PARALLEL_SIZE not in plan.env


@pytest.mark.parametrize(
    ("given", "passthrough", "bound"),
    [
        ("1", ["--data-parallel-size", "2"], "1|1"),
        ("0-3", ["-dp", "2"], "0,1|2,3"),
        ("0|1", ["--data-parallel-size", "2"], "0|1"),
        ("1", [], "1"),
    ],
)
def test_plan_gives_each_data_parallel_engine_a_core_list(
    model_dir, monkeypatch, given, passthrough, bound
):
    # vLLM takes one '|' list per engine: a single list from the environment (a test lane's or
    # a container's binding) left engine 1 with none, and its engine core died at start
    monkeypatch.setenv(cli.ENV_OMP_BIND, given)
    plan = plan_launch(parse("--model", str(model_dir)), passthrough, cuda=False)
    assert plan.env[cli.ENV_OMP_BIND] == bound
    monkeypatch.delenv(cli.ENV_OMP_BIND)
    args = parse("--model", str(model_dir), "--cpu-cores", given)
    plan = plan_launch(args, passthrough, cuda=False)
    assert plan.env[cli.ENV_OMP_BIND] == bound


def test_plan_refuses_cores_it_cannot_read(model_dir, monkeypatch):
    monkeypatch.delenv(cli.ENV_OMP_BIND, raising=False)
    with pytest.raises(cli.LaunchError, match="--cpu-cores"):
        plan_launch(parse("--model", str(model_dir), "--cpu-cores", "two"), [], cuda=False)


def test_a_failed_start_names_its_first_error(tmp_path):
    # the tail of an engine core's failure is the client's re-raise; the cause is further up
    from server.launcher.process import ServerProcess

    server = ServerProcess(["--model", "x"], name="unit-log")
    server.log_path = tmp_path / "server.log"
    server.log_path.write_text(
        "WARNING failed to raise the ulimit; errors like `OSError: [Errno 24]` may follow\n"
        "(EngineCore_DP1) ERROR [core.py] AssertionError: no CPU list for rank 1\n"
        + "  frame\n" * 100
        + "RuntimeError: Engine core initialization failed. See root cause above.\n"
    )
    assert server.first_error().endswith("AssertionError: no CPU list for rank 1")
    assert "AssertionError" not in server.log_tail()
