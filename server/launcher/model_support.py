"""The launcher's check of a model's layer kinds against what the kvbranch connector stores,
before vLLM starts.

The connector declares ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on and every
model vLLM runs starts with the connector. The host store keeps attention KV (full, sliding
window, chunked-local) and, beside it, the recurrent states of a hybrid attention/SSM model
(Jamba, Granite 4.0 hybrid, Nemotron-H, Falcon-H1, Qwen3-Next, Qwen3.5, ...) at the block
boundaries where vLLM's prefix caching keeps them (``server/connector/core/kv_groups.py``
decides, from the groups vLLM builds). An attention-free model (Mamba) has no attention KV, so
the connector turns its host store off and the engine serves it as plain vLLM does. The
launcher says in one line, before loading anything, which of the two a model is.

P/D and peer pulls keep the hybrid manager on too: a NIXL pull carries every attention group
of a request (a sliding-window group's window). State layers are the exception there: vLLM
0.32's NIXL transfer of their states does not give plain vLLM's answers on this CPU
(docs/models.md), so a P/D instance refuses such a model in one line, with the way out, and an
aggregated replica serves it with peer pulls off.

vLLM's own model registry decides what is hybrid (the traits it reads for
``ModelConfig.is_hybrid``, through ``vllm_compat.architecture_traits``); only a local model
folder is checked (a hub name is not read before vLLM fetches it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from server.launcher.settings import LaunchError

#: ``(is_hybrid, is_attention_free)`` of a list of architectures, ``None`` if vLLM has none.
Traits = Callable[[list[str]], "tuple[bool, bool] | None"]
#: Layer types that are attention (vLLM's ``ModelConfig.is_hybrid``: a hybrid architecture
#: whose ``layer_types`` are all these, such as granite-4.0-micro, is not hybrid).
ATTENTION_LAYER_TYPES = ("attention", "full_attention")
#: Attention layer types whose KV a NIXL pull carries (every group but a state one).
WINDOWED_LAYER_TYPES = (
    *ATTENTION_LAYER_TYPES,
    "sliding_attention",
    "chunked_attention",
    "local_attention",
)


def read_config(model_path: str) -> dict[str, Any] | None:
    """The folder's ``config.json``, or ``None`` (a hub name, or no readable JSON object)."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def state_layers(config: dict[str, Any], traits: Traits) -> str | None:
    """What of a model with this ``config.json`` the host store cannot keep — ``"hybrid"``
    (attention and state layers) or ``"attention-free"`` — or ``None``."""
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
    if hybrid:
        return "hybrid"
    return "attention-free" if attention_free else None


def _what(config: dict[str, Any], kind: str) -> str:
    model = f"{config['architectures'][0]} (model_type {config.get('model_type', '?')})"
    return f"{model} is {'a hybrid attention/SSM' if kind == 'hybrid' else 'an attention-free'}"


def store_note(config: dict[str, Any], traits: Traits) -> str | None:
    """The line a single instance prints for a model with state layers, or ``None``."""
    kind = state_layers(config, traits)
    if kind is None:
        return None
    if kind == "hybrid":
        return (
            f"{_what(config, kind)} model: the kvbranch host store keeps its attention KV and "
            "its Mamba / linear-attention states at block boundaries, which vLLM keeps only "
            "with prefix caching on (without it the store stays off; docs/models.md)"
        )
    return (
        f"{_what(config, kind)} model: the kvbranch host store keeps attention KV, so it "
        "stays off and turns reuse vLLM's own prefix cache (sessions, branches and the API "
        "work; docs/models.md)"
    )


def refusal(config: dict[str, Any], traits: Traits) -> str | None:
    """Why a P/D instance cannot run a model with this ``config.json``, or ``None``."""
    kind = state_layers(config, traits)
    if kind is None:
        return None
    return (
        f"{_what(config, kind)} model: kvbranch P/D and peer pulls carry attention KV over "
        "NIXL, not recurrent states (docs/models.md). Serve it as a single instance (python "
        "-m server without --disagg/--role; with a shared --index add --no-peer-pull), or run "
        "P/D with --no-connector"
    )


def state_layers_in_config(config: dict[str, Any] | None) -> str | None:
    """The state layers a ``config.json`` names beside attention (Mamba, linear attention), or
    ``None``. Read from the config alone, before vLLM is imported: peer pulls between
    aggregated replicas carry attention KV only (sliding-window groups included), so the
    launcher leaves them off for such a model (vLLM's registry, read later by
    :func:`check_model`, catches a hybrid model this misses)."""
    if config is None:
        return None
    layer_types = config.get("layer_types")
    if isinstance(layer_types, list):
        other = sorted({str(t) for t in layer_types if t not in WINDOWED_LAYER_TYPES})
        if other:
            return f"{', '.join(other)} layers beside attention"
    for key in ("hybrid_override_pattern", "layers_block_type", "attn_layer_indices"):
        if config.get(key):
            return f"state layers ({key})"
    return None


def vllm_traits(architectures: list[str]) -> tuple[bool, bool] | None:
    """vLLM's registry (imports vLLM: call it where the launcher imports vLLM anyway)."""
    from server.connector.vllm_compat import architecture_traits

    return architecture_traits(architectures)


def check_model(model_path: str, traits: Traits = vllm_traits, *, pd: bool = False) -> str | None:
    """For a local model: raise :class:`LaunchError` when a P/D instance (``pd``) cannot run
    it; else the line to print when the host store will stay off for it, or ``None``."""
    config = read_config(model_path)
    if config is None:
        return None
    if pd:
        reason = refusal(config, traits)
        if reason is not None:
            raise LaunchError(f"--model {model_path}: {reason}")
        return None
    return store_note(config, traits)


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


def hub_snapshot(name: str, revision: str | None = None) -> str | None:
    """For a hub model name: the local snapshot folder with its ``config.json`` (and chat
    template files where the repository has them), fetched with huggingface_hub as vLLM fetches
    them a moment later (from its cache with ``HF_HUB_OFFLINE=1``); ``None`` where that fails
    (no network, no such repository, ModelScope)."""
    if os.environ.get("VLLM_USE_MODELSCOPE", "").lower() in ("1", "true"):
        return None
    try:
        from huggingface_hub import hf_hub_download

        config = hf_hub_download(name, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - vLLM reports a model it cannot fetch
        return None
    for optional in ("tokenizer_config.json", "chat_template.jinja"):
        try:
            hf_hub_download(name, optional, revision=revision)
        except Exception:  # noqa: BLE001, S112 - absent from many repositories
            continue
    return str(Path(config).parent)
