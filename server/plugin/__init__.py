"""vLLM's API-server process: the endpoint plugin (routes, guard, middleware, metrics).
May import server.common, checks, dialects, index and the control socket; never the engine.

The vLLM endpoint plugin (entry point group ``vllm.endpoint_plugins``, name ``kvbranch``,
enabled through ``VLLM_PLUGINS``, which vLLM requires of every endpoint plugin): the
``/v1/kvbranch`` routes, the completion middleware and the Prometheus collector. Its settings
come from the launcher's environment, or from the kv-transfer-config when vLLM's own CLI started
the server (:mod:`server.plugin.vllm_serve`, docs/vllm-serve.md)."""

from __future__ import annotations

import logging
import os
from argparse import Namespace
from typing import Any

from fastapi import FastAPI

from server.common.env import ENV_CONTROL_SOCKET, ENV_MODEL_NAME  # the launcher sets them

logger = logging.getLogger("kvbranch.plugin")


class KVBranchPlugin:
    name = "kvbranch"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        from server.common.logs import follow_vllm_logging
        from server.plugin.guard import KVBranchGuard
        from server.plugin.holds import router as holds_router
        from server.plugin.metrics import MetricsRefresh
        from server.plugin.middleware import KVBranchMiddleware
        from server.plugin.responses_scope import ResponsesScope
        from server.plugin.revive import router as revive_router
        from server.plugin.routes import router
        from server.plugin.turn_log import TurnRecorder
        from server.plugin.ui import install as install_ui

        # The API server configures vLLM's logging after the general plugins ran (the engine
        # processes before): kvbranch's lines follow it from here.
        follow_vllm_logging()
        app.include_router(router)
        app.include_router(holds_router)
        app.include_router(revive_router)
        turns = install_ui(app)  # the agent page (/kvbranch/ui) and its data route
        app.add_middleware(TurnRecorder, log=turns)  # innermost: each turn's split, timed
        app.add_middleware(ResponsesScope)  # stored responses scoped by API key
        app.add_middleware(KVBranchMiddleware)
        app.add_middleware(MetricsRefresh)  # /metrics: the connector's stats fetched async
        app.add_middleware(KVBranchGuard)  # added last = outermost: size and id checks first

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        from server.connector.control.transport import AsyncControlClient
        from server.plugin.engines import Engines
        from server.plugin.metrics import register_collector
        from server.plugin.state import PluginState
        from server.plugin.vllm_serve import apply_kv_transfer_config

        apply_kv_transfer_config(args)  # started by vLLM's own CLI: settings from the config
        path = os.environ.get(ENV_CONTROL_SOCKET)
        control = AsyncControlClient(path) if path else None
        names = getattr(args, "served_model_name", None) or [args.model]
        model_name = os.environ.get(ENV_MODEL_NAME) or names[0]
        max_len = getattr(args, "max_model_len", None) or 8192
        engines = Engines.of(engine_client, path)
        state.kvbranch = PluginState(engine_client, control, model_name, max_len, engines)
        if path:
            register_collector(path, engines.count)
        from server.index.publisher import start as start_index_publisher
        from server.plugin.peer_pull import start as start_peer_pulls

        # With a shared --index: heartbeats and this instance's KV block events (a task).
        state.kvbranch.index_publisher = start_index_publisher(state.kvbranch, engine_client, args)
        if state.kvbranch.index_publisher is not None:
            from server.plugin.metrics import register_index_collector

            register_index_collector(state.kvbranch.index_publisher)
            state.kvbranch.peer_pulls = start_peer_pulls(state.kvbranch)
            if state.kvbranch.peer_pulls is not None:
                from server.plugin.metrics import register_peer_pull_collector

                register_peer_pull_collector(state.kvbranch.peer_pulls)
        logger.info("kvbranch routes ready (connector control: %s)", path or "none")


def plugin() -> KVBranchPlugin:
    """Entry point factory."""
    return KVBranchPlugin()
