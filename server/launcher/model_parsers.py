"""The tool-call and reasoning parsers vLLM gets for a model (docs/models.md, "Parsers the
launcher picks").

vLLM parses a model's tool calls and reasoning with the parser named on its command line, and a
parser that does not match the model's chat format either refuses to start (gpt-oss's Harmony
format accepts only the ``openai`` tool parser) or silently misses every tool call. The launcher
names the parsers that vLLM's own recipes (github.com/vllm-project/recipes, ``models/*.yaml``)
use for the model's architecture, read from its ``config.json``; every other model keeps
``hermes``, which the launcher always used. A parser the user names after ``--`` wins, flag by
flag.

DeepSeek-V3, R1 and V3.1 share one architecture and differ in their tool-call format: the chat
template tells them apart (V3's template wraps the arguments in a json code fence, V3.1's does
not).

Pure: the config and chat template come in as values; :func:`chat_template` reads a local
folder's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TOOL_FLAG = "--tool-call-parser"
#: The tool parser of Harmony models (gpt-oss): vLLM parses their output by the model type.
HARMONY_TOOL_PARSER = "openai"
REASONING_FLAG = "--reasoning-parser"


@dataclass(frozen=True)
class Parsers:
    """vLLM parser names (as registered in vLLM 0.32's ``vllm/tool_parsers`` and
    ``vllm/reasoning``) and the family they are for (for the launcher's log line)."""

    tool: str
    reasoning: str | None
    family: str


#: What every model without an entry gets: the launcher's parser before it chose by model.
DEFAULT = Parsers("hermes", None, "default")

_QWEN3_5 = Parsers("qwen3_coder", "qwen3", "Qwen3.5")
_GLM45 = Parsers("glm45", "glm45", "GLM-4.5/4.6/4.7")
_GLM47 = Parsers("glm47", "glm45", "GLM-4.7-Flash/GLM-5")

#: By the first of ``architectures`` (what vLLM picks the model class by).
BY_ARCHITECTURE: dict[str, Parsers] = {
    # Harmony: vLLM refuses any other tool parser; the reasoning parser is the one vLLM
    # itself defaults to for gpt-oss.
    "GptOssForCausalLM": Parsers(HARMONY_TOOL_PARSER, "openai_gptoss", "gpt-oss (Harmony)"),
    "Qwen3NextForCausalLM": Parsers("hermes", None, "Qwen3-Next"),
    "Qwen3_5ForConditionalGeneration": _QWEN3_5,
    "Qwen3_5MoeForConditionalGeneration": _QWEN3_5,
    "Qwen3_5ForCausalLM": _QWEN3_5,
    "Qwen3_5MoeForCausalLM": _QWEN3_5,
    "DeepseekV32ForCausalLM": Parsers("deepseek_v32", "deepseek_v3", "DeepSeek-V3.2"),
    "Glm4MoeForCausalLM": _GLM45,
    "Glm4MoeLiteForCausalLM": _GLM47,
    "GlmMoeDsaForCausalLM": _GLM47,
}

#: By ``model_type`` first, for families that share an architecture with another one.
BY_MODEL_TYPE: dict[str, Parsers] = {
    "kimi_k2": Parsers("kimi_k2", None, "Kimi K2"),  # DeepseekV3ForCausalLM
}

_DEEPSEEK_V3 = Parsers("deepseek_v3", "deepseek_v3", "DeepSeek-V3/R1")
_DEEPSEEK_V31 = Parsers("deepseek_v31", "deepseek_v3", "DeepSeek-V3.1")
#: DeepSeek's tool-call separator token; V3 follows it with the function name and a json code
#: fence, V3.1 with the name and the bare arguments.
_DEEPSEEK_TOOL_SEP = "<｜tool▁sep｜>"
_JSON_FENCE = "```json"


def _deepseek_v3(template: str | None) -> Parsers:
    if template and _DEEPSEEK_TOOL_SEP in template and _JSON_FENCE not in template:
        return _DEEPSEEK_V31
    return _DEEPSEEK_V3


def parsers_for(config: dict[str, Any] | None, template: str | None = None) -> Parsers:
    """The parsers for a model with this ``config.json`` (``None``: unknown, the default) and
    chat template."""
    if not config:
        return DEFAULT
    model_type = config.get("model_type")
    if isinstance(model_type, str) and model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model_type]
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not architectures:
        return DEFAULT
    first = architectures[0]
    if first == "DeepseekV3ForCausalLM":
        return _deepseek_v3(template)
    return BY_ARCHITECTURE.get(first, DEFAULT) if isinstance(first, str) else DEFAULT


def chat_template(model_path: str) -> str | None:
    """The chat template a local model folder ships (``chat_template.jinja`` or
    ``tokenizer_config.json``'s ``chat_template``), or ``None``."""
    folder = Path(model_path)
    try:
        return (folder / "chat_template.jinja").read_text()
    except (OSError, UnicodeDecodeError):
        pass
    try:
        template = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        template = "\n".join(str(t.get("template", "")) for t in template if isinstance(t, dict))
    return template if isinstance(template, str) else None


def _given(passthrough: list[str], flag: str) -> bool:
    spellings = {flag, "--" + flag[2:].replace("-", "_")}
    return any(arg.partition("=")[0] in spellings for arg in passthrough)


def parser_argv(parsers: Parsers, passthrough: list[str]) -> list[str]:
    """vLLM flags for ``parsers``, leaving out each one the user gave after ``--``."""
    argv = ["--enable-auto-tool-choice"]
    if not _given(passthrough, TOOL_FLAG):
        argv += [TOOL_FLAG, parsers.tool]
    if parsers.reasoning and not _given(passthrough, REASONING_FLAG):
        argv += [REASONING_FLAG, parsers.reasoning]
    return argv


def chosen_parsers(parsers: Parsers, flags: list[str]) -> tuple[str | None, str | None]:
    """The (tool-call, reasoning) parsers among ``flags`` that the launcher chose by model
    (not its default ``hermes``, not the user's)."""
    if parsers == DEFAULT:
        return None, None
    tool = parsers.tool if TOOL_FLAG in flags else None
    reasoning = parsers.reasoning if REASONING_FLAG in flags else None
    return tool, reasoning


def fit_parsers(
    vllm_args: Any,
    chosen: tuple[str | None, str | None],
    misfit: Callable[[Any, str | None, str | None], str | None],
) -> str | None:
    """Keep the parsers the launcher chose by model only where the model's tokenizer has what
    they need (vLLM checks at start and refuses the server otherwise: a model folder with
    another family's tokenizer, as tests build them). Falls back to no reasoning parser, then
    to ``hermes``; the user's own parsers are never changed. Returns the line to say, or
    ``None`` when nothing changed."""
    tool_chosen, reasoning_chosen = chosen
    if not tool_chosen and not reasoning_chosen:
        return None
    if (tool_chosen or vllm_args.tool_call_parser) == HARMONY_TOOL_PARSER:
        return None  # Harmony parses by the model type, not by the tokenizer's tokens
    tool, reasoning = vllm_args.tool_call_parser, vllm_args.reasoning_parser or None
    reason = misfit(vllm_args, tool, reasoning)
    if reason is None:
        return None
    tries: list[tuple[str | None, str | None]] = []
    if reasoning_chosen:
        tries.append((tool, None))
    if tool_chosen:
        tries.append((DEFAULT.tool, reasoning))
        if reasoning_chosen:
            tries.append((DEFAULT.tool, None))
    for new_tool, new_reasoning in tries:
        if misfit(vllm_args, new_tool, new_reasoning) is None:
            vllm_args.tool_call_parser = new_tool
            vllm_args.reasoning_parser = new_reasoning or ""
            was = f"--tool-call-parser {tool}" + (
                f" --reasoning-parser {reasoning}" if reasoning else ""
            )
            now = f"--tool-call-parser {new_tool}" + (
                f" --reasoning-parser {new_reasoning}" if new_reasoning else ""
            )
            why = reason.strip().splitlines()[-1] if reason.strip() else "refused"
            return f"the model's tokenizer does not fit {was} ({why}): using {now}"
    return None  # vLLM reports it; the launcher exits (main)
