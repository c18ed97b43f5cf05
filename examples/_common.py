"""What every example needs and should not write again: the command line (``--base-url`` from
``$KVBRANCH_BASE_URL``, else a server started for the run), the one-line error instead of a
traceback when no server is there, the prompt-source line, and regular expressions that make
the embedded 135M model's tool arguments follow a tool's JSON schema.

Only the standard library and the repository's own packages: ``demo.py`` imports it too, and it
must run with no framework installed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from sdk import KVBranchClient, KVBranchError

BASE_URL_ENV = "KVBRANCH_BASE_URL"


def example_parser(doc: str | None, *, max_tokens: int) -> argparse.ArgumentParser:
    """The options all examples share; the description is the first line of ``doc``."""
    parser = argparse.ArgumentParser(description=(doc or "").strip().splitlines()[0])
    parser.add_argument(
        "--base-url",
        default=os.environ.get(BASE_URL_ENV),
        help=f"a running kvbranch server (default: ${BASE_URL_ENV}; without "
        "either, the example starts one for the run)",
    )
    parser.add_argument("--api-key", default=None, help="default: $KVBRANCH_API_KEY")
    parser.add_argument("--model", default=None, help="default: the server's first model")
    parser.add_argument(
        "--max-tokens", type=int, default=max_tokens, help=f"per LLM call (default {max_tokens})"
    )
    return parser


@contextmanager
def server_url(base_url: str | None, name: str = "example") -> Iterator[str]:
    """``base_url`` when given, else the URL of a kvbranch server on the embedded model that
    is started now (25-90 s on CPU) and stopped when the block ends."""
    if base_url:
        yield base_url
        return
    from server.launcher.process import (  # the server extra: only when needed
        ServerProcess,
        free_port,
    )

    port = free_port()
    print(
        f"[{name}] no --base-url / ${BASE_URL_ENV}: starting a kvbranch server on "
        f"http://127.0.0.1:{port} ...",
        end="",
        flush=True,
    )
    started = time.monotonic()
    with ServerProcess(["--kv-cache-gib", "0.5"], name=name, port=port) as server:
        print(f" ready in {time.monotonic() - started:.0f}s (log: {server.log_path})")
        yield server.url


def model_args(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    """Keyword arguments for the examples' models and clients (``ChatKVBranch``,
    ``KVBranchLLM``): the command line's server, key, model and token limit; greedy."""
    return {
        "base_url": base_url,
        "api_key": args.api_key,
        "model": args.model,
        "max_tokens": args.max_tokens,
        "temperature": 0,
    }


@contextmanager
def sdk_client(args: argparse.Namespace, name: str) -> Iterator[KVBranchClient]:
    """A :class:`sdk.KVBranchClient` on ``--base-url`` (or a server started for the run)."""
    with (
        server_url(args.base_url, name) as base_url,
        KVBranchClient(base_url, api_key=args.api_key, model=args.model) as client,
    ):
        yield client


def run(main: Callable[[], int | None]) -> None:
    """Exit with ``main()``'s status; a :class:`sdk.KVBranchError` (e.g. no server at the
    URL) is one line on stderr and status 1, not a traceback."""
    try:
        status = main()
    except KVBranchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        status = 1
    sys.exit(status or 0)


def split_line(
    split: Mapping[str, Any] | Any | None,
    *,
    cached_tokens: int | None = None,
    ttft_s: float | None = None,
) -> str:
    """Where a prompt's tokens came from (the server's ``kvbranch`` split, as an sdk object or
    a dict), or vLLM's ``cached_tokens`` when the server has no kvbranch."""
    if split is not None and not isinstance(split, Mapping):
        split = split.model_dump()
    ttft = f"   TTFT {ttft_s:.2f}s" if ttft_s is not None else ""
    if not split:
        return f"cached {cached_tokens} tokens{ttft}"
    return (
        f"prompt {split['prompt_tokens']} tokens: device {split['device_hit_tokens']}, "
        f"host {split['host_hit_tokens']}, recomputed {split['recomputed_tokens']}{ttft}"
    )


def reused_tokens(split: Mapping[str, Any] | None) -> int:
    """Prompt tokens served from a cache (device prefix cache or kvbranch host store)."""
    if not split:
        return 0
    return int(split["device_hit_tokens"]) + int(split["host_hit_tokens"])


# --- guided decoding of prose tool calls ----------------------------------------------------

_FREE_STRING = r'"[^"\\\n]{0,40}"'
_SPECIAL = set("\\.^$*+?{}[]|()")


def literal(text: str) -> str:
    """``text`` as a regex that matches exactly it (only the metacharacters escaped, newlines
    as ``\\n``: plainer than :func:`re.escape`, for the server's regex engine)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in _SPECIAL else c for c in text)


def _value_regex(schema: Mapping[str, Any]) -> str:
    """A JSON value of ``schema``: its ``enum`` (a closed set) when it has one."""
    if "enum" in schema:
        return "(" + "|".join(literal(json.dumps(v)) for v in schema["enum"]) + ")"
    kind = schema.get("type")
    if kind == "integer":
        return r"-?[0-9]{1,9}"
    if kind == "number":
        return r"-?[0-9]{1,9}(\.[0-9]{1,6})?"
    if kind == "boolean":
        return "(true|false)"
    if kind == "string":
        return _FREE_STRING
    raise ValueError(
        f"no regex for JSON schema {dict(schema)!r} (use an enum, a string, a number or a boolean)"
    )


def arguments_regex(parameters: Mapping[str, Any]) -> str:
    """A regex for a one-line JSON object that validates against ``parameters`` (an object
    schema of flat properties, all written, in schema order): the arguments a model may
    write when decoding is guided by it."""
    props = parameters.get("properties") or {}
    parts = [
        literal(json.dumps(name) + ": ") + _value_regex(schema) for name, schema in props.items()
    ]
    return r"\{" + literal(", ").join(parts) + r"\}"


def react_action_regex(tools: Mapping[str, Mapping[str, Any]]) -> str:
    """A ReAct step that calls one of ``tools`` (name → JSON schema of its parameters) with
    arguments valid for that tool (the ``Thought``/``Action``/``Action Input`` lines that
    LlamaIndex's ``ReActAgent`` parses)."""
    calls = [
        literal(f"Action: {name}\nAction Input: ") + arguments_regex(params)
        for name, params in tools.items()
    ]
    return (
        literal("Thought: I need to use a tool to help me answer the question.\n")
        + "("
        + "|".join(calls)
        + ")"
    )


#: A ReAct step that answers (after an observation): one line, not the template's placeholder.
REACT_ANSWER_REGEX = (
    literal("Thought: I can answer without using any more tools.\n") + r"Answer: [^\n\[\]]{1,200}"
)
