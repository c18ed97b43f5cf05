"""Aggregated replicas: which member's host store holds the longest run of a prompt's blocks.

The fallback of :mod:`server.plugin.peer_pull` when a turn's history has no hold and no home
that revives it (a fork's new branch, a home that refused): the cluster index's block role
(:class:`~server.index.blocks.BlockIndex`) knows, per member and tier, which block hashes it
holds. This replica renders the request's prompt to token ids as vLLM will, asks its own
connector for their chained block hashes (the ``run_coverage`` control op: this engine hashes
them as every member does, and says how much of them its own host store has), and looks the
chain up among the other sealed members' *host-store* entries. A member whose run is at least
``min_tokens`` long and longer than what this replica holds itself is asked for a *block-run*
revive of the prompt's token ids up to its run's end (:mod:`server.plugin.revive` checks
them against its own host store before any engine work).

Everything here is advisory: an entry that lies, a rendering that differs from vLLM's, a
member that no longer has the blocks each cost a recompute (the holder compares token ids, and
this replica's connector checks the pulled handle's token prefix against its real prompt).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from sdk.contract import CACHE_SALT_FIELD
from server.connector.control.models import RunCoverage, RunCoverageResult
from server.index import InstanceRecord, member_id
from server.plugin.revive_rules import MAX_REVIVE_TOKENS

logger = logging.getLogger("kvbranch.run_lookup")

#: (request body, route path) -> the prompt's token ids, None when it cannot say.
Render = Callable[[dict[str, Any], str], Awaitable["list[int] | None"]]
#: (the prompt's coverage ask, ``engine=`` the data-parallel engine asked) -> its answer.
RunCover = Callable[..., Awaitable[RunCoverageResult]]


@dataclass(frozen=True)
class RunFound:
    """The member to ask, and what to ask it: the prompt's token ids up to its run's end (and
    one token more, when the prompt has it: the revive computes one token) and the salt."""

    member: InstanceRecord
    token_ids: list[int]
    cache_salt: str | None
    run_blocks: int
    #: Leading blocks of the prompt this replica's own host store holds (a pull brings the
    #: rest of the run).
    own_blocks: int = 0


def low64(hex_hash: str) -> int:
    """A block hash as the index keys it (the low 64 bits, as vLLM's KV events carry it)."""
    return int.from_bytes(bytes.fromhex(hex_hash)[-8:], "big")


def best_run(
    hits: dict[str, Any], members: list[InstanceRecord], own_blocks: int
) -> tuple[InstanceRecord, int] | None:
    """The member whose host tier holds the longest run, when longer than ``own_blocks`` (what
    this replica's own host store holds: then it loads that itself)."""
    ranked = sorted(members, key=lambda m: (-hits[m.instance_id].host, m.instance_id))
    if not ranked or hits[ranked[0].instance_id].host <= own_blocks:
        return None
    return ranked[0], int(hits[ranked[0].instance_id].host)


class RunLookup:
    """The asking replica's block-run lookup."""

    def __init__(
        self,
        store: Any,
        render: Render,
        cover: RunCover,
        *,
        instance_id: str,
        block_size: int,
        min_tokens: int,
        engines: int = 1,
    ) -> None:
        self.store = store
        self.render = render
        #: The host store's cover of a prompt, asked of one engine (``engine=`` its rank).
        self.cover = cover
        self.instance_id = instance_id
        self.engines = engines
        self.block_size = block_size
        self.min_tokens = min_tokens

    async def find(
        self, payload: dict[str, Any], path: str, members: list[InstanceRecord], engine: int = 0
    ) -> RunFound | None:
        """Whom to ask for a block-run revive of this request's prompt (going to this replica's
        data-parallel engine ``engine``), or None. The other engines of this replica are
        members like any peer's."""
        tokens = await self.render(payload, path)
        if not tokens or len(tokens) <= self.min_tokens:
            return None
        tokens = tokens[:MAX_REVIVE_TOKENS]
        salt = payload.get(CACHE_SALT_FIELD)
        salt = salt if isinstance(salt, str) and salt else None
        cover = await self.cover(RunCoverage(token_ids=tokens, cache_salt=salt), engine=engine)
        chain = [low64(h) for h in cover.hashes]
        own = member_id(self.instance_id, engine, self.engines)
        others = [m for m in members if m.instance_id != own and m.block_size == self.block_size]
        if not chain or not others:
            return None
        hits = await self.store.block_hits(chain, others)
        best = best_run(hits, others, cover.blocks)
        if best is None or best[1] * self.block_size < self.min_tokens:
            return None
        member, blocks = best
        return RunFound(member, tokens[: blocks * self.block_size + 1], salt, blocks, cover.blocks)


def engine_render(engine_client: Any) -> Render:
    """The prompt's token ids as this replica's vLLM renders them: a chat request's messages
    through the model's chat template with the generation prompt (and its tools), a
    completion's prompt (text, or token ids) through the tokenizer. Anything else: None."""

    async def render(payload: dict[str, Any], path: str) -> list[int] | None:
        try:
            tokenizer = engine_client.get_tokenizer()
            if inspect.isawaitable(tokenizer):
                tokenizer = await tokenizer
            messages, prompt = payload.get("messages"), payload.get("prompt")
            if isinstance(messages, list):
                kwargs: dict[str, Any] = {"tokenize": True, "add_generation_prompt": True}
                if payload.get("tools"):
                    kwargs["tools"] = payload["tools"]
                ids = await asyncio.to_thread(tokenizer.apply_chat_template, messages, **kwargs)
                if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
                    ids = ids["input_ids"]
            elif isinstance(prompt, str):
                ids = await asyncio.to_thread(tokenizer.encode, prompt)
            elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
                ids = prompt
            else:
                return None
            return [int(t) for t in ids]
        except Exception as exc:  # noqa: BLE001 - a lookup that cannot render just skips
            logger.debug("kvbranch run lookup: no rendering of %s (%s)", path, exc)
            return None

    return render
