"""Re-export for tests and benchmarks: the launcher helper lives in :mod:`server.process`."""

from server.process import MODEL_NAME, ServerProcess, free_port

__all__ = ["MODEL_NAME", "ServerProcess", "free_port"]
