"""Fixtures shared by the unit tests of the launcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """A model folder the launcher accepts (a config naming a known architecture)."""
    folder = tmp_path / "TinyModel"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return folder
