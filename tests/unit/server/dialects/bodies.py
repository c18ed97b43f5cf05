"""Request bodies the dialect tests share: an OpenAI chat, an Anthropic message and an
Anthropic conversation whose breakpoint moves to the newest block each turn."""

from __future__ import annotations

import json

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"


def chat(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def anthropic(**extra) -> dict:
    body = {
        "model": "m",
        "max_tokens": 8,
        "system": [{"type": "text", "text": "You are terse."}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
    }
    body.update(extra)
    return body


def conversation(n: int, first: str = "Plan a trip to Paris.") -> list[dict]:
    """An Anthropic conversation of ``n`` turns, each request with its breakpoint on the newest
    block (as Anthropic's SDK examples do), the older ones' cache_control dropped."""
    requests = []
    messages: list[dict] = []
    for turn in range(n):
        text = first if turn == 0 else f"Turn {turn}: and then?"
        if turn:
            messages.append({"role": "assistant", "content": f"Answer {turn - 1}."})
        messages.append({"role": "user", "content": [{"type": "text", "text": text}]})
        for m in messages:
            if isinstance(m["content"], list):
                m["content"] = [
                    {k: v for k, v in b.items() if k != "cache_control"} for b in m["content"]
                ]
        newest = json.loads(json.dumps(messages))
        newest[-1]["content"][-1]["cache_control"] = {"type": "ephemeral"}
        requests.append(anthropic(messages=newest))
    return requests
