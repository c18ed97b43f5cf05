"""vLLM's own OpenAI server with no kvbranch code on its request path: the reference that the
integration tests compare greedy outputs with (the ``plain_server`` fixture).

``python -m server --no-connector`` is not that reference: it still loads the kvbranch endpoint
plugin (its guard, middleware and routes rewrite every request: cache hints, tool schemas,
sessions), so an "equals plain vLLM" check would put the same rewrite on both sides. Here
vLLM's own server runs with ``VLLM_PLUGINS=""``: vLLM loads no plugin at all, neither
kvbranch's endpoint plugin nor its general (engine) plugin.

vLLM's arguments are written here (:func:`reference_argv`), not computed by the launcher: the
launcher is under test, and a bug of its in dtype, KV cache size, eager mode, context length or
parsers would otherwise configure both sides alike and never show. Only the few launcher flags
the tests give a reference are accepted; any other is refused at start, so a test cannot pass
one that the reference would silently ignore. What of kvbranch runs here is process management
only: stop with the test process (:func:`server.launcher.process.die_with_launcher`) and leave
no engine core behind (:func:`server.launcher.process.start_reaper`).

Run as ``python -m tests.vanilla_vllm --port N [--no-connector] <flags> [-- <vLLM flags>]``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

GIB = 1 << 30

#: The dtype vLLM's CPU backend needs by ``model_type`` (config.json, or its text_config):
#: Gated DeltaNet layers run only in bfloat16 there. Every other model: float32, since bf16
#: gives garbled output on AVX2 CPUs.
CPU_DTYPES = {"qwen3_next": "bfloat16"}
DEFAULT_CPU_DTYPE = "float32"

#: Chat tests run on the embedded model (SmolLM2), whose tool calls are Hermes-style; the tiny
#: families are compared over completions, where no parser runs, and carry the embedded
#: model's tokenizer, which vLLM's Hermes parser accepts. By ``model_type`` where vLLM refuses
#: Hermes: a gpt-oss model's chat is Harmony, which vLLM serves only with its own parser.
TOOL_CALL_PARSERS = {"gpt_oss": "openai"}
DEFAULT_TOOL_CALL_PARSER = "hermes"


def build_parser() -> argparse.ArgumentParser:
    """The launcher flags a reference takes, no others (no abbreviations either)."""
    parser = argparse.ArgumentParser(prog="python -m tests.vanilla_vllm", allow_abbrev=False)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--model", default=None, help="a model folder (default: embedded)")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--kv-cache-gib", type=float, required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    # Accepted, not acted on: callers describe the reference with the launcher's flags for a
    # connector-less instance, and the reference has no connector anyway.
    parser.add_argument("--no-connector", action="store_true")
    return parser


def split_passthrough(argv: list[str]) -> tuple[list[str], list[str]]:
    """(our flags, vLLM's flags after ``--``)."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def by_model_type(model: Path, table: dict[str, str], default: str) -> str:
    """``table``'s entry for the model folder's ``model_type`` (config.json's, or its
    text_config's), else ``default``."""
    config = json.loads((model / "config.json").read_text())
    types = [config.get("model_type"), (config.get("text_config") or {}).get("model_type")]
    found = [table[t] for t in types if t in table]
    return found[0] if found else default


def mla_backend(model: Path) -> list[str]:
    """``--attention-backend CPU_MLA`` for a float32 model with MLA layers (a latent KV rank),
    else nothing."""
    config = json.loads((model / "config.json").read_text())
    sections = [config, config.get("text_config") or {}]
    float32 = by_model_type(model, CPU_DTYPES, DEFAULT_CPU_DTYPE) == "float32"
    mla = any(c.get("kv_lora_rank") for c in sections)
    return ["--attention-backend", "CPU_MLA"] if mla and float32 else []


def reference_argv(argv: list[str]) -> list[str]:
    """vLLM's ``serve`` arguments for these flags (an unknown flag exits, as argparse does)."""
    ours, passthrough = split_passthrough(argv)
    args = build_parser().parse_args(ours)
    if args.model is None:
        from server.launcher.model_cache import ensure_model

        model = ensure_model()
    else:
        model = Path(args.model).resolve()
    return [
        "--model",
        str(model),
        # the name clients send: the folder's (MODEL_NAME for the embedded model)
        "--served-model-name",
        args.served_model_name or model.name,
        "--host",
        args.host,
        "--port",
        str(args.port),
        "--kv-cache-memory-bytes",
        str(int(args.kv_cache_gib * GIB)),
        "--max-model-len",
        str(args.max_model_len),
        # usage carries the cached prompt tokens, as kvbranch's answers do
        "--enable-prompt-tokens-details",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        by_model_type(model, TOOL_CALL_PARSERS, DEFAULT_TOOL_CALL_PARSER),
        # no access log per request: the test's log tails stay readable
        "--uvicorn-log-level",
        "warning",
        "--dtype",
        by_model_type(model, CPU_DTYPES, DEFAULT_CPU_DTYPE),
        # torch.compile's warm-up costs minutes per start on CPU
        "--enforce-eager",
        # float32 MLA on a CPU with AMX tiles: vLLM's reference MLA backend, as the launcher
        # names it (vLLM's AMX one takes bfloat16 or float16 weights only)
        *mla_backend(model),
        *passthrough,  # last: vLLM keeps the last value of a repeated flag
    ]


def main(argv: list[str]) -> int:
    from server.launcher.process import die_with_launcher, start_reaper

    die_with_launcher()
    serve_argv = reference_argv(argv)  # an unknown flag exits here, before vLLM loads
    # Set before vLLM reads its environment: "" is an allow-list that names no plugin.
    os.environ["VLLM_PLUGINS"] = ""
    # Tests read vLLM's start-up lines (the KV cache size) from the log.
    os.environ["VLLM_LOGGING_LEVEL"] = "INFO"

    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    print("vllm serve " + " ".join(serve_argv), file=sys.stderr, flush=True)
    vllm_args = make_arg_parser(FlexibleArgumentParser(prog="vllm")).parse_args(serve_argv)
    validate_parsed_serve_args(vllm_args)
    start_reaper()
    uvloop.run(run_server(vllm_args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
