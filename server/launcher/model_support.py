"""The launcher's check that a model can run with the kvbranch connector, before vLLM starts.

vLLM turns its hybrid KV cache manager off for a KV connector that does not declare
``SupportsHMA``, and kvbranch's does not (``server/connector/core/kv_groups.py`` says which KV
cache groups the host store serves). A model with sliding-window layers then runs with every
layer managed as full attention, which is correct. A hybrid attention/SSM model (Jamba,
Granite 4.0 hybrid, Nemotron-H, Falcon-H1, Qwen3-Next, ...) cannot start that way: vLLM fails
in its engine core, after loading the weights, with a traceback about KV cache specs that does
not name the connector. An attention-free model (a pure SSM such as Mamba) has no KV blocks for
the host store at all. The launcher refuses both in one line that names the model type, the
reason and the way out (``--no-connector``), before anything is loaded.

vLLM's own model registry decides what is hybrid (the traits it reads for
``ModelConfig.is_hybrid``, through ``vllm_compat.architecture_traits``); only a local model
folder is checked (a hub name is not read before vLLM fetches it).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from server.launcher.settings import LaunchError

#: ``(is_hybrid, is_attention_free)`` of a list of architectures, ``None`` if vLLM has none.
Traits = Callable[[list[str]], "tuple[bool, bool] | None"]
#: Layer types that are attention (vLLM's ``ModelConfig.is_hybrid``: a hybrid architecture
#: whose ``layer_types`` are all these, such as granite-4.0-micro, is not hybrid).
ATTENTION_LAYER_TYPES = ("attention", "full_attention")


def read_config(model_path: str) -> dict[str, Any] | None:
    """The folder's ``config.json``, or ``None`` (a hub name, or no readable JSON object)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def refusal(config: dict[str, Any], traits: Traits) -> str | None:
    """Why a model with this ``config.json`` cannot run with the connector, or ``None``."""
    architectures = config.get("architectures")
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        return None  # vLLM reports a config it cannot read
    found = traits(architectures) if architectures else None
    if found is None:
        return None
    hybrid, attention_free = found
    layer_types = config.get("layer_types")
    if hybrid and isinstance(layer_types, list) and layer_types:
        hybrid = not all(t in ATTENTION_LAYER_TYPES for t in layer_types)
    what = f"{architectures[0]} (model_type {config.get('model_type', '?')})"
    if hybrid:
        return (
            f"{what} is a hybrid attention/SSM model: its state layers need vLLM's hybrid KV "
            "cache manager, which the kvbranch connector does not support (vLLM turns it off "
            "and the engine would fail at start; docs/models.md). Run it with --no-connector "
            "(vLLM's own prefix cache, no host store)"
        )
    if attention_free:
        return (
            f"{what} is attention-free: it has no KV cache blocks for the kvbranch host store "
            "(docs/models.md). Run it with --no-connector"
        )
    return None


def vllm_traits(architectures: list[str]) -> tuple[bool, bool] | None:
    """vLLM's registry (imports vLLM: call it where the launcher imports vLLM anyway)."""
    from server.connector.vllm_compat import architecture_traits

    return architecture_traits(architectures)


def check_model(model_path: str, traits: Traits = vllm_traits) -> None:
    """Raise :class:`LaunchError` for a local model the connector cannot serve."""
    config = read_config(model_path)
    reason = refusal(config, traits) if config is not None else None
    if reason is not None:
        raise LaunchError(f"--model {model_path}: {reason}")


def parser_misfit(vllm_args: Any, tool: str | None, reasoning: str | None) -> str | None:
    """What vLLM's own start-up check of the parsers against the model's tokenizer
    (``ParserManager.get_parser`` with the tokenizer, which the API server runs after the
    engine has started) says, run here before anything is loaded; ``None`` when they fit.

    Imports vLLM and loads the tokenizer (a second or so): call it where the launcher has
    imported vLLM anyway."""
    from vllm.parser import ParserManager
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(
        vllm_args.tokenizer or vllm_args.model,
        tokenizer_mode=vllm_args.tokenizer_mode,
        trust_remote_code=vllm_args.trust_remote_code,
        revision=vllm_args.tokenizer_revision or vllm_args.revision,
    )
    try:
        ParserManager.get_parser(
            tool_parser_name=tool,
            reasoning_parser_name=reasoning,
            enable_auto_tools=True,
            model_name=vllm_args.model,
            tokenizer=tokenizer,
        )
    except Exception as exc:  # noqa: BLE001 - vLLM raises TypeError, a parser anything
        return str(exc.__cause__ or exc)  # the parser's own words, without vLLM's preamble
    return None
