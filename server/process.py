"""Start and stop a real ``python -m server`` as a child process: used by the demo, the tests
and the benchmarks (they all need the same readiness wait and whole-process-group teardown)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
MODEL_NAME = "SmolLM2-135M-Instruct"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """``with ServerProcess([...]) as server: server.url`` — waits for readiness (timeout),
    and on exit stops the whole process group (API server, engine core, workers)."""

    def __init__(self, args: list[str], *, name: str = "server", port: int | None = None,
                 ready_timeout: float = 600.0, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.name = name
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout = ready_timeout
        self.extra_env = env or {}
        self.proc: subprocess.Popen | None = None
        self.log_path = Path(tempfile.gettempdir()) / f"kvbranch-test-{name}-{self.port}.log"
        self.model = MODEL_NAME
        self.api_key: str | None = None
        if "--api-key" in args:
            self.api_key = args[args.index("--api-key") + 1]

    def start(self) -> "ServerProcess":
        self.launch()
        self.wait_ready()
        return self

    def launch(self) -> "ServerProcess":
        """Start the process without waiting (start several, then ``wait_ready`` each)."""
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", PYTHONUNBUFFERED="1", **self.extra_env)
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "server", "--port", str(self.port), *self.args],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} server exited with {self.proc.returncode}; "
                                   f"log:\n{self.log_tail()}")
            try:
                r = httpx.get(f"{self.url}/v1/models", headers=self.headers(), timeout=2.0)
                if r.status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name} server not ready after {self.ready_timeout}s; "
                           f"log:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def terminate(self) -> None:
        """Ask the whole process group to stop (SIGTERM) without waiting; ``stop`` finishes."""
        if self.proc is None:
            return
        try:
            os.killpg(os.getpgid(self.proc.pid), signal.SIGTERM)
        except ProcessLookupError:
            pass

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is None:
            return
        try:
            pgid = os.getpgid(self.proc.pid)
        except ProcessLookupError:
            self.proc = None
            return
        os.killpg(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(pgid, signal.SIGKILL)  # whatever children are left
        except ProcessLookupError:
            pass
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
