"""The engine side of the dialects' usage rewrites (:class:`server.dialects.base.Engine`) over
vLLM's app state: the KV cache's block size, and a prompt's token count through vLLM's own
``count_tokens`` path (Anthropic Messages: ``anthropic_serving_messages``)."""

from __future__ import annotations

from typing import Any

from sdk.contract import MESSAGES_PATH


class VllmEngine:
    """:class:`~server.dialects.base.Engine` over one app's state (None: nothing known)."""

    def __init__(self, app_state: Any) -> None:
        self.app_state = app_state

    @property
    def block_size(self) -> int | None:
        config = getattr(self.app_state, "vllm_config", None)
        size = getattr(getattr(config, "cache_config", None), "block_size", None)
        return size if isinstance(size, int) and size > 0 else None

    async def count_tokens(self, path: str, request: dict[str, Any]) -> int | None:
        """Raises what vLLM raises (a prefix that cannot be rendered alone): the caller falls
        back to the whole prompt."""
        if path != MESSAGES_PATH:
            return None
        handler = getattr(self.app_state, "anthropic_serving_messages", None)
        if handler is None:
            return None
        from vllm.entrypoints.anthropic.protocol import AnthropicCountTokensRequest

        result = await handler.count_tokens(AnthropicCountTokensRequest.model_validate(request))
        return int(result.input_tokens)
