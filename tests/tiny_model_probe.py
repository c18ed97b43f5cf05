"""Run one tiny model family (:mod:`tests.tiny_models`) in plain vLLM, offline, and print what
the connector and the tests need to know about it: the KV cache groups vLLM builds (kind of
layer spec, block size, layers), whether prefix caching stays on and in which
``mamba_cache_mode``, and how far one changed word early in a ~300-token prompt moves the
greedy next-token logprobs (weights that ignore the context move them by ~0).

``python -m tests.tiny_model_probe FAMILY [--kv-cache-gib G] [--json OUT] [-- vLLM engine args as
KEY=VALUE]``

The engine core runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so that its
scheduler's KV cache config can be read; one engine at a time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Any

from tests.tiny_models import FAMILIES, ensure, family_of

#: One word of the prompt's first sentence changes: the last token is then several windows away
#: from it, so only full attention or a recurrent state can carry the change.
PROMPT_WORD, CHANGED_WORD = "careful", "hasty"


def prompt(words: int = 100, seed: int = 41) -> str:
    from tests.integration.helpers import system_prompt

    return system_prompt(words=words, seed=seed) + "\nWhat is the next step?"


def engine_core(llm: Any) -> Any:
    """The in-process engine core of an offline ``vllm.LLM``."""
    return llm.llm_engine.engine_core.engine_core


def kv_groups(llm: Any) -> dict[str, Any]:
    core = engine_core(llm)
    scheduler = core.scheduler
    config = scheduler.kv_cache_config
    groups = []
    for group in config.kv_cache_groups:
        spec = group.kv_cache_spec
        groups.append(
            {
                "spec": type(spec).__name__,
                "block_size": spec.block_size,
                "layers": list(group.layer_names),
                "sliding_window": getattr(spec, "sliding_window", None),
                "page_size_bytes": spec.page_size_bytes,
            }
        )
    cache = core.vllm_config.cache_config
    return {
        "num_blocks": config.num_blocks,
        "groups": groups,
        "prefix_caching": bool(cache.enable_prefix_caching),
        "mamba_cache_mode": getattr(cache, "mamba_cache_mode", None),
        "hybrid_manager_off": bool(
            core.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        ),
        "chunked_prefill": bool(core.vllm_config.scheduler_config.enable_chunked_prefill),
        "dtype": str(core.vllm_config.model_config.dtype),
    }


def next_token_shift(llm: Any) -> dict[str, Any]:
    """Greedy next-token logprobs (whole vocabulary) for the prompt and the prompt with one
    word changed: their largest and mean absolute difference, and both greedy tokens."""
    from vllm import SamplingParams

    vocab = llm.llm_engine.model_config.get_vocab_size()
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=vocab)
    original = prompt()
    changed = original.replace(PROMPT_WORD, CHANGED_WORD, 1)
    assert changed != original
    outputs = llm.generate([original, changed], params, use_tqdm=False)
    first = [dict(o.outputs[0].logprobs[0]) for o in outputs]
    shared = set(first[0]) & set(first[1])
    diffs = [abs(first[0][t].logprob - first[1][t].logprob) for t in shared]
    return {
        "prompt_tokens": len(outputs[0].prompt_token_ids),
        "max_abs_logprob_shift": max(diffs),
        "mean_abs_logprob_shift": math.fsum(diffs) / len(diffs),
        "tokens": [o.outputs[0].token_ids for o in outputs],
        "top_logprob": [max(lp.logprob for lp in f.values()) for f in first],
    }


def prefix_reuse(llm: Any, words: int = 300) -> dict[str, Any]:
    """The same ~900-token prompt twice: how many tokens the second takes from vLLM's prefix
    cache, and whether its greedy tokens are those of the first."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=8)
    text = prompt(words=words)
    first, second = (llm.generate([text], params, use_tqdm=False)[0] for _ in range(2))
    return {
        "reuse_prompt_tokens": len(second.prompt_token_ids),
        "reuse_cached_tokens": second.num_cached_tokens,
        "reuse_same_tokens": first.outputs[0].token_ids == second.outputs[0].token_ids,
    }


def probe(name: str, kv_cache_gib: float, engine_args: dict[str, Any]) -> dict[str, Any]:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    family = family_of(name)
    folder = ensure(name)
    kwargs: dict[str, Any] = {
        "model": str(folder),
        "dtype": family.dtype,
        "enforce_eager": True,
        "kv_cache_memory_bytes": int(kv_cache_gib * 2**30),
        "max_model_len": 2048,
        "max_logprobs": -1,
        "seed": 0,
    }
    kwargs.update(engine_args)
    llm = LLM(**kwargs)
    result = {"family": name, "folder": str(folder), "engine_args": engine_args}
    result.update(kv_groups(llm))
    result.update(next_token_shift(llm))
    result.update(prefix_reuse(llm))
    return result


def parse_value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def main(argv: list[str]) -> int:
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(prog="python -m tests.tiny_model_probe")
    parser.add_argument("family", choices=list(FAMILIES))
    parser.add_argument("--kv-cache-gib", type=float, default=0.25)
    parser.add_argument("--json", help="also write the result to this file")
    args = parser.parse_args(argv[:cut])
    engine_args = {}
    for item in argv[cut + 1 :]:
        key, _, value = item.partition("=")
        engine_args[key] = parse_value(value)
    result = probe(args.family, args.kv_cache_gib, engine_args)
    text = json.dumps(result, indent=1)
    print("PROBE " + json.dumps(result))
    if args.json:
        with open(args.json, "w") as out:
            out.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
