"""A real ``redis-server`` for the cluster index's tests: on a unix socket only (``--port 0`` opens
no TCP listener), nothing persisted, memory capped with the eviction policy production uses.

``stop()``/``kill()`` then ``start()`` again on the same socket are the outage tests' Redis going
down and coming back (empty: nothing is saved, like a failover to a replica that lost the last
writes).
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
from pathlib import Path

from server.router.cluster import redis_argv, redis_started


class RedisServer:
    """One redis-server subprocess on ``<tmpdir>/r.sock``."""

    def __init__(self, workdir: Path | None = None, start_timeout_s: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise FileNotFoundError("redis-server is not installed (scripts/setup.sh installs it)")
        self.binary = binary
        self._own_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="kvb-redis-"))
        self.socket = self.dir / "r.sock"
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> RedisServer:
        """Start it (again, after stop/kill: same socket) and wait until it answers PING."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.socket.unlink(missing_ok=True)
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - the child keeps it
        self.proc = subprocess.Popen(
            redis_argv(self.binary, self.socket, self.dir),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        why = redis_started(self.proc, self.socket, self.start_timeout_s, poll_s=0.02)
        if why is not None:
            self.kill()
            raise RuntimeError(f"{why}: {self._tail()}")
        return self

    def _tail(self) -> str:
        try:
            return (self.dir / "redis.log").read_text(errors="replace")[-800:]
        except OSError:
            return ""

    def stop(self) -> None:
        """SIGTERM and wait (a clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: Redis dies mid-flight, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
