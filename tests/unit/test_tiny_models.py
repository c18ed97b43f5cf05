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
