"""The tool-call and reasoning parsers the launcher gives vLLM, chosen by the model's config
(server/launcher/model_parsers.py), and their check against the model's tokenizer."""

from __future__ import annotations

import json
from argparse import Namespace
from pathlib import Path

import pytest

from server.launcher.cli import plan_launch
from server.launcher.model_parsers import (
    BY_ARCHITECTURE,
    BY_MODEL_TYPE,
    DEFAULT,
    chat_template,
    chosen_parsers,
    fit_parsers,
    parser_argv,
    parsers_for,
)
from server.launcher.settings import build_parser

#: DeepSeek chat templates, cut to the tool-call part that tells V3 from V3.1.
V3_TEMPLATE = (
    "{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name']"
    " + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```'}}"
)
V31_TEMPLATE = (
    "{{'<｜tool▁call▁begin｜>' + tool['function']['name'] + '<｜tool▁sep｜>'"
    " + tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}"
)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))


def folder(tmp_path: Path, config: dict, name: str = "m", **files: str) -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    for file, text in files.items():
        (path / file.replace("__", ".")).write_text(text)
    return path


def arch(name: str, model_type: str = "x", **extra) -> dict:
    return {"architectures": [name], "model_type": model_type, **extra}


def flags(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


@pytest.mark.parametrize(
    ("config", "tool", "reasoning"),
    [
        (arch("GptOssForCausalLM", "gpt_oss"), "openai", "openai_gptoss"),
        (arch("Qwen3NextForCausalLM", "qwen3_next"), "hermes", None),
        (arch("Qwen3_5MoeForConditionalGeneration", "qwen3_5_moe"), "qwen3_coder", "qwen3"),
        (arch("Qwen3_5ForConditionalGeneration", "qwen3_5"), "qwen3_coder", "qwen3"),
        (arch("DeepseekV32ForCausalLM", "deepseek_v32"), "deepseek_v32", "deepseek_v3"),
        (arch("Glm4MoeForCausalLM", "glm4_moe"), "glm45", "glm45"),
        (arch("GlmMoeDsaForCausalLM", "glm_moe_dsa"), "glm47", "glm45"),
        (arch("DeepseekV3ForCausalLM", "kimi_k2"), "kimi_k2", None),
        (arch("DeepseekV3ForCausalLM", "deepseek_v3"), "deepseek_v3", "deepseek_v3"),
        (arch("LlamaForCausalLM", "llama"), "hermes", None),
        (arch("Qwen3ForCausalLM", "qwen3"), "hermes", None),
        ({"model_type": "llama"}, "hermes", None),
        ({"architectures": "not a list"}, "hermes", None),
    ],
)
def test_parsers_by_family(config, tool, reasoning):
    chosen = parsers_for(config)
    assert (chosen.tool, chosen.reasoning) == (tool, reasoning)


def test_unknown_or_missing_config_keeps_hermes():
    assert parsers_for(None) == DEFAULT == parsers_for({})
    assert (DEFAULT.tool, DEFAULT.reasoning) == ("hermes", None)


def test_deepseek_v3_and_v31_told_apart_by_their_chat_template():
    config = arch("DeepseekV3ForCausalLM", "deepseek_v3")
    assert parsers_for(config, V3_TEMPLATE).tool == "deepseek_v3"
    assert parsers_for(config, V31_TEMPLATE).tool == "deepseek_v31"
    assert parsers_for(config, V31_TEMPLATE).reasoning == "deepseek_v3"
    assert parsers_for(config, None).tool == "deepseek_v3"  # no template: the base format


def test_chat_template_from_the_jinja_file_or_the_tokenizer_config(tmp_path):
    jinja = folder(tmp_path, {}, "a", chat_template__jinja="J")
    assert chat_template(str(jinja)) == "J"
    inline = folder(tmp_path, {}, "b", tokenizer_config__json=json.dumps({"chat_template": "T"}))
    assert chat_template(str(inline)) == "T"
    named = folder(
        tmp_path,
        {},
        "c",
        tokenizer_config__json=json.dumps(
            {"chat_template": [{"name": "default", "template": "D"}, {"name": "tool_use"}]}
        ),
    )
    assert chat_template(str(named)).startswith("D")
    assert chat_template(str(tmp_path / "missing")) is None
    assert chat_template(str(folder(tmp_path, {}, "d", tokenizer_config__json="[]"))) is None


def test_every_parser_named_is_registered_in_the_installed_vllm():
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    tables = [*BY_ARCHITECTURE.values(), *BY_MODEL_TYPE.values(), DEFAULT]
    tables += [
        parsers_for(arch("DeepseekV3ForCausalLM", "deepseek_v3"), t) for t in (V31_TEMPLATE,)
    ]
    for parsers in tables:
        assert ToolParserManager.get_tool_parser(parsers.tool) is not None, parsers
        if parsers.reasoning:
            assert ReasoningParserManager.get_reasoning_parser(parsers.reasoning), parsers


def test_the_users_parser_wins_flag_by_flag():
    parsers = parsers_for(arch("Qwen3_5ForConditionalGeneration", "qwen3_5"))
    argv = parser_argv(parsers, [])
    assert argv == [
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "qwen3_coder",
        "--reasoning-parser",
        "qwen3",
    ]
    assert chosen_parsers(parsers, argv) == ("qwen3_coder", "qwen3")
    mine = parser_argv(parsers, ["--tool-call-parser", "hermes"])
    assert "--tool-call-parser" not in mine and flags(mine, "--reasoning-parser") == ["qwen3"]
    assert chosen_parsers(parsers, mine) == (None, "qwen3")
    both = parser_argv(parsers, ["--tool_call_parser=hermes", "--reasoning-parser", "deepseek_r1"])
    assert both == ["--enable-auto-tool-choice"]
    assert chosen_parsers(parsers, both) == (None, None)
    assert chosen_parsers(DEFAULT, parser_argv(DEFAULT, [])) == (None, None)


def test_plan_names_each_parser_once_and_the_users_last(tmp_path):
    model = folder(tmp_path, arch("GptOssForCausalLM", "gpt_oss"))
    args = build_parser().parse_args(["--model", str(model)])
    plan = plan_launch(args, [], cuda=False)
    assert flags(plan.vllm_argv, "--tool-call-parser") == ["openai"]
    assert flags(plan.vllm_argv, "--reasoning-parser") == ["openai_gptoss"]
    assert plan.vllm_argv.count("--enable-auto-tool-choice") == 1
    assert plan.chosen_parsers == ("openai", "openai_gptoss")
    assert any("gpt-oss" in note and "--tool-call-parser openai" in note for note in plan.notes)

    plan = plan_launch(args, ["--tool-call-parser", "hermes"], cuda=False)
    assert flags(plan.vllm_argv, "--tool-call-parser") == ["hermes"]  # the user's, once
    assert plan.chosen_parsers == (None, "openai_gptoss")

    llama = folder(tmp_path, arch("LlamaForCausalLM", "llama"), "llama")
    plan = plan_launch(build_parser().parse_args(["--model", str(llama)]), [], cuda=True)
    assert flags(plan.vllm_argv, "--tool-call-parser") == ["hermes"]
    assert "--reasoning-parser" not in plan.vllm_argv
    assert plan.chosen_parsers == (None, None)
    assert not any("parsers" in note for note in plan.notes)


# --- against the tokenizer -------------------------------------------------------------------
def vllm_args(tool: str | None, reasoning: str | None) -> Namespace:
    return Namespace(tool_call_parser=tool, reasoning_parser=reasoning or "", model="m")


def misfit_unless(*fitting: tuple[str | None, str | None]):
    calls = []

    def misfit(args, tool, reasoning):
        calls.append((tool, reasoning))
        return None if (tool, reasoning) in fitting else "no <tool_call> token\nin the vocab"

    return misfit, calls


def test_fitting_parsers_are_kept():
    args = vllm_args("qwen3_coder", "qwen3")
    misfit, calls = misfit_unless(("qwen3_coder", "qwen3"))
    assert fit_parsers(args, ("qwen3_coder", "qwen3"), misfit) is None
    assert (args.tool_call_parser, args.reasoning_parser) == ("qwen3_coder", "qwen3")
    assert calls == [("qwen3_coder", "qwen3")]


def test_a_misfit_falls_back_to_no_reasoning_then_hermes():
    args = vllm_args("qwen3_coder", "qwen3")
    misfit, _ = misfit_unless(("qwen3_coder", None))
    line = fit_parsers(args, ("qwen3_coder", "qwen3"), misfit)
    assert (args.tool_call_parser, args.reasoning_parser) == ("qwen3_coder", "")
    assert line is not None and "--reasoning-parser qwen3" in line and "in the vocab" in line

    args = vllm_args("qwen3_coder", "qwen3")
    misfit, calls = misfit_unless(("hermes", None))
    line = fit_parsers(args, ("qwen3_coder", "qwen3"), misfit)
    assert (args.tool_call_parser, args.reasoning_parser) == ("hermes", "")
    assert line is not None and line.endswith(": using --tool-call-parser hermes")
    assert calls[-1] == ("hermes", None)

    args = vllm_args("deepseek_v3", "deepseek_v3")
    misfit, calls = misfit_unless(("hermes", "deepseek_v3"))
    line = fit_parsers(args, ("deepseek_v3", "deepseek_v3"), misfit)
    assert (args.tool_call_parser, args.reasoning_parser) == ("hermes", "deepseek_v3")
    assert calls == [
        ("deepseek_v3", "deepseek_v3"),
        ("deepseek_v3", None),
        ("hermes", "deepseek_v3"),
    ]


def test_the_users_parsers_and_harmony_are_never_changed():
    args = vllm_args("my_parser", "qwen3")  # the user's tool parser, the launcher's reasoning
    misfit, _ = misfit_unless(("my_parser", None), ("hermes", None))
    fit_parsers(args, (None, "qwen3"), misfit)
    assert (args.tool_call_parser, args.reasoning_parser) == ("my_parser", "")
    args = vllm_args("my_parser", "mine")
    misfit, calls = misfit_unless()
    assert fit_parsers(args, (None, None), misfit) is None and calls == []
    args = vllm_args("openai", "openai_gptoss")
    assert fit_parsers(args, ("openai", "openai_gptoss"), misfit) is None and calls == []
    args = vllm_args("qwen3_coder", "qwen3")  # nothing fits: left for vLLM to report
    assert fit_parsers(args, ("qwen3_coder", "qwen3"), misfit) is None
    assert (args.tool_call_parser, args.reasoning_parser) == ("qwen3_coder", "qwen3")


def test_vllms_own_check_against_the_embedded_tokenizer():
    """The embedded model's tokenizer (SmolLM2) has no DeepSeek tool-call tokens: vLLM refuses
    deepseek_v3's tool parser for it and accepts hermes with the same reasoning parser."""
    from server.launcher.model_cache import ensure_model
    from server.launcher.model_support import parser_misfit

    model = str(ensure_model())
    args = Namespace(
        model=model,
        tokenizer=None,
        tokenizer_mode="auto",
        trust_remote_code=False,
        tokenizer_revision=None,
        revision=None,
    )
    reason = parser_misfit(args, "deepseek_v3", "deepseek_v3")
    assert reason is not None and "could not locate tool call start/end tokens" in reason
    assert parser_misfit(args, "hermes", "deepseek_v3") is None
    vllm = Namespace(**vars(args), tool_call_parser="deepseek_v3", reasoning_parser="deepseek_v3")
    line = fit_parsers(vllm, ("deepseek_v3", "deepseek_v3"), parser_misfit)
    assert (vllm.tool_call_parser, vllm.reasoning_parser) == ("hermes", "deepseek_v3"), line
    assert parser_misfit(args, "qwen3_coder", "qwen3") is None  # matched as text, no tokens


def test_a_hub_names_config_comes_from_its_snapshot(tmp_path):
    snapshot = folder(tmp_path, arch("GptOssForCausalLM", "gpt_oss"), "snapshot")
    asked = []

    def hub(name, revision):
        asked.append((name, revision))
        return str(snapshot)

    args = build_parser().parse_args(["--model", "openai/gpt-oss-20b"])
    plan = plan_launch(args, ["--revision", "v1"], cuda=True, hub=hub)
    assert asked == [("openai/gpt-oss-20b", "v1")]
    assert plan.vllm_argv[plan.vllm_argv.index("--model") + 1] == "openai/gpt-oss-20b"
    assert flags(plan.vllm_argv, "--tool-call-parser") == ["openai"]
    assert plan.model_config == arch("GptOssForCausalLM", "gpt_oss")

    offline = plan_launch(args, [], cuda=True, hub=lambda name, revision: None)
    assert flags(offline.vllm_argv, "--tool-call-parser") == ["hermes"]  # as before
    assert offline.model_config is None


def test_a_local_folder_is_never_looked_up_on_the_hub(tmp_path):
    def hub(name, revision):
        raise AssertionError("hub asked for a local folder")

    model = folder(tmp_path, arch("LlamaForCausalLM", "llama"))
    plan_launch(build_parser().parse_args(["--model", str(model)]), [], cuda=True, hub=hub)


def test_hub_snapshot_fetches_the_config_and_template_files(monkeypatch, tmp_path):
    import huggingface_hub

    from server.launcher.model_support import hub_snapshot

    fetched = []

    def download(name, filename, revision=None):
        fetched.append(filename)
        if filename == "chat_template.jinja":
            raise huggingface_hub.errors.EntryNotFoundError("none")
        return str(tmp_path / "snap" / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.delenv("VLLM_USE_MODELSCOPE", raising=False)
    assert hub_snapshot("org/model") == str(tmp_path / "snap")
    assert fetched == ["config.json", "tokenizer_config.json", "chat_template.jinja"]

    def offline(name, filename, revision=None):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    assert hub_snapshot("org/model") is None
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    monkeypatch.setenv("VLLM_USE_MODELSCOPE", "1")
    assert hub_snapshot("org/model") is None
