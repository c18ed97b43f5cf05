"""tests/tiny_models.py: folder names that follow the config, a folder built once."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests import tiny_models


def test_hash_follows_the_config_and_names_the_folder(tmp_path):
    family = tiny_models.FAMILIES["dense"]
    wider = dataclasses.replace(family, config={**family.config, "hidden_size": 256})
    assert tiny_models.content_hash(family) == tiny_models.content_hash(family)
    assert tiny_models.content_hash(wider) != tiny_models.content_hash(family)
    other_dtype = dataclasses.replace(family, dtype="bfloat16")
    assert tiny_models.content_hash(other_dtype) != tiny_models.content_hash(family)
    folder = tiny_models.folder_of(family, tmp_path)
    assert folder == tmp_path / f"dense-{tiny_models.content_hash(family)}"


def test_every_family_shares_the_embedded_tokenizer_ids():
    for family in tiny_models.FAMILIES.values():
        config = tiny_models.full_config(family)
        assert config["vocab_size"] == 49152, family.name
        assert (config["bos_token_id"], config["eos_token_id"]) == (1, 2), family.name
        assert config["architectures"] == [family.architecture]


def test_unknown_family_is_refused():
    with pytest.raises(ValueError, match="no tiny model family 'nope'"):
        tiny_models.family_of("nope")


def test_a_finished_folder_is_reused_not_rebuilt(tmp_path, monkeypatch):
    built = []

    def write(family, target):
        built.append(family.name)
        (target / "config.json").write_text(json.dumps(tiny_models.full_config(family)))
        (target / tiny_models.DONE_MARKER).write_text("{}")

    monkeypatch.setattr(tiny_models, "_write", write)
    first = tiny_models.ensure("dense", tmp_path)
    assert tiny_models.ensure("dense", tmp_path) == first
    assert built == ["dense"]
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no scratch folder left


def test_a_bench_family_is_the_same_shape_wider_and_deeper():
    for name, family in tiny_models.FAMILIES.items():
        bench = tiny_models.family_of(name + tiny_models.BENCH_SUFFIX)
        scale = tiny_models.BENCH_SCALE
        assert bench.name == f"{name}-bench" and bench.architecture == family.architecture
        assert bench.config["hidden_size"] == scale * family.config["hidden_size"]
        assert bench.config["num_hidden_layers"] == scale * family.config["num_hidden_layers"]
        layers = family.config.get("layer_types")
        if layers:  # the layer pattern repeated, one type per layer
            assert bench.config["layer_types"] == layers * scale
            assert len(bench.config["layer_types"]) == bench.config["num_hidden_layers"]
        if "mamba_n_heads" in family.config:  # heads x head dim = expand x hidden
            c = bench.config
            assert c["mamba_n_heads"] * c["mamba_d_head"] == c["mamba_expand"] * c["hidden_size"]
        assert tiny_models.content_hash(bench) != tiny_models.content_hash(family)
