"""Tiny model folders, one per attention family, with weights that make the output depend on
the context: what the real-engine tests and benchmarks run kvbranch against plain vLLM on,
nothing downloaded.

Why not vLLM's ``--load-format dummy``: its weights (uniform in ±1e-3) give a near-uniform
next-token distribution whatever the history, so a wrongly loaded KV block could never change
an answer. Here the weights come from transformers' own initialisation at a wide range
(``initializer_range`` 0.2, seed 0), saved as safetensors: one changed word in a long prompt
moves the next-token logprobs by a clear margin (docs/models.md gives the numbers per family).

Each folder carries the embedded model's tokenizer (its vocabulary of 49152 is every config's
``vocab_size``), so the tokens, chat template and special ids are those of the rest of the
tests. Folders are cached under ``~/.cache/kvbranch/tiny-models/<family>-<hash>``: the hash
covers the config, the initialisation and this generator's version, so a changed config makes a
new folder and an unchanged one is reused across test runs (two builders racing each rename a
finished folder of their own into place; the loser's is dropped).

``python -m tests.tiny_models list | path FAMILY | build [FAMILY ...]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Bumped when the way a folder is built changes (not its config): old folders are then unused.
GENERATOR_VERSION = 1
INITIALIZER_RANGE = 0.2
SEED = 0
#: The embedded model's tokenizer files copied into every folder.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
#: Written last: a folder without it is an interrupted build.
DONE_MARKER = "tiny-model.json"
CACHE_ENV = "KVBRANCH_TINY_MODELS"
#: The CPU backend's attention block; sliding windows are two of them.
CPU_BLOCK = 128

_TOKENS = {"vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}


@dataclass(frozen=True)
class Family:
    """A model shape: its transformers config and what vLLM's CPU backend needs to run it."""

    name: str
    model_type: str
    architecture: str
    config: dict[str, Any]
    #: The dtype to serve it with on CPU (``--dtype``).
    dtype: str = "float32"
    #: What a reader should know (the models it stands for, constraints met).
    about: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            name="dense",
            model_type="qwen3",
            architecture="Qwen3ForCausalLM",
            config={
                "hidden_size": 128,
                "intermediate_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "max_position_embeddings": 4096,
                "tie_word_embeddings": True,
            },
            about="Qwen3 / Llama: full attention only",
        ),
        Family(
            name="mla",
            model_type="deepseek_v3",
            architecture="DeepseekV3ForCausalLM",
            config={
                "hidden_size": 128,
                "intermediate_size": 256,
                "moe_intermediate_size": 64,
                "num_hidden_layers": 2,
                # every layer dense: the MoE machinery adds nothing to the KV cache
                "first_k_dense_replace": 2,
                "n_routed_experts": 4,
                "n_shared_experts": 1,
                "num_experts_per_tok": 2,
                "n_group": 1,
                "topk_group": 1,
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "q_lora_rank": None,
                # CPU_MLA's only latent layout: 512 + 64 (a 576-wide cache entry)
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "qk_nope_head_dim": 64,
                "v_head_dim": 64,
                "max_position_embeddings": 4096,
                # vLLM's DeepSeek model reads lm_head from the checkpoint, never the embedding
                "tie_word_embeddings": False,
                "rope_scaling": None,
            },
            about="DeepSeek-V3 / Kimi K2: multi-head latent attention (CPU_MLA)",
        ),
        Family(
            name="gpt-oss",
            model_type="gpt_oss",
            architecture="GptOssForCausalLM",
            config={
                "hidden_size": 128,
                "intermediate_size": 128,
                "num_hidden_layers": 2,
                "num_local_experts": 4,
                "num_experts_per_tok": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "sliding_window": 2 * CPU_BLOCK,
                "layer_types": ["sliding_attention", "full_attention"],
                # vLLM's gpt-oss reads YaRN's parameters (those of the released models)
                "max_position_embeddings": 131072,
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 150000.0,
                    "factor": 32.0,
                    "beta_fast": 32.0,
                    "beta_slow": 1.0,
                    "truncate": False,
                    "original_max_position_embeddings": 4096,
                },
                "tie_word_embeddings": False,
            },
            about="gpt-oss: sliding-window and full attention layers, attention sinks, MoE",
        ),
        Family(
            name="gemma3",
            model_type="gemma3_text",
            architecture="Gemma3ForCausalLM",
            config={
                "hidden_size": 128,
                "intermediate_size": 256,
                # with two layers the scaled embedding dominates: the next token is the last
                # one whatever came before
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
                "query_pre_attn_scalar": 64,
                "sliding_window": 2 * CPU_BLOCK,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
                "max_position_embeddings": 4096,
                "tie_word_embeddings": True,
            },
            about="Gemma 3 / Cohere 2: sliding-window and full attention layers",
        ),
        Family(
            name="gdn",
            model_type="qwen3_next",
            architecture="Qwen3NextForCausalLM",
            config={
                "hidden_size": 128,
                "intermediate_size": 256,
                # two of each: with one full attention layer an early word barely moves the
                # last token's logprobs
                "num_hidden_layers": 4,
                "layer_types": ["linear_attention", "full_attention"] * 2,
                # vLLM's Qwen3-Next needs at least one MoE layer
                "num_experts": 4,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 64,
                "shared_expert_intermediate_size": 64,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "head_dim": 64,
                # the CPU Gated DeltaNet kernel's head dim
                "linear_key_head_dim": 128,
                "linear_value_head_dim": 128,
                "linear_num_key_heads": 1,
                "linear_num_value_heads": 2,
                "max_position_embeddings": 4096,
                # vLLM's Qwen3-Next reads lm_head from the checkpoint, never the embedding
                "tie_word_embeddings": False,
            },
            # the CPU Gated DeltaNet kernels run in bfloat16 only
            dtype="bfloat16",
            about="Qwen3-Next / Qwen3.5: Gated DeltaNet and full attention layers",
        ),
        Family(
            name="mamba2",
            model_type="granitemoehybrid",
            architecture="GraniteMoeHybridForCausalLM",
            config={
                "hidden_size": 128,
                "intermediate_size": 256,
                "shared_intermediate_size": 256,
                "num_hidden_layers": 4,
                "layer_types": ["mamba", "attention"] * 2,
                "num_local_experts": 0,
                "num_experts_per_tok": 0,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                # Granite's default multiplier 1.0 (not 1/sqrt(head dim)) makes every attention
                # row one-hot at this weight range: the context would not matter
                "attention_multiplier": 32**-0.5,
                "mamba_n_heads": 8,
                "mamba_d_head": 32,
                "mamba_d_state": 16,
                "mamba_n_groups": 1,
                "mamba_expand": 2,
                "mamba_d_conv": 4,
                "max_position_embeddings": 4096,
                "tie_word_embeddings": True,
            },
            about="Granite 4.0 hybrid / Nemotron-H / Jamba: Mamba 2 and attention layers",
        ),
    )
}


#: The benchmark size of a family (``<family>-bench``): the same shape, its width, depth and
#: expert sizes four times as large, so that a prefill costs what it costs a small real model
#: (a tiny model's prefill takes milliseconds, and a TTFT ratio would show only overhead).
BENCH_SUFFIX = "-bench"
BENCH_SCALE = 4
_SCALED = (
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "shared_intermediate_size",
    "num_hidden_layers",
    "first_k_dense_replace",
    # Mamba 2: heads x head dim = expand x hidden
    "mamba_n_heads",
)


def bench_family(family: Family) -> Family:
    """``family`` at :data:`BENCH_SCALE` times its width and depth (layer pattern repeated)."""
    config = dict(family.config)
    for key in _SCALED:
        if isinstance(config.get(key), int):
            config[key] *= BENCH_SCALE
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"] * BENCH_SCALE
    return Family(
        name=family.name + BENCH_SUFFIX,
        model_type=family.model_type,
        architecture=family.architecture,
        config=config,
        dtype=family.dtype,
        about=f"{family.about} (benchmark size: {BENCH_SCALE}x wider and deeper)",
        extra=family.extra,
    )


def cache_root() -> Path:
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override)
    return Path.home() / ".cache" / "kvbranch" / "tiny-models"


def full_config(family: Family) -> dict[str, Any]:
    """The family's config as handed to transformers (architecture and token ids added)."""
    return {
        "model_type": family.model_type,
        "architectures": [family.architecture],
        **_TOKENS,
        **family.config,
    }


def content_hash(family: Family) -> str:
    """What the folder's weights and config depend on, hashed."""
    recipe = {
        "config": full_config(family),
        "dtype": family.dtype,
        "initializer_range": INITIALIZER_RANGE,
        "seed": SEED,
        "generator": GENERATOR_VERSION,
        "tokenizer": TOKENIZER_FILES,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]


def folder_of(family: Family, root: Path | None = None) -> Path:
    return (root or cache_root()) / f"{family.name}-{content_hash(family)}"


def family_of(name: str) -> Family:
    """A family by name; ``<family>-bench``: its benchmark size (:func:`bench_family`)."""
    base = name.removesuffix(BENCH_SUFFIX)
    try:
        family = FAMILIES[base]
    except KeyError:
        raise ValueError(f"no tiny model family {name!r}: one of {', '.join(FAMILIES)}") from None
    return bench_family(family) if name.endswith(BENCH_SUFFIX) else family


def tokenizer_source() -> Path:
    """The embedded model's folder (prepared by the set-up)."""
    from server.launcher.model_cache import ensure_model

    return Path(ensure_model())


def _write(family: Family, target: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = full_config(family)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    config.initializer_range = INITIALIZER_RANGE
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_config(config)
    # the dtype vLLM serves it with, so `--dtype auto` (the config's) picks the right one
    config.dtype = family.dtype
    model.save_pretrained(target, safe_serialization=True)
    source = tokenizer_source()
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copyfile(source / name, target / name)
    recipe = {"family": family.name, "hash": content_hash(family), "about": family.about}
    (target / DONE_MARKER).write_text(json.dumps(recipe, indent=1) + "\n")


def ensure(name: str, root: Path | None = None) -> Path:
    """The family's folder, built first if it is not cached yet."""
    family = family_of(name)
    folder = folder_of(family, root)
    if (folder / DONE_MARKER).is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        _write(family, scratch)
        try:
            scratch.rename(folder)
        except OSError:  # another builder's finished folder is already there: ours is dropped
            if not (folder / DONE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return folder


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.tiny_models", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="each family: name, architecture, dtype, what it stands for")
    path = commands.add_parser("path", help="the family's folder (built if missing)")
    names = [*FAMILIES, *(name + BENCH_SUFFIX for name in FAMILIES)]
    path.add_argument("family", choices=names)
    build = commands.add_parser("build", help="build the families' folders (default: all)")
    build.add_argument("families", nargs="*", metavar="FAMILY")
    args = parser.parse_args(argv)
    if args.command == "list":
        for family in FAMILIES.values():
            print(f"{family.name}\t{family.architecture}\t{family.dtype}\t{family.about}")
    elif args.command == "path":
        print(ensure(args.family))
    else:
        names = args.families or list(FAMILIES)
        for name in names:
            family_of(name)  # every name checked before the first build
        for name in names:
            print(f"{name}\t{ensure(name)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
