"""Synthetic, deterministic text of a given token count (the model's own tokenizer counts), for
system prompts, tool observations and cold-prefill references that are alike in every
configuration of a run and never repeat across seeds."""

from __future__ import annotations

import json
import random
from typing import Any

WORDS = (
    "the a of to and in is for on with as by at from that this it be are was not or "
    "config value request server cache block token session branch agent tool result "
    "error warning file path line function class return import module test build run "
    "deploy service user query index table column row key memory thread process queue "
    "input output status check update create delete read write open close start stop "
    "parse load save retry timeout latency batch model layer vector shard node cluster "
    "network socket handler route event log metric count total size limit offset page "
    "green blue red fast slow small large first last next previous new old local remote "
    "because when while after before during until unless however therefore"
).split()
IDENTS = (
    "alpha beta gamma delta sigma omega kappa lambda theta zeta orion vega lyra cygnus draco hydra"
).split()

_TOKENIZER: Any = None


def tokenizer() -> Any:
    """The served model's tokenizer (loaded once, from the same folder the server loads)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from transformers import AutoTokenizer

        from server.launcher.model_cache import ensure_model

        _TOKENIZER = AutoTokenizer.from_pretrained(str(ensure_model()))
    return _TOKENIZER


def count_tokens(text: str) -> int:
    return len(tokenizer().encode(text))


def _observation_line(rng: random.Random) -> str:
    kind = rng.randrange(4)
    if kind == 0:
        return (
            f"src/{rng.choice(IDENTS)}/{rng.choice(WORDS)}_{rng.randrange(100)}.py:"
            f"{rng.randrange(1, 900)}: {' '.join(rng.choices(WORDS, k=rng.randint(4, 9)))}"
        )
    if kind == 1:
        return (
            f"{rng.choice(IDENTS)}.{rng.choice(WORDS)} = {rng.randrange(10**6)} "
            f"({rng.choice(['ok', 'warn', 'fail'])}, {rng.random() * 100:.2f} ms)"
        )
    if kind == 2:
        return f"- {' '.join(rng.choices(WORDS, k=rng.randint(8, 16)))}."
    return json.dumps(
        {
            "id": rng.randrange(10**5),
            "name": rng.choice(IDENTS),
            "status": rng.choice(WORDS),
            "score": round(rng.random(), 3),
        }
    )


def text_of_tokens(rng: random.Random, n_tokens: int, style: str = "prose") -> str:
    """Deterministic (given ``rng``) text of about ``n_tokens`` tokens of the model's tokenizer;
    ``style="observation"`` reads like tool output (paths, values, JSON lines)."""
    tok = tokenizer()
    parts: list[str] = []
    count = 0
    while count < n_tokens + 8:
        if style == "observation":
            line = _observation_line(rng)
        else:
            line = " ".join(rng.choices(WORDS, k=rng.randint(8, 18))).capitalize() + "."
        parts.append(line)
        count += len(tok.encode(line, add_special_tokens=False)) + 1
    text = ("\n" if style == "observation" else " ").join(parts)
    ids = tok.encode(text, add_special_tokens=False)[:n_tokens]
    return str(tok.decode(ids))


def random_token_ids(rng: random.Random, n_tokens: int) -> list[int]:
    """Token ids of ordinary words (for cold prefill references): unique per ``rng`` state."""
    text = text_of_tokens(rng, n_tokens + 16)
    ids: list[int] = tokenizer().encode(text, add_special_tokens=False)
    return ids[:n_tokens]
