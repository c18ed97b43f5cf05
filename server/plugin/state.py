"""The plugin's per-app state (``app.state.kvbranch``): the engine client, the connector's
control socket client, and the prefetches running in the background."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from typing import Any

from sdk.contract import PREFETCH_XARG
from server.common.env import ENV_ROLE
from server.connector.control.transport import AsyncControlClient
from server.plugin.engines import Engines

logger = logging.getLogger("kvbranch.routes")


class PluginState:
    """What the routes need from the engine and the connector, made once per app."""

    def __init__(
        self,
        engine_client: Any,
        control: AsyncControlClient | None,
        model_name: str,
        max_model_len: int,
        engines: Engines | None = None,
    ) -> None:
        import vllm

        self.engine_client = engine_client
        self.control = control
        #: The data-parallel engine cores and their control sockets (one without data parallel).
        self.engines = engines or Engines(control.path if control else None, 1)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vllm_version = getattr(vllm, "__version__", "unknown")
        self.instance_id = uuid.uuid4().hex
        self.role = os.environ.get(ENV_ROLE, "single")
        self._tasks: set[asyncio.Task[None]] = set()
        #: The cluster-index publisher (``server/index/publisher.py``) with a shared --index.
        self.index_publisher: Any = None
        #: An aggregated replica's peer pulls (``server/plugin/peer_pull.py``), or None.
        self.peer_pulls: Any = None

    def start_prefetch(
        self, tokens: list[int], cache_salt: str | None, engine: int | None = None
    ) -> None:
        """Run ``tokens`` as a 1-token request in the background, on ``engine`` (data
        parallel: the engine holding the session) or where vLLM puts it."""
        task = asyncio.create_task(self._prefetch(tokens, cache_salt, engine))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _prefetch(
        self, tokens: list[int], cache_salt: str | None, engine: int | None
    ) -> None:
        from vllm import SamplingParams
        from vllm.inputs.engine import tokens_input

        params = SamplingParams(max_tokens=1, temperature=0.0, extra_args={PREFETCH_XARG: True})
        request_id = f"kvbranch-prefetch-{uuid.uuid4().hex}"
        rank = {"data_parallel_rank": engine} if engine is not None else {}
        try:
            async for _ in self.engine_client.generate(
                tokens_input(tokens, cache_salt=cache_salt), params, request_id, **rank
            ):
                pass
        except Exception:  # noqa: BLE001 - a failed prefetch only costs a recompute later
            logger.exception("kvbranch prefetch %s failed", request_id)
