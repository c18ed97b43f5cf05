"""Pieces shared by the sync and async clients: configuration from arguments or environment,
input validation, and the chat request body."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from typing import Any

import httpx
from typing_extensions import TypedDict

from sdk.contract import BRANCH_XARG, CHAT_COMPLETIONS_PATH, MODELS_PATH, check_id

__all__ = [
    "ENV_BASE_URL",
    "ENV_API_KEY",
    "DEFAULT_BASE_URL",
    "CHAT_PATH",
    "MODELS_PATH",
    "resolve_base_url",
    "resolve_api_key",
    "make_timeout",
    "chat_payload",
    "check_messages",
    "user_agent",
    "ChatParams",
    "ChatArgs",
    "ForkArgs",
    "SessionArgs",
    "check_keywords",
]

ENV_BASE_URL = "KVBRANCH_BASE_URL"
ENV_API_KEY = "KVBRANCH_API_KEY"
DEFAULT_BASE_URL = "http://127.0.0.1:8000"
# OpenAI's own routes, named in the contract with the kvbranch ones.
CHAT_PATH = CHAT_COMPLETIONS_PATH

_VERSION = "0.1.0"


def user_agent() -> str:
    return f"kvbranch-sdk/{_VERSION} httpx/{httpx.__version__}"


def resolve_base_url(base_url: str | None) -> str:
    """Argument, else ``KVBRANCH_BASE_URL``, else ``OPENAI_BASE_URL``, else
    ``http://127.0.0.1:8000``. A trailing ``/v1`` (as in OpenAI base URLs) is accepted and
    dropped: the sdk's paths start with ``/v1``."""
    url = (
        base_url
        or os.environ.get(ENV_BASE_URL)
        or os.environ.get("OPENAI_BASE_URL")
        or DEFAULT_BASE_URL
    )
    url = url.strip().rstrip("/")
    if url.endswith("/v1"):
        url = url[:-3]
    parsed = httpx.URL(url)
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"base_url must be an http(s) URL like {DEFAULT_BASE_URL}, got {url!r}")
    return url


def resolve_api_key(api_key: str | None) -> str | None:
    """Argument, else ``KVBRANCH_API_KEY``, else ``OPENAI_API_KEY``; ``None`` means no
    ``Authorization`` header."""
    key = (
        api_key
        if api_key is not None
        else (os.environ.get(ENV_API_KEY) or os.environ.get("OPENAI_API_KEY"))
    )
    return key or None


def make_timeout(timeout: float | httpx.Timeout | None) -> httpx.Timeout:
    """``timeout`` seconds for reading a response (a whole non-streamed generation, or the
    gap between two stream chunks), at most 10 s to connect."""
    if isinstance(timeout, httpx.Timeout):
        return timeout
    if timeout is None:
        return httpx.Timeout(None, connect=10.0)
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    return httpx.Timeout(timeout, connect=min(10.0, timeout))


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """A deep copy of ``messages`` after checking it is a list of ``{"role": ...}`` dicts."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise TypeError(
            "messages must be a list of chat messages like "
            f"{{'role': 'user', 'content': '...'}}, got {type(messages).__name__}"
        )
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise TypeError(
                f"messages[{i}] must be a dict with a 'role', got {type(message).__name__}"
            )
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(
                f"messages[{i}] has no 'role' (one of system, user, assistant, "
                f"tool): {dict(message)!r:.200}"
            )
        out.append(copy.deepcopy(dict(message)))
    return out


class ChatParams(TypedDict, total=False):
    """Keyword arguments of a chat turn (see :meth:`sdk.KVBranchClient.chat`): ``model``
    (default: the client's, else the server's first), the OpenAI sampling parameters,
    ``extra_body`` (merged into the request body: any server-specific parameter) and
    ``extra_headers``. ``None`` means "not set"."""

    model: str | None
    temperature: float | None
    max_tokens: int | None
    stop: str | Sequence[str] | None
    tools: Sequence[Mapping[str, Any]] | None
    tool_choice: Any
    top_p: float | None
    seed: int | None
    extra_body: Mapping[str, Any] | None
    extra_headers: Mapping[str, str] | None


class ChatArgs(ChatParams, total=False):
    """:class:`ChatParams` plus the kvbranch ``session_id`` and ``branch_id`` the request
    continues (a :class:`~sdk.Branch` fills them in itself)."""

    session_id: str | None
    branch_id: str | None


class SessionArgs(TypedDict, total=False):
    """How :meth:`sdk.KVBranchClient.session` starts a session: the ``main`` branch's first
    messages (a ``system`` message, then ``messages``), and the server's pin settings for its
    branches (``auto_pin``, default true; ``pin_ttl_s``, default the server's)."""

    system: str | None
    messages: Sequence[Mapping[str, Any]] | None
    auto_pin: bool
    pin_ttl_s: float | None


class ForkArgs(TypedDict, total=False):
    """Where a server-side fork starts (:meth:`sdk.KVBranchClient.fork_branch`): ``parent``
    (default ``main``), the new ``branch_id`` (server-made when omitted), and the fork point:
    after ``token_offset`` tokens of the parent, or where ``messages`` (rendered with the chat
    template) end, or at the parent's end."""

    parent: str
    branch_id: str | None
    token_offset: int | None
    messages: Sequence[Mapping[str, Any]] | None


def check_keywords(given: Mapping[str, Any], allowed: type, what: str) -> None:
    """``TypeError`` for keywords a ``**kwargs: Unpack[TypedDict]`` method does not take (what
    an explicit signature would raise)."""
    unknown = sorted(set(given) - allowed.__optional_keys__)  # type: ignore[attr-defined]
    if unknown:
        raise TypeError(f"unexpected keyword argument(s) of {what}: {', '.join(unknown)}")


def chat_payload(
    messages: Sequence[Mapping[str, Any]], params: ChatArgs, *, model: str, stream: bool
) -> dict[str, Any]:
    """The OpenAI-compatible request body. ``session_id`` and ``branch_id`` (kvbranch) go in
    the body field ``session_id`` and in ``vllm_xargs``; ``extra_body`` is merged last;
    ``params["model"]`` and ``params["extra_headers"]`` are the caller's to apply."""
    check_keywords(params, ChatArgs, "a chat call")
    session_id = params.get("session_id")
    branch_id = params.get("branch_id")
    temperature = params.get("temperature")
    max_tokens = params.get("max_tokens")
    stop = params.get("stop")
    tools = params.get("tools")
    tool_choice = params.get("tool_choice")
    top_p = params.get("top_p")
    seed = params.get("seed")
    msgs = check_messages(messages)
    if not msgs:
        raise ValueError("messages must not be empty")
    if not isinstance(model, str) or not model:
        raise ValueError("model must be a non-empty string")
    if temperature is not None and (not isinstance(temperature, (int, float)) or temperature < 0):
        raise ValueError(f"temperature must be a number >= 0, got {temperature!r}")
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise ValueError(f"max_tokens must be a positive integer, got {max_tokens!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    payload: dict[str, Any] = {"model": model, "messages": msgs, "stream": stream}
    if stream:
        payload["stream_options"] = {"include_usage": True}
    if temperature is not None:
        payload["temperature"] = temperature
    if max_tokens is not None:
        payload["max_tokens"] = max_tokens
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        stop = list(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a string or a list of non-empty strings, got {stop!r}")
        payload["stop"] = stop
    if tools is not None:
        tools = [dict(t) for t in tools]
        for i, tool in enumerate(tools):
            if tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
                raise ValueError(
                    f"tools[{i}] must be {{'type': 'function', 'function': "
                    f"{{'name': ..., 'parameters': ...}}}}, got {tool!r:.200}"
                )
        payload["tools"] = tools
    if tool_choice is not None:
        payload["tool_choice"] = tool_choice
    if top_p is not None:
        payload["top_p"] = top_p
    if seed is not None:
        payload["seed"] = seed
    extra = dict(params.get("extra_body") or {})
    xargs = dict(extra.pop("vllm_xargs", None) or {})
    if "session_id" in extra:
        if session_id is not None and extra["session_id"] != session_id:
            raise ValueError("extra_body['session_id'] conflicts with session_id")
        session_id = extra.pop("session_id")
    if BRANCH_XARG in xargs:
        if branch_id is not None and xargs[BRANCH_XARG] != branch_id:
            raise ValueError(f"extra_body['vllm_xargs'][{BRANCH_XARG!r}] conflicts with branch_id")
        branch_id = xargs.pop(BRANCH_XARG)
    if session_id is not None:
        payload["session_id"] = check_id(session_id, "session_id")
    if branch_id is not None:
        if session_id is None:
            raise ValueError("branch_id needs a session_id")
        xargs[BRANCH_XARG] = check_id(branch_id, "branch_id")
    if xargs:
        payload["vllm_xargs"] = xargs
    if stream and "stream_options" in extra:
        payload["stream_options"] = {**payload["stream_options"], **extra.pop("stream_options")}
    if extra.get("n", 1) != 1:
        raise ValueError("n > 1 is not supported: the sdk returns one answer per request")
    payload.update(extra)
    return payload
