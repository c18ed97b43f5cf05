"""Cache hints in the clients' own dialects, mapped onto kvbranch sessions and pins.

Users arrive with the clients they already have; those already speak a cache-hint dialect:

* **OpenAI** (chat completions, completions, responses): ``prompt_cache_key`` names the
  request's cache entry — kvbranch makes it the request's *session* (exactly what
  ``session_id``/``X-Session-ID`` do, so it is scoped to the caller's tenant the same way:
  the registry keys sessions by (tenant, id)). A key that is a kvbranch id is used as is (then
  ``/v1/kvbranch/sessions/<key>`` addresses it); any other string becomes
  ``pck-`` + a digest of it. ``prompt_cache_retention`` (``"in_memory"``/``"in-memory"``: the
  server's default lease; ``"24h"`` or another duration up to 24 h) and
  ``prompt_cache_options.ttl`` (``"30m"``) become the *pin lease* of the session's branch; the
  pin is budget-capped like any automatic pin (it degrades to LRU retention, it never fails the
  request). ``usage.prompt_tokens_details.cached_tokens`` stays vLLM's number.
* **Anthropic Messages** (``/v1/messages``): ``cache_control`` breakpoints
  (``{"type": "ephemeral", "ttl": "5m"|"1h"}``) on tools, system blocks and message content
  blocks, or the request-level ``cache_control``, pin the session's branch — which holds the
  prefix up to the breakpoint — with the longest ttl given. Without an explicit session
  (``X-Session-ID`` or ``vllm_xargs.session_id``) the session is ``cc-`` + a digest of the
  conversation's *head*: tools, system and the first message — or the prefix up to the last
  breakpoint when that ends earlier (a breakpoint on tools or system) — with cache_control and
  ttl left out, the model and the client's cache_salt in. So every turn of a conversation lands
  in one session, however its breakpoint moves along the messages (Anthropic's examples mark
  the newest block each turn), and the server's sessions grow with conversations, not turns;
  a request that repeats a tools/system prefix lands in that prefix's session. Conversations
  that share a head share a session: the planner verifies tokens, so they reuse what they have
  in common and never each other's divergent tails. Usage is rewritten the
  way Anthropic clients read it: ``cache_read_input_tokens`` = prompt tokens served from cache
  (device + host store + peer), ``cache_creation_input_tokens`` = tokens of the breakpoint
  prefix this request computed (kvbranch keeps them: device cache, host store, tails; an
  earlier breakpoint's prefix counts in full blocks only), ``input_tokens`` = the rest (for a
  breakpoint on the last block: none, as with Anthropic), with the creation split by ttl in
  ``cache_creation``. The numbers depend only on the request and its split, so a stream's
  ``message_start`` and ``message_delta`` agree (vLLM's own ``created_cache_tokens`` changes
  while a request runs, so it is not used).

An explicit session always wins over a derived one. A hint the server cannot use (a wrong type,
an unknown retention or ttl) is a 400 naming the field: :func:`problem` (the guard calls it).

Everything here is pure (dicts in, dicts out) except :meth:`AnthropicUsage.prefix_tokens`,
which renders an earlier-breakpoint prefix through vLLM's own ``count_tokens`` path.
(Over 400 lines, most of them formatted validation messages: both dialects share one request
hook and one usage hook, and stay in one module so the README's table maps to one file.)
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from dataclasses import dataclass, field
from typing import Any

from sdk.contract import (
    BREAKPOINT_SESSION_PREFIX,
    CACHE_CONTROL_FIELD,
    CACHE_KEY_SESSION_PREFIX,
    CHAT_COMPLETIONS_PATH,
    COMPLETIONS_PATH,
    MAX_TTL_S,
    MESSAGES_PATH,
    PIN_TTL_XARG,
    PROMPT_CACHE_KEY_FIELD,
    PROMPT_CACHE_OPTIONS_FIELD,
    PROMPT_CACHE_RETENTION_FIELD,
    RESPONSES_PATH,
    SESSION_HEADER,
    SESSION_XARG,
    check_id,
)
from sdk.contract.wire import has_lone_surrogate

logger = logging.getLogger("kvbranch.dialects")

__all__ = ["SESSION_HEADER", "AnthropicUsage", "DialectError", "Hints", "apply", "problem"]

#: Routes whose body takes OpenAI's cache hints (and has vLLM's ``session_id`` field).
OPENAI_PATHS = (CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, RESPONSES_PATH)
#: Retention values meaning "the server's default lease" (OpenAI spells it with ``_``).
IN_MEMORY = ("in_memory", "in-memory")
#: Anthropic's breakpoint lifetimes (its only two) and its default.
ANTHROPIC_TTLS = {"5m": 300.0, "1h": 3600.0}
ANTHROPIC_DEFAULT_TTL = "5m"
MAX_CACHE_KEY_CHARS = 1024
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h)\s*$")
_UNIT_S = {"s": 1.0, "m": 60.0, "h": 3600.0}
_DIGEST_CHARS = 32


class DialectError(ValueError):
    """A cache hint the server cannot use: 400 with ``param`` and ``message``."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


# --- parsing hints -------------------------------------------------------------------------------
def parse_duration(value: Any, param: str) -> float:
    """``"24h"``, ``"30m"``, ``"90s"`` → seconds (more than 0, at most 24 h)."""
    match = _DURATION.match(value) if isinstance(value, str) else None
    seconds = float(match.group(1)) * _UNIT_S[match.group(2)] if match else 0.0
    if not match or seconds <= 0 or seconds > MAX_TTL_S:
        raise DialectError(
            param,
            f"{param} must be a duration such as '30m' or '24h' "
            f"(more than 0, at most 24h), got {value!r}",
        )
    return seconds


def parse_retention(value: Any) -> float | None:
    """OpenAI's ``prompt_cache_retention`` → pin lease in seconds, or None for the server's
    default lease (``in_memory``) or no hint."""
    param = PROMPT_CACHE_RETENTION_FIELD
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in IN_MEMORY:
        return None
    if not isinstance(value, str) or not _DURATION.match(value):
        raise DialectError(
            param,
            f"{param} must be 'in_memory' (also 'in-memory') or a "
            f"duration such as '24h' (at most 24h), got {value!r}",
        )
    return parse_duration(value, param)


def parse_cache_options(value: Any) -> float | None:
    """OpenAI's ``prompt_cache_options`` (``{"mode": ..., "ttl": "30m"}``) → its ttl."""
    param = PROMPT_CACHE_OPTIONS_FIELD
    if value is None:
        return None
    if not isinstance(value, dict):
        raise DialectError(
            param, f"{param} must be an object such as {{'ttl': '30m'}}, got {value!r}"
        )
    mode = value.get("mode")
    if mode is not None and mode not in ("implicit", "explicit"):
        raise DialectError(
            f"{param}.mode", f"{param}.mode must be 'implicit' or 'explicit', got {mode!r}"
        )
    ttl = value.get("ttl")
    return None if ttl is None else parse_duration(ttl, f"{param}.ttl")


def cache_key_session(value: Any) -> str | None:
    """OpenAI's ``prompt_cache_key`` → a session id: the key itself when it is a valid id,
    else ``pck-`` + a digest of it; None when absent or empty."""
    param = PROMPT_CACHE_KEY_FIELD
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise DialectError(param, f"{param} must be a string, got {type(value).__name__}")
    if len(value) > MAX_CACHE_KEY_CHARS:
        raise DialectError(
            param, f"{param} must be at most {MAX_CACHE_KEY_CHARS} characters, got {len(value)}"
        )
    if has_lone_surrogate(value):  # no UTF-8 for a digest, nor for vLLM's echo of the key
        raise DialectError(
            param,
            f"{param} must be valid Unicode: it contains a lone UTF-16 surrogate, got "
            f"{ascii(value)[:80]}",
        )
    try:
        return check_id(value, param)
    except ValueError:
        digest = hashlib.sha256(value.encode("utf-8")).hexdigest()[:_DIGEST_CHARS]
        return CACHE_KEY_SESSION_PREFIX + digest


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
    blocks: list, section: str, message: int | None, where: str
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


def breakpoints(payload: dict) -> list[Breakpoint]:
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


def problem(payload: dict, path: str) -> tuple[str, str] | None:
    """(param, message) for the first cache hint of this request the server cannot use, or
    None. Pure; the guard answers it with a 400."""
    try:
        if path in OPENAI_PATHS:
            cache_key_session(payload.get(PROMPT_CACHE_KEY_FIELD))
            parse_retention(payload.get(PROMPT_CACHE_RETENTION_FIELD))
            parse_cache_options(payload.get(PROMPT_CACHE_OPTIONS_FIELD))
        elif path == MESSAGES_PATH:
            breakpoints(payload)
    except DialectError as exc:
        return exc.param, exc.message[:300]
    except Exception:  # noqa: BLE001 - a bug here must not break the guard (nor the connection)
        logger.exception("kvbranch: cache hints of a %s request not checked", path)
    return None


# --- the request's mapping -----------------------------------------------------------------------
def _strip_cache_control(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_cache_control(v) for k, v in value.items() if k != CACHE_CONTROL_FIELD}
    if isinstance(value, list):
        return [_strip_cache_control(v) for v in value]
    return value


def prefix_of(payload: dict, point: Breakpoint) -> dict:
    """The Anthropic request cut right after ``point`` (prompt order: tools, system,
    messages), cache_control kept: tools/system/messages only."""
    tools = payload.get("tools") if isinstance(payload.get("tools"), list) else None
    system = payload.get("system")
    messages = payload.get("messages") if isinstance(payload.get("messages"), list) else []
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


def at_end(payload: dict, point: Breakpoint) -> bool:
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


def conversation_head(payload: dict, point: Breakpoint) -> dict:
    """What names a request's derived session: the prefix up to ``point`` when that ends in
    tools, system or the first message, else tools, system and the first message — the part
    of a conversation that every one of its turns repeats (cache_control kept)."""
    if point.section in ("tools", "system") or (point.section == "messages" and point.index == 0):
        return prefix_of(payload, point)
    head = prefix_of(payload, Breakpoint("end", 0, None, point.ttl_s, point.param))
    head["messages"] = head["messages"][:1]
    return head


def breakpoint_session(payload: dict, point: Breakpoint) -> str:
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
    digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()
    return BREAKPOINT_SESSION_PREFIX + digest[:_DIGEST_CHARS]


def has_session(payload: dict, path: str, session_header: str | None, xargs: Any) -> bool:
    """Whether the request names its own session (vLLM's three sources)."""
    if (
        path != MESSAGES_PATH
        and isinstance(payload.get("session_id"), str)
        and payload["session_id"]
    ):
        return True
    if session_header:
        return True
    return (
        isinstance(xargs, dict)
        and isinstance(xargs.get(SESSION_XARG), str)
        and bool(xargs[SESSION_XARG])
    )


@dataclass
class Hints:
    """What a request's dialect asked for."""

    session_id: str | None = None  # derived; None when the request names its own (or none)
    pin_ttl_s: float | None = None
    usage: AnthropicUsage | None = None


def hints_of(payload: dict, path: str, session_header: str | None = None) -> Hints:
    """Read the request's cache hints. Raises :class:`DialectError` (the guard has already
    answered those with a 400, so here they only mean "no hints")."""
    xargs = payload.get("vllm_xargs")
    own = has_session(payload, path, session_header, xargs)
    if path in OPENAI_PATHS:
        key = cache_key_session(payload.get(PROMPT_CACHE_KEY_FIELD))
        ttls = [
            t
            for t in (
                parse_retention(payload.get(PROMPT_CACHE_RETENTION_FIELD)),
                parse_cache_options(payload.get(PROMPT_CACHE_OPTIONS_FIELD)),
            )
            if t is not None
        ]
        return Hints(session_id=None if own else key, pin_ttl_s=max(ttls) if ttls else None)
    if path == MESSAGES_PATH:
        points = breakpoints(payload)
        if not points:
            return Hints()
        last = points[-1]
        ttl = max(p.ttl_s for p in points)
        cut = None if at_end(payload, last) else prefix_of(payload, last)
        return Hints(
            session_id=None if own else breakpoint_session(payload, last),
            pin_ttl_s=ttl,
            usage=AnthropicUsage(ttl_s=ttl, prefix_request=cut, model=payload.get("model")),
        )
    return Hints()


def apply(payload: dict, path: str, session_header: str | None = None) -> Hints:
    """Map the request's cache hints onto it in place: the derived session (``session_id``
    on the OpenAI routes, ``vllm_xargs.session_id`` on ``/v1/messages``, which has no such
    field) and the pin lease (:data:`PIN_TTL_XARG`). Call after the middleware's own rewrite
    (which strips client-set internal xargs). Returns the hints (empty ones on bad input)."""
    if path not in OPENAI_PATHS and path != MESSAGES_PATH:
        return Hints()
    try:
        hints = hints_of(payload, path, session_header)
    except DialectError:
        return Hints()  # the guard answered it; nothing reaches here on a served route
    except Exception:  # noqa: BLE001 - hints are best effort: the request goes on without them
        logger.exception("kvbranch: cache hints of a %s request not applied", path)
        return Hints()
    xargs = payload.get("vllm_xargs")
    if (hints.session_id or hints.pin_ttl_s) and xargs is None:
        xargs = payload["vllm_xargs"] = {}
    if not isinstance(xargs, dict):
        return Hints()  # vLLM refuses the body with its own message
    if hints.session_id:
        if path == MESSAGES_PATH:
            xargs[SESSION_XARG] = hints.session_id
        else:
            payload["session_id"] = hints.session_id
    if hints.pin_ttl_s:
        xargs[PIN_TTL_XARG] = float(min(hints.pin_ttl_s, MAX_TTL_S))
    return hints


# --- the response's usage (Anthropic) -----------------------------------------------------------
def anthropic_usage(
    usage: dict,
    *,
    prefix_tokens: int | None,
    split: dict | None,
    ttl_s: float,
    block_size: int | None = None,
) -> dict:
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


def _block_size(app_state: Any) -> int | None:
    config = getattr(app_state, "vllm_config", None)
    size = getattr(getattr(config, "cache_config", None), "block_size", None)
    return size if isinstance(size, int) and size > 0 else None


@dataclass
class AnthropicUsage:
    """Rewrites the usage of one ``/v1/messages`` response that had breakpoints."""

    ttl_s: float
    #: The request cut at its last breakpoint, when that is not the whole prompt.
    prefix_request: dict | None = None
    model: Any = None
    _prefix_tokens: int | None = field(default=None, init=False)
    _counted: bool = field(default=False, init=False)

    async def prefix_tokens(self, app_state: Any) -> int | None:
        """Tokens of the breakpoint prefix through vLLM's own ``count_tokens`` (None: the
        whole prompt, or when it cannot be rendered alone — then the whole prompt counts)."""
        if self._counted or self.prefix_request is None:
            return self._prefix_tokens
        self._counted = True
        handler = getattr(app_state, "anthropic_serving_messages", None)
        if handler is None:
            return None
        try:
            from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest

            request = AnthropicCountTokensRequest.model_validate(
                dict(self.prefix_request, model=self.model)
            )
            result = await handler.count_tokens(request)
            self._prefix_tokens = int(result.input_tokens)
        except Exception as exc:  # noqa: BLE001 - usage must never break a response
            logger.debug("kvbranch: breakpoint prefix not countable: %s", exc)
        return self._prefix_tokens

    async def rewrite(self, payload: dict, split: dict | None, app_state: Any) -> bool:
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
                    prefix_tokens=await self.prefix_tokens(app_state),
                    split=split,
                    ttl_s=self.ttl_s,
                    block_size=_block_size(app_state),
                )
                changed = True
        return changed

    async def rewrite_event(self, event: bytes, split: dict | None, app_state: Any) -> bytes:
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
            if isinstance(data, dict) and await self.rewrite(data, split, app_state):
                lines[i] = b"data: " + json.dumps(data, separators=(",", ":")).encode()
        return b"\n".join(lines)
