"""tests/vanilla_vllm.py: the plain vLLM reference's arguments, written by the test (not the
launcher under test), and a flag the reference does not take refused."""

from __future__ import annotations

import json

import pytest

from tests.vanilla_vllm import reference_argv


def model_folder(tmp_path, config: dict):
    folder = tmp_path / "tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_flags_become_vllm_serve_arguments(tmp_path):
    folder = model_folder(tmp_path, {"model_type": "qwen3"})
    argv = reference_argv(
        ["--port", "8123", "--model", str(folder), "--kv-cache-gib", "0.25"]
        + ["--max-model-len", "2048", "--served-model-name", "tiny", "--no-connector"]
    )
    assert argv == [
        "--model",
        str(folder),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        "8123",
        "--kv-cache-memory-bytes",
        str(256 * 1024 * 1024),
        "--max-model-len",
        "2048",
        "--enable-prompt-tokens-details",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--uvicorn-log-level",
        "warning",
        "--dtype",
        "float32",
        "--enforce-eager",
    ]


def test_the_folder_names_the_model_unless_a_name_is_given(tmp_path):
    folder = model_folder(tmp_path, {"model_type": "llama"})
    argv = reference_argv(
        ["--port", "1", "--model", str(folder), "--kv-cache-gib", "1", "--max-model-len", "8"]
    )
    assert argv[argv.index("--served-model-name") + 1] == "tiny"


@pytest.mark.parametrize(
    ("config", "flag", "value"),
    [
        ({"model_type": "qwen3_next"}, "--dtype", "bfloat16"),
        ({"model_type": "x", "text_config": {"model_type": "qwen3_next"}}, "--dtype", "bfloat16"),
        ({"model_type": "gpt_oss"}, "--tool-call-parser", "openai"),
        ({"model_type": "gpt_oss"}, "--dtype", "float32"),
    ],
)
def test_a_model_type_that_needs_its_own_setting_gets_it(tmp_path, config, flag, value):
    folder = model_folder(tmp_path, config)
    argv = reference_argv(
        ["--port", "1", "--model", str(folder), "--kv-cache-gib", "1", "--max-model-len", "8"]
    )
    assert argv[argv.index(flag) + 1] == value


def test_vllm_flags_after_the_separator_come_last(tmp_path):
    folder = model_folder(tmp_path, {"model_type": "llama"})
    argv = reference_argv(
        ["--port", "1", "--model", str(folder), "--kv-cache-gib", "1", "--max-model-len", "8"]
        + ["--", "--block-size", "384", "--dtype", "float16"]
    )
    assert argv[-4:] == ["--block-size", "384", "--dtype", "float16"]


@pytest.mark.parametrize(
    "extra",
    [
        ["--host-store-gib", "0.25"],  # a kvbranch flag the reference has no use for
        ["--cpu-cores", "0"],  # binding is the caller's environment
        ["--role", "prefill"],
        ["--max-model", "16"],  # an abbreviation is not the flag
    ],
)
def test_a_flag_the_reference_does_not_take_is_refused(tmp_path, capsys, extra):
    folder = model_folder(tmp_path, {"model_type": "llama"})
    flags = ["--port", "1", "--model", str(folder), "--kv-cache-gib", "1", "--max-model-len", "8"]
    with pytest.raises(SystemExit) as exc:
        reference_argv(flags + extra)
    assert exc.value.code == 2
    assert "unrecognized arguments" in capsys.readouterr().err
