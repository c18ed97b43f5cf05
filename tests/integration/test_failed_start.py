"""A start that fails exits, so does a server whose engine dies, and a model this machine cannot
run is refused before vLLM loads.

A start that fails exits: when vLLM fails after its engine core started, ``python -m server``
ends with a non-zero status and one line saying why, so a supervisor (systemd, Kubernetes, the
tests' own :class:`ServerProcess`) sees the failure and restarts or reports it, instead of a
process that logged the engine's shutdown and then stayed alive.

The failure is the one users met: a gpt-oss model (Harmony format) started with a tool-call
parser vLLM refuses for it, here named by hand after ``--`` (the launcher itself now picks
Harmony's parser). vLLM starts the engine core, then its API server refuses the parser and shuts
the engine down. The model is a two-layer gpt-oss config with the embedded model's tokenizer;
its weights are vLLM's dummy ones (nothing is computed: the start fails before any request).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from server.launcher.model_cache import ensure_model
from server.launcher.process import free_port
from tests import prestart

ROOT = Path(__file__).resolve().parents[2]
#: Far above any start on a busy CI machine (docs/testing.md); a launcher that stays alive
#: never ends.
EXIT_WITHIN_S = 300


def gpt_oss_config() -> dict:
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "vocab_size": 49152,
        "hidden_size": 128,
        "intermediate_size": 128,
        "head_dim": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 128,
        "max_position_embeddings": 4096,
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "original_max_position_embeddings": 4096,
            "truncate": False,
        },
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 2,
        "tie_word_embeddings": False,
    }


def test_engine_failure_after_start_exits_non_zero_in_one_line(tmp_path):
    source = ensure_model()
    model = tmp_path / "gpt-oss"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (model / name).symlink_to(source / name)
    (model / "config.json").write_text(json.dumps(gpt_oss_config()))
    command = [
        sys.executable,
        "-m",
        "server",
        "--model",
        str(model),
        "--port",
        str(free_port()),
        "--kv-cache-gib",
        "0.25",
        "--max-model-len",
        "1024",
        "--",
        "--load-format",
        "dummy",
        "--tool-call-parser",
        "hermes",
    ]
    with prestart.reserved("failed-start", engines=1):
        proc = subprocess.Popen(
            command,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            output, _ = proc.communicate(timeout=EXIT_WITHIN_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
            pytest.fail(f"still running {EXIT_WITHIN_S} s after launch:\n{output[-3000:]}")
    assert proc.returncode == 1, output[-3000:]
    # vLLM really had started its engine core and shut it down before the failure
    assert "engine up" in output and "[shutdown]" in output, output[-3000:]
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output[-3000:]
    assert errors[0].startswith("error: vLLM failed to start: TypeError: --tool-call-parser hermes")
    assert "Harmony requires GptOssToolParser" in errors[0]


QWEN3_5 = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {"model_type": "qwen3_5_moe_text"},
}
DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 64,
}


def _has_cuda() -> bool:
    from server.launcher.cli import _has_cuda as launcher_has_cuda

    return launcher_has_cuda()


def _has_torchvision() -> bool:
    from server.launcher.model_needs import missing_module

    return missing_module("torchvision") is None


@pytest.mark.parametrize(
    ("config", "words"),
    [
        pytest.param(
            QWEN3_5,
            ("imports torchvision", "install the torchvision release built for the installed"),
            marks=pytest.mark.skipif(_has_torchvision(), reason="torchvision is installed"),
            id="qwen3_5-without-torchvision",
        ),
        pytest.param(
            DEEPSEEK_V32,
            ("sparse attention", "Sparse Attention is not supported on CPU", "GPU"),
            marks=pytest.mark.skipif(_has_cuda(), reason="a GPU runs sparse attention"),
            id="sparse-attention-on-cpu",
        ),
    ],
)
def test_a_model_this_machine_cannot_run_is_refused_before_vllm_loads(tmp_path, config, words):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    run = subprocess.run(
        [sys.executable, "-m", "server", "--model", str(model), "--port", str(free_port())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --model {model}: {config['architectures'][0]}"), last
    for word in words:
        assert word in last, last
    assert "starting vLLM" not in run.stderr and "Traceback" not in run.stderr


def test_a_server_whose_engine_core_dies_exits_non_zero(tmp_path):
    """vLLM's server stops itself when its engine core dies, and returns as from a requested
    stop: the launcher must still exit with status 1, or a supervisor that restarts failed
    services (systemd's Restart=on-failure) would leave it down."""
    import httpx
    import psutil

    from server.launcher.process import ServerProcess

    server = ServerProcess(
        ["--kv-cache-gib", "0.25", "--max-model-len", "1024", "--no-connector"],
        name="engine-dies",
        ready_timeout=EXIT_WITHIN_S,
    )
    with prestart.reserved("engine-dies", engines=1):
        server.start()
        try:
            assert server.proc is not None
            cores = [
                p
                for p in psutil.Process(server.proc.pid).children(recursive=True)
                if "EngineCore" in " ".join(p.cmdline()) or p.name().startswith("VLLM::EngineCor")
            ]
            assert cores, [p.cmdline() for p in psutil.Process(server.proc.pid).children(True)]
            cores[0].kill()
            try:
                server.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                pytest.fail(f"still running 120 s after its engine core died:\n{server.log_tail()}")
            assert server.proc.returncode == 1, server.log_tail()
            with pytest.raises(httpx.HTTPError):
                httpx.get(f"{server.url}/v1/models", timeout=2.0)
            log = server.log_tail(400)
            errors = [line for line in log.splitlines() if line.startswith("error: ")]
            assert errors == [
                "error: vLLM stopped: its engine core died (its error is in the log above)"
            ], log[-3000:]
        finally:
            server.stop()
