"""The launcher's :class:`server.launcher.process.ServerProcess`, with vLLM's dev routes on.

Tests drop the device prefix cache (``POST /reset_prefix_cache``) to make the host store or a
P/D pull the only source of a prefix; those routes exist only with ``VLLM_SERVER_DEV_MODE=1``,
which the launcher never sets itself (an operator asks for it)."""

from __future__ import annotations

from typing import Any

from server.launcher.process import MODEL_NAME, free_port
from server.launcher.process import ServerProcess as _LauncherProcess

__all__ = ["MODEL_NAME", "ServerProcess", "free_port"]


class ServerProcess(_LauncherProcess):
    def __init__(self, args: list[str], *, env: dict[str, str] | None = None, **kw: Any) -> None:
        super().__init__(args, env={"VLLM_SERVER_DEV_MODE": "1", **(env or {})}, **kw)
