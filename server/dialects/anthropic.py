"""Anthropic Messages' cache hints (``/v1/messages``).

``cache_control`` breakpoints (``{"type": "ephemeral", "ttl": "5m"|"1h"}``) on tools, system
blocks and message content blocks, or the request-level ``cache_control``, pin the session's
branch — which holds the prefix up to the breakpoint — with the longest ttl given. Without an
explicit session (``X-Session-ID`` or ``vllm_xargs.session_id``) the session is ``cc-`` + a
digest of the conversation's *head*: tools, system and the first message — or the prefix up to
the last breakpoint when that ends earlier (a breakpoint on tools or system) — with
cache_control and ttl left out, the model and the client's cache_salt in. So every turn of a
conversation lands in one session, however its breakpoint moves along the messages
(Anthropic's examples mark the newest block each turn), and the server's sessions grow with
conversations, not turns; a request that repeats a tools/system prefix lands in that prefix's
session. Conversations that share a head share a session: the planner verifies tokens, so they
reuse what they have in common and never each other's divergent tails.

Usage is rewritten the way Anthropic clients read it (:class:`AnthropicUsage`, over
:func:`anthropic_usage`): ``cache_read_input_tokens`` = prompt tokens served from cache (device
+ host store + peer), ``cache_creation_input_tokens`` = tokens of the breakpoint prefix this
request computed (kvbranch keeps them: device cache, host store, tails; an earlier breakpoint's
prefix counts in full blocks only), ``input_tokens`` = the rest (for a breakpoint on the last
block: none, as with Anthropic), with the creation split by ttl in ``cache_creation``. The
numbers depend only on the request and its split, so a stream's ``message_start`` and
``message_delta`` agree (vLLM's own ``created_cache_tokens`` changes while a request runs, so it
is not used). Counting an earlier breakpoint's prefix is the engine's job (:class:`Engine`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

from sdk.contract import BREAKPOINT_SESSION_PREFIX, CACHE_CONTROL_FIELD, MESSAGES_PATH
from server.dialects.base import DialectError, Engine, Hints, digest

logger = logging.getLogger("kvbranch.dialects")

#: Anthropic's breakpoint lifetimes (its only two) and its default.
ANTHROPIC_TTLS = {"5m": 300.0, "1h": 3600.0}
ANTHROPIC_DEFAULT_TTL = "5m"


def parse_cache_control(value: Any, param: str) -> float:
    """One Anthropic ``cache_control`` → its ttl in seconds."""
    if not isinstance(value, dict) or value.get("type") != "ephemeral":
        raise DialectError(
            param,
            f"{param} must be {{'type': 'ephemeral'}} with an optional "
            f"'ttl' of '5m' or '1h', got {value!r}",
        )
    ttl = value.get("ttl", ANTHROPIC_DEFAULT_TTL)
    if not isinstance(ttl, str) or ttl not in ANTHROPIC_TTLS:  # a list or dict is unhashable
        raise DialectError(f"{param}.ttl", f"{param}.ttl must be '5m' or '1h', got {ttl!r}")
    return ANTHROPIC_TTLS[ttl]


@dataclass(frozen=True)
class Breakpoint:
    """Where a ``cache_control`` sits: ``section`` is tools, system or messages; ``index``
    the tool / system block / message; ``block`` the content block of a message."""

    section: str
    index: int
    block: int | None
    ttl_s: float
    param: str


def _block_breakpoints(
    blocks: list[Any], section: str, message: int | None, where: str
) -> list[Breakpoint]:
    """The breakpoints of one list of blocks (``where`` names it in errors): a tools or system
    block is ``(section, k, None)``, a block of message ``m``'s content ``(section, m, k)``."""
    found: list[Breakpoint] = []
    c = CACHE_CONTROL_FIELD
    for k, block in enumerate(blocks):
        if isinstance(block, dict) and block.get(c) is not None:
            param = f"{where}[{k}].{c}"
            index, sub = (k, None) if message is None else (message, k)
            ttl_s = parse_cache_control(block[c], param)
            found.append(Breakpoint(section, index, sub, ttl_s, param))
    return found


def breakpoints(payload: dict[str, Any]) -> list[Breakpoint]:
    """Every ``cache_control`` of an Anthropic request, in prompt order (tools, system,
    messages; the request-level one marks the last block). Raises :class:`DialectError`."""
    found: list[Breakpoint] = []
    c = CACHE_CONTROL_FIELD
    for section in ("tools", "system"):  # lists of blocks, each may carry a breakpoint
        items = payload.get(section)
        if isinstance(items, list):
            found += _block_breakpoints(items, section, None, section)
    messages = payload.get("messages")
    if isinstance(messages, list):
        for m, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, list):
                found += _block_breakpoints(content, "messages", m, f"messages[{m}].content")
    if payload.get(c) is not None:
        found.append(Breakpoint("end", 0, None, parse_cache_control(payload[c], c), c))
    return found


def _strip_cache_control(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_cache_control(v) for k, v in value.items() if k != CACHE_CONTROL_FIELD}
    if isinstance(value, list):
        return [_strip_cache_control(v) for v in value]
    return value


def prefix_of(payload: dict[str, Any], point: Breakpoint) -> dict[str, Any]:
    """The Anthropic request cut right after ``point`` (prompt order: tools, system,
    messages), cache_control kept: tools/system/messages only."""
    tools = payload.get("tools") if isinstance(payload.get("tools"), list) else None
    system = payload.get("system")
    found = payload.get("messages")
    messages: list[Any] = found if isinstance(found, list) else []
    cut: dict[str, Any] = {}
    if point.section == "tools":
        cut["tools"] = (tools or [])[: point.index + 1]
        cut["messages"] = []
        return cut
    if tools is not None:
        cut["tools"] = tools
    if point.section == "system":
        cut["system"] = system[: point.index + 1] if isinstance(system, list) else system
        cut["messages"] = []
        return cut
    if system is not None:
        cut["system"] = system
    if point.section == "end":
        cut["messages"] = messages
        return cut
    head = list(messages[: point.index])
    last = messages[point.index]
    if isinstance(last, dict) and isinstance(last.get("content"), list):
        last = dict(last, content=last["content"][: (point.block or 0) + 1])
    cut["messages"] = head + [last]
    return cut


def at_end(payload: dict[str, Any], point: Breakpoint) -> bool:
    """Whether the breakpoint marks the whole prompt (the last block of the last message, or
    the request-level cache_control)."""
    if point.section == "end":
        return True
    messages = payload.get("messages")
    if point.section != "messages" or not isinstance(messages, list):
        return not messages  # tools/system only count as the end with no messages at all
    if point.index != len(messages) - 1:
        return False
    content = messages[point.index].get("content")
    return isinstance(content, list) and point.block == len(content) - 1


def conversation_head(payload: dict[str, Any], point: Breakpoint) -> dict[str, Any]:
    """What names a request's derived session: the prefix up to ``point`` when that ends in
    tools, system or the first message, else tools, system and the first message — the part
    of a conversation that every one of its turns repeats (cache_control kept)."""
    if point.section in ("tools", "system") or (point.section == "messages" and point.index == 0):
        return prefix_of(payload, point)
    head = prefix_of(payload, Breakpoint("end", 0, None, point.ttl_s, point.param))
    head["messages"] = head["messages"][:1]
    return head


def breakpoint_session(payload: dict[str, Any], point: Breakpoint) -> str:
    """``cc-`` + a digest of the conversation's head (:func:`conversation_head`, without
    cache_control), the model and the client's cache_salt: every turn of a conversation, and
    every request repeating a tools/system prefix, gets the same session. Never raises on odd
    text (a lone surrogate is digested as its code point: ``surrogatepass``)."""
    canonical = {
        "prefix": _strip_cache_control(conversation_head(payload, point)),
        "model": payload.get("model"),
        "cache_salt": payload.get("cache_salt"),
    }
    text = json.dumps(
        canonical, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str
    )
    return digest(BREAKPOINT_SESSION_PREFIX, text.encode("utf-8", "surrogatepass"))


class AnthropicDialect:
    """``cache_control`` breakpoints → a derived ``cc-`` session, a pin lease and the usage
    Anthropic clients read."""

    name: str = "anthropic"
    paths: tuple[str, ...] = (MESSAGES_PATH,)
    session_field: bool = False  # /v1/messages has no session_id field: vllm_xargs carries it

    def check(self, payload: dict[str, Any]) -> None:
        breakpoints(payload)

    def hints(self, payload: dict[str, Any], own_session: bool) -> Hints:
        points = breakpoints(payload)
        if not points:
            return Hints()
        last = points[-1]
        ttl = max(p.ttl_s for p in points)
        cut = None if at_end(payload, last) else prefix_of(payload, last)
        return Hints(
            session_id=None if own_session else breakpoint_session(payload, last),
            pin_ttl_s=ttl,
            usage=AnthropicUsage(ttl_s=ttl, prefix_request=cut, model=payload.get("model")),
        )


# --- the response's usage ----------------------------------------------------------------------
def anthropic_usage(
    usage: dict[str, Any],
    *,
    prefix_tokens: int | None,
    split: dict[str, Any] | None,
    ttl_s: float,
    block_size: int | None = None,
) -> dict[str, Any]:
    """Anthropic usage for a request with breakpoints. ``usage`` is vLLM's (input = prompt -
    read - created); ``prefix_tokens`` the breakpoint prefix's length (None: the whole
    prompt); ``split`` kvbranch's prompt-source split, when known; ``block_size`` the cache's
    block size (only full blocks are written, so an earlier breakpoint's prefix is cut to
    them)."""
    read0 = usage.get("cache_read_input_tokens")
    created0 = usage.get("cache_creation_input_tokens")
    total = int(usage.get("input_tokens") or 0) + int(read0 or 0) + int(created0 or 0)
    read = int(read0 or 0)
    if split is not None and split.get("prompt_tokens"):
        total = int(split["prompt_tokens"])
        read = sum(
            int(split.get(k) or 0)
            for k in ("device_hit_tokens", "host_hit_tokens", "remote_hit_tokens")
        )
    read = min(read, total)
    prefix = total if prefix_tokens is None else min(int(prefix_tokens), total)
    if prefix_tokens is not None and block_size:
        prefix -= prefix % block_size
    written = max(0, prefix - read)
    out = dict(usage)
    out["cache_read_input_tokens"] = read
    out["cache_creation_input_tokens"] = written
    out["input_tokens"] = max(0, total - read - written)
    long_ttl = ttl_s >= ANTHROPIC_TTLS["1h"]
    out["cache_creation"] = {
        "ephemeral_5m_input_tokens": 0 if long_ttl else written,
        "ephemeral_1h_input_tokens": written if long_ttl else 0,
    }
    return out


@dataclass
class AnthropicUsage:
    """Rewrites the usage of one ``/v1/messages`` response that had breakpoints."""

    ttl_s: float
    #: The request cut at its last breakpoint, when that is not the whole prompt.
    prefix_request: dict[str, Any] | None = None
    model: Any = None
    _prefix_tokens: int | None = field(default=None, init=False)
    _counted: bool = field(default=False, init=False)

    async def prefix_tokens(self, engine: Engine | None) -> int | None:
        """Tokens of the breakpoint prefix, counted by the engine (None: the whole prompt, or
        when it cannot be rendered alone — then the whole prompt counts). Counted once."""
        if self._counted or self.prefix_request is None:
            return self._prefix_tokens
        self._counted = True
        if engine is None:
            return None
        try:
            request = dict(self.prefix_request, model=self.model)
            self._prefix_tokens = await engine.count_tokens(MESSAGES_PATH, request)
        except Exception as exc:  # noqa: BLE001 - usage must never break a response
            logger.debug("kvbranch: breakpoint prefix not countable: %s", exc)
        return self._prefix_tokens

    async def rewrite(
        self, payload: dict[str, Any], split: dict[str, Any] | None, engine: Engine | None
    ) -> bool:
        """Rewrite ``payload["usage"]`` and ``payload["message"]["usage"]`` (a stream's
        ``message_start``) in place; True when something changed."""
        targets = [payload]
        if isinstance(payload.get("message"), dict):
            targets.append(payload["message"])
        changed = False
        for target in targets:
            usage = target.get("usage")
            if isinstance(usage, dict) and "input_tokens" in usage:
                target["usage"] = anthropic_usage(
                    usage,
                    prefix_tokens=await self.prefix_tokens(engine),
                    split=split,
                    ttl_s=self.ttl_s,
                    block_size=engine.block_size if engine is not None else None,
                )
                changed = True
        return changed

    async def rewrite_event(
        self, event: bytes, split: dict[str, Any] | None, engine: Engine | None
    ) -> bytes:
        """The same for one SSE event (``event: ...\\ndata: {...}``)."""
        if b'"usage"' not in event:
            return event
        lines = event.split(b"\n")
        for i, line in enumerate(lines):
            if not line.startswith(b"data: {"):
                continue
            try:
                data = json.loads(line[len(b"data: ") :])
            except ValueError:
                return event
            if isinstance(data, dict) and await self.rewrite(data, split, engine):
                lines[i] = b"data: " + json.dumps(data, separators=(",", ":")).encode()
        return b"\n".join(lines)
