"""What a model needs from the platform and the install (server/launcher/model_needs.py): the
dtype on CPU, a GPU for sparse attention, torchvision for Qwen3.5's module — each decided before
vLLM loads anything."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from server.launcher.cli import plan_launch
from server.launcher.model_needs import (
    cpu_dtype,
    cpu_refusal,
    install_refusal,
    missing_module,
)
from server.launcher.settings import LaunchError, build_parser

QWEN3_NEXT = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next"}
QWEN3_5 = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"],
    "model_type": "qwen3_5_moe",
    "text_config": {"model_type": "qwen3_5_moe_text"},
}
DEEPSEEK_V32 = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 2048,
}
GLM5 = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "index_topk": 2048}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))


def plan(tmp_path: Path, config: dict, passthrough: list[str] | None = None, cuda: bool = False):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    args = build_parser().parse_args(["--model", str(folder), "--no-connector"])
    return plan_launch(args, passthrough or [], cuda=cuda)


def values(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


# --- dtype ------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [QWEN3_NEXT, QWEN3_5])
def test_gated_deltanet_gets_bfloat16_on_cpu_and_says_why(tmp_path, config):
    dtype, why = cpu_dtype(config)
    assert dtype == "bfloat16"
    assert why is not None and "Gated DeltaNet" in why and config["model_type"] in why
    launch = plan(tmp_path, config)
    assert values(launch.vllm_argv, "--dtype") == ["bfloat16"]
    assert [note for note in launch.notes if "Gated DeltaNet" in note] == [why]


def test_other_models_keep_float32_on_cpu(tmp_path):
    assert cpu_dtype(LLAMA) == ("float32", None) == cpu_dtype(None)
    launch = plan(tmp_path, LLAMA)
    assert values(launch.vllm_argv, "--dtype") == ["float32"]
    assert not any("dtype" in note for note in launch.notes)


def test_the_users_dtype_wins_without_a_note(tmp_path):
    launch = plan(tmp_path, QWEN3_NEXT, ["--dtype", "float32"])
    assert values(launch.vllm_argv, "--dtype")[-1] == "float32"  # vLLM takes the last one
    assert not any("Gated DeltaNet" in note for note in launch.notes)


def test_no_dtype_on_cuda(tmp_path):
    assert "--dtype" not in plan(tmp_path, QWEN3_NEXT, cuda=True).vllm_argv


def test_the_kv_estimate_follows_the_dtype(tmp_path):
    from server.launcher.cli import kv_bytes_per_token

    folder = tmp_path / "m"
    folder.mkdir()
    config = {"num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 64}
    (folder / "config.json").write_text(json.dumps(config | {"hidden_size": 128}))
    assert kv_bytes_per_token(str(folder), cuda=False) == 2 * 2 * 2 * 64 * 4
    assert kv_bytes_per_token(str(folder), cuda=False, dtype="bfloat16") == 2 * 2 * 2 * 64 * 2


# --- sparse attention -------------------------------------------------------------------------
@pytest.mark.parametrize("config", [DEEPSEEK_V32, GLM5])
def test_sparse_attention_is_refused_on_cpu_in_one_line(tmp_path, config):
    reason = cpu_refusal(config)
    assert reason is not None and "\n" not in reason
    for words in ("sparse attention", "Sparse Attention is not supported on CPU", "GPU"):
        assert words in reason
    with pytest.raises(LaunchError, match="sparse attention") as raised:
        plan(tmp_path, config)
    assert config["architectures"][0] in str(raised.value)


def test_sparse_attention_inside_text_config_is_seen():
    assert cpu_refusal({"architectures": ["X"], "text_config": {"index_topk": 64}}) is not None


def test_sparse_attention_passes_on_cuda_and_dense_mla_on_cpu(tmp_path):
    assert "--model" in plan(tmp_path, DEEPSEEK_V32, cuda=True).vllm_argv
    assert cpu_refusal(DEEPSEEK_V3) is None and cpu_refusal(None) is None
    assert "--model" in plan(tmp_path, DEEPSEEK_V3).vllm_argv


# --- torchvision ------------------------------------------------------------------------------
def test_qwen3_5_without_torchvision_is_refused_saying_what_to_install():
    def never(name: str) -> str:
        raise AssertionError("imported what is not installed")

    reason = install_refusal(QWEN3_5, missing=never, installed=lambda name: False)
    assert reason is not None and "\n" not in reason
    assert "Qwen3_5MoeForConditionalGeneration" in reason
    assert "install the torchvision release built for the installed torch" in reason
    assert install_refusal(QWEN3_5, missing=lambda name: None, installed=lambda name: True) is None


def test_only_the_models_that_import_it_need_torchvision():
    def never(name: str) -> str:
        raise AssertionError("imported for a model that does not need it")

    for config in (QWEN3_NEXT, LLAMA, DEEPSEEK_V3, None, {"architectures": "x"}):
        assert install_refusal(config, missing=never, installed=lambda name: False) is None


def test_a_torchvision_that_does_not_import_is_refused_for_every_model():
    broken = "RuntimeError: operator torchvision::nms does not exist"
    for config in (LLAMA, QWEN3_5, None):
        reason = install_refusal(config, missing=lambda name: broken, installed=lambda n: True)
        assert reason is not None and "\n" not in reason
        assert broken in reason
        assert "pip uninstall torchvision torchaudio torchcodec" in reason
    assert install_refusal(LLAMA, missing=lambda name: None, installed=lambda n: True) is None


def test_missing_module_reports_an_import_that_fails():
    assert missing_module("json") is None
    assert missing_module("no_such_module_kvbranch").startswith("ModuleNotFoundError")


# --- the block size of a hybrid attention/state model on CPU ---------------------------------
def _plan(config: dict | None, *argv: str):
    from server.launcher.cli import LaunchPlan

    return LaunchPlan(["--model", "m", *argv], {}, "m", "m", None, model_config=config)


def _align(config, *argv, cuda=False, size=384, hybrid=True):
    from types import SimpleNamespace

    from server.launcher.cli import align_hybrid_block_size

    args = SimpleNamespace(block_size=None)
    note = align_hybrid_block_size(
        args,
        _plan(config, *argv),
        cuda=cuda,
        size_of=lambda _args: size,
        hybrid=lambda _config: hybrid,
    )
    return args.block_size, note


def test_a_hybrid_model_on_cpu_gets_the_block_size_vllm_s_worker_would_choose():
    size, note = _align(QWEN3_NEXT)
    assert size == 384 and "block size 384 tokens" in (note or "")


@pytest.mark.parametrize(
    ("config", "argv", "cuda", "hybrid"),
    [
        (QWEN3_NEXT, ("--block-size", "128"), False, True),  # the user's size wins
        (QWEN3_NEXT, (), True, True),  # a GPU: vLLM as it is
        (LLAMA, (), False, False),  # no state layers
        (None, (), False, True),  # no config read (a hub name not fetched)
    ],
    ids=["user-flag", "gpu", "dense", "no-config"],
)
def test_the_block_size_is_left_alone(config, argv, cuda, hybrid):
    assert _align(config, *argv, cuda=cuda, hybrid=hybrid) == (None, None)


def test_a_size_vllm_keeps_changes_nothing():
    assert _align(QWEN3_NEXT, size=None) == (None, None)


def test_vllm_s_own_rule_gives_the_tiny_gated_deltanet_its_state_page():
    """vLLM's platform rule on the real config of the tiny Qwen3-Next (tests/tiny_models.py):
    the size its CPU worker logs ("Setting attention block size to 384 tokens")."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from server.connector.vllm_compat import hybrid_attention_block_size
    from tests.tiny_models import ensure

    parser = make_arg_parser(FlexibleArgumentParser(prog="vllm"))
    argv = ["--model", str(ensure("gdn")), "--dtype", "bfloat16", "--max-model-len", "2048"]
    assert hybrid_attention_block_size(parser.parse_args(argv)) == 384
    dense = ["--model", str(ensure("dense")), "--max-model-len", "2048"]
    assert hybrid_attention_block_size(parser.parse_args(dense)) is None


def test_a_float32_mla_model_on_cpu_gets_vllms_reference_mla_backend():
    # on a CPU with AMX tiles vLLM picks its AMX MLA backend, which packs bfloat16/float16
    # weights only: a float32 MLA model failed at start there
    from server.launcher.model_needs import CPU_MLA_BACKEND, cpu_attention_backend

    mla = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}
    mla["kv_lora_rank"] = 512
    backend = cpu_attention_backend(mla, "float32")
    assert backend is not None and backend[0] == CPU_MLA_BACKEND
    assert "--attention-backend" in backend[1]
    wrapped = {"model_type": "kimi_vl", "text_config": dict(mla)}
    assert cpu_attention_backend(wrapped, "float32") is not None
    assert cpu_attention_backend(mla, "bfloat16") is None  # vLLM's choice
    assert cpu_attention_backend({"model_type": "llama"}, "float32") is None
    assert cpu_attention_backend(None, "float32") is None
