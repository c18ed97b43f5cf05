"""Which engines the host store serves (``core/kv_groups.py``), what kind vLLM's KV cache specs
are (``vllm_compat.spec_kind``), and the launcher's refusal of hybrid and attention-free models
(``server/launcher/model_support.py``); docs/models.md is the user's side of these rules."""

from __future__ import annotations

import json

import pytest
import torch

from server.connector import vllm_compat
from server.connector.core.kv_groups import FULL_ATTENTION, state_groups, store_off_reason
from server.launcher.model_support import check_model, refusal, state_layers_in_config
from server.launcher.settings import LaunchError


# --- the host store's rule ------------------------------------------------------------------
@pytest.mark.parametrize(
    "kinds",
    [
        [FULL_ATTENTION],
        ["sliding_window"],
        ["chunked_local"],
        ["sliding_window", FULL_ATTENTION],
        [FULL_ATTENTION, "sliding_window", "sliding_window", "sliding_window"],
    ],
    ids=["full", "sliding", "chunked", "gpt-oss", "gemma3"],
)
def test_attention_groups_are_stored(kinds):
    """Every group whose blocks hold per-token KV, however many groups (the hybrid manager on)."""
    assert store_off_reason(kinds, [128] * len(kinds)) is None


@pytest.mark.parametrize("kinds", [["mixed"], ["Other"], [FULL_ATTENTION, "Other"]])
def test_a_group_of_another_kind_turns_the_store_off(kinds):
    reason = store_off_reason(kinds, [128] * len(kinds), states_at_boundaries=True)
    assert reason is not None
    assert all(kind in reason for kind in kinds if kind not in ("full_attention", "sliding_window"))


@pytest.mark.parametrize(
    "kinds", [[FULL_ATTENTION, "mamba"], ["mamba", "sliding_window", FULL_ATTENTION]]
)
def test_state_groups_are_stored_where_vllm_keeps_states_at_boundaries(kinds):
    """Mamba / Gated DeltaNet groups beside attention: stored with prefix caching's ``align``
    mode (the states at block boundaries, handed over); without it there is none to resume."""
    assert store_off_reason(kinds, [384] * len(kinds), states_at_boundaries=True) is None
    reason = store_off_reason(kinds, [384] * len(kinds), states_at_boundaries=False)
    assert reason is not None and "align" in reason
    assert state_groups(kinds) == {kinds.index("mamba")}


def test_only_states_turns_the_store_off():
    """An attention-free model (Mamba, Mamba 2): no attention KV for the slots to hold."""
    assert "only recurrent states" in (store_off_reason(["mamba"], states_at_boundaries=True) or "")


def test_different_block_sizes_turn_the_store_off():
    reason = store_off_reason([FULL_ATTENTION, "sliding_window"], [128, 384])
    assert reason is not None and "128, 384" in reason


def test_attention_free_turns_the_store_off():
    assert "attention-free" in (store_off_reason([]) or "")


# --- vLLM's specs, by kind ------------------------------------------------------------------
def attention(cls, **extra):
    return cls(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, **extra)


def test_spec_kinds_of_vllms_specs():
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SinkFullAttentionSpec,
        SlidingWindowSpec,
        UniformTypeKVCacheSpecs,
    )

    full = attention(FullAttentionSpec)
    # a sliding-window layer promoted to full attention (hybrid manager off) is still full
    promoted = attention(FullAttentionSpec, sliding_window=256)
    sliding = attention(SlidingWindowSpec, sliding_window=256)
    kinds = {
        "full": (full, FULL_ATTENTION),
        "promoted": (promoted, FULL_ATTENTION),
        "mla": (attention(MLAAttentionSpec), FULL_ATTENTION),
        "sliding": (sliding, "sliding_window"),
        "chunked": (attention(ChunkedLocalAttentionSpec, attention_chunk_size=64), "chunked_local"),
        "sink": (attention(SinkFullAttentionSpec, sink_len=4), "SinkFullAttentionSpec"),
        "mamba": (
            MambaSpec(block_size=16, shapes=((4, 8),), dtypes=(torch.float32,)),
            "mamba",
        ),
        "uniform full": (
            UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full, "b": promoted}),
            FULL_ATTENTION,
        ),
        "uniform mixed": (
            UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": full, "b": sliding}),
            "mixed",
        ),
    }
    for name, (spec, kind) in kinds.items():
        assert vllm_compat.spec_kind(spec) == kind, name

    config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], sliding), KVCacheGroupSpec(["l1"], full)],
    )
    assert vllm_compat.kv_group_kinds(config) == ["sliding_window", FULL_ATTENTION]
    assert vllm_compat.kv_group_kinds(None) == []


# --- the launcher's refusal -----------------------------------------------------------------
TRAITS = {
    "LlamaForCausalLM": (False, False),
    "JambaForCausalLM": (True, False),
    "GraniteMoeHybridForCausalLM": (True, False),
    "MambaForCausalLM": (False, True),
}


def traits(architectures):
    return next((TRAITS[a] for a in architectures if a in TRAITS), None)


def test_full_attention_and_sliding_window_models_pass():
    assert refusal({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, traits) is None
    sliding = {
        "architectures": ["LlamaForCausalLM"],
        "layer_types": ["sliding_attention", "full_attention"],
    }
    assert refusal(sliding, traits) is None


def test_hybrid_model_refused_by_pd_naming_its_type():
    reason = refusal({"architectures": ["JambaForCausalLM"], "model_type": "jamba"}, traits)
    assert reason is not None
    assert "JambaForCausalLM (model_type jamba)" in reason
    assert "hybrid attention/SSM" in reason and "--no-connector" in reason


def test_hybrid_architecture_with_attention_layers_only_passes():
    """granite-4.0-micro: a hybrid architecture whose layers are all attention (as vLLM's
    ``ModelConfig.is_hybrid`` reads it)."""
    config = {
        "architectures": ["GraniteMoeHybridForCausalLM"],
        "layer_types": ["attention", "attention"],
    }
    assert refusal(config, traits) is None
    config["layer_types"] = ["mamba", "attention"]
    assert "hybrid attention/SSM" in (refusal(config, traits) or "")


def test_attention_free_model_refused_by_pd():
    reason = refusal({"architectures": ["MambaForCausalLM"], "model_type": "mamba"}, traits)
    assert reason is not None and "attention-free" in reason


@pytest.mark.parametrize(
    "config",
    [{}, {"architectures": []}, {"architectures": "Jamba"}, {"architectures": [1]}],
    ids=["none", "empty", "string", "not-str"],
)
def test_unreadable_architectures_are_left_to_vllm(config):
    assert refusal(config, traits) is None


@pytest.mark.parametrize(
    "config",
    [
        None,
        {"architectures": ["LlamaForCausalLM"]},
        {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 256},
        {"layer_types": ["chunked_attention", "full_attention"]},
        {"sliding_window": 4096},  # Mistral 7B v0.1: every layer windowed
    ],
    ids=["no-config", "dense", "gemma3", "llama4", "mistral"],
)
def test_peer_pulls_carry_every_attention_model(config):
    assert state_layers_in_config(config) is None


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"layer_types": ["linear_attention", "full_attention"]}, "linear_attention"),
        ({"layer_types": ["mamba", "attention"]}, "mamba"),
        ({"hybrid_override_pattern": "M-M*"}, "hybrid_override_pattern"),
        ({"layers_block_type": ["mamba", "attention"]}, "layers_block_type"),
        ({"attn_layer_indices": [3]}, "attn_layer_indices"),
    ],
    ids=["qwen3-next", "granite-h", "nemotron-h", "jamba", "falcon-h1"],
)
def test_peer_pulls_stay_off_for_state_layers(config, named):
    assert named in (state_layers_in_config(config) or "")


def test_unknown_architecture_is_left_to_vllm():
    assert refusal({"architectures": ["NoSuchForCausalLM"]}, traits) is None


def test_check_model_reads_the_folder(tmp_path):
    """A P/D instance refuses a hybrid model; a single instance serves it and says in one line
    what the host store keeps of it."""
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["JambaForCausalLM"]}))
    with pytest.raises(LaunchError) as e:
        check_model(str(tmp_path), traits, pd=True)
    assert str(e.value).startswith(f"--model {tmp_path}: JambaForCausalLM")
    note = check_model(str(tmp_path), traits)
    assert note is not None and note.startswith("JambaForCausalLM")
    assert "host store" in note and "states at block boundaries" in note
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert check_model(str(tmp_path), traits) is None
    assert check_model(str(tmp_path), traits, pd=True) is None
    (tmp_path / "config.json").write_text("[not an object")
    assert check_model(str(tmp_path), traits, pd=True) is None  # vLLM reports it
    assert check_model("HuggingFaceTB/SmolLM2-135M-Instruct", traits, pd=True) is None  # hub


def test_block_bytes_count_each_layer_once():
    """A uniform-type group (full-attention layers of different shapes) already sums its
    layers' pages; a plain group has one page per layer."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheGroupSpec,
        UniformTypeKVCacheSpecs,
    )

    small = attention(FullAttentionSpec)
    wide = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype=torch.float32)
    uniform = UniformTypeKVCacheSpecs(block_size=16, kv_cache_specs={"a": small, "b": wide})
    assert vllm_compat.group_block_bytes(KVCacheGroupSpec(["a", "b"], uniform)) == (
        small.page_size_bytes + wide.page_size_bytes
    )
    assert vllm_compat.group_block_bytes(KVCacheGroupSpec(["a", "b", "c"], small)) == (
        3 * small.page_size_bytes
    )


def test_mla_on_the_cpu_loads_no_prefix():
    """vLLM's CPU platform turns prefix caching off for MLA (its backend computes a prompt
    from token 0): the host store must stay off there, and only there."""
    from types import SimpleNamespace

    def config(use_mla: bool, prefix_caching: bool) -> SimpleNamespace:
        return SimpleNamespace(
            model_config=SimpleNamespace(use_mla=use_mla),
            cache_config=SimpleNamespace(enable_prefix_caching=prefix_caching),
        )

    reason = vllm_compat.prefix_reuse_off_reason(config(True, False))
    assert reason is not None and "MLA" in reason
    assert vllm_compat.prefix_reuse_off_reason(config(False, False)) is None
    assert vllm_compat.prefix_reuse_off_reason(config(True, True)) is None  # a GPU backend
    assert vllm_compat.prefix_reuse_off_reason(config(False, True)) is None


def test_sparse_attention_groups_are_stored_as_attention():
    """DeepSeek-V3.2 / GLM-5 (GPU only): the MLA latent and the indexer's keys are both
    per-token caches that stay for the whole request (vLLM's MLAAttentionSpec, the indexer's
    with ``cache_role=INDEXER``), so a slot keeps both groups' blocks of a position."""
    from vllm.v1.kv_cache_interface import (
        KVCacheConfig,
        KVCacheGroupSpec,
        MLAAttentionSpec,
        SparseCacheRole,
    )

    latent = MLAAttentionSpec(block_size=64, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    indexer = MLAAttentionSpec(
        block_size=64,
        num_kv_heads=1,
        head_size=128,
        dtype=torch.bfloat16,
        cache_role=SparseCacheRole.INDEXER,
    )
    config = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["l0.attn", "l1.attn"], latent),
            KVCacheGroupSpec(["l0.indexer", "l1.indexer"], indexer),
        ],
    )
    kinds = vllm_compat.kv_group_kinds(config)
    assert kinds == [FULL_ATTENTION, FULL_ATTENTION]
    assert store_off_reason(kinds, vllm_compat.kv_group_block_sizes(config)) is None
    assert vllm_compat.kv_group_layers(config)[1] == ["l0.indexer", "l1.indexer"]
