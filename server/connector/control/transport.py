"""The engine-side control socket: how the HTTP routes reach the session registry.

Why a socket: the registry and block index live with the connector's *scheduler* side, in the
engine-core process, while the routes run in the API-server process. vLLM's sanctioned channel
(``EngineClient.collective_rpc``) reaches the *workers*, which share a process with the
scheduler only in single-process executors. A Unix socket owned by the scheduler side works for
every executor and keeps the routes cheap (no engine step involved).

Protocol: one JSON object per line each way: ``{"op": ..., **args}`` →
``{"ok": true, "result": ...}`` or ``{"ok": false, "status": 404, "message": ...}``. This module
is the transport (:class:`ControlServer` serves any ``handler(dict)``; ``call_raw`` and
:func:`call_sync_raw` send any op); the typed ops ride on it: :meth:`AsyncControlClient.call`
and :func:`call_sync` take a request model of :mod:`server.connector.control.models` and
return its parsed answer model, and the engine's handler (``control.ops.run_op``) validates
both sides of each op too.

Where: the socket answers every session op with no credentials of its own, so it lives in a
private directory (the launcher makes one per server with ``tempfile.mkdtemp``: mode 0700,
unpredictable name) and :class:`ControlServer` refuses any other. Each engine core binds its
own path in that directory (:func:`engine_socket_path`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import socketserver
import stat
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from server.connector.control.models import ControlError, ControlRequest, parse_answer, request_line

__all__ = ["AsyncControlClient", "ControlError", "ControlServer", "call_sync", "call_sync_raw"]

A = TypeVar("A", bound=BaseModel)

logger = logging.getLogger("kvbranch.control")

MAX_LINE = 64 * 1024 * 1024


Handler = Callable[[dict], Any]


def engine_socket_path(path: str, engine_index: int) -> str:
    """The socket of one engine core: ``path`` itself for the first (the one the API server's
    routes call), ``<stem>.<index><suffix>`` next to it for the others (data parallel), so
    that no engine core unlinks another's socket."""
    if engine_index <= 0:
        return path
    stem, suffix = os.path.splitext(path)
    return f"{stem}.{engine_index}{suffix}"


def check_private_dir(folder: str) -> None:
    """Refuse a directory another user could list, write or swap: not a real directory (a
    symlink can be re-pointed), not ours, or any group/other permission bit set."""
    try:
        info = os.lstat(folder)
    except OSError as exc:
        raise PermissionError(f"control socket directory {folder!r}: {exc.strerror}") from None
    problems = []
    if not stat.S_ISDIR(info.st_mode):
        problems.append("not a directory (a symlink?)")
    if info.st_uid != os.getuid():
        problems.append(f"owned by uid {info.st_uid}, not {os.getuid()}")
    if stat.S_IMODE(info.st_mode) & 0o077:
        problems.append(f"mode {stat.S_IMODE(info.st_mode):o}, not 700")
    if problems:
        raise PermissionError(
            f"control socket directory {folder!r} is not private: "
            f"{'; '.join(problems)} (use a fresh tempfile.mkdtemp())"
        )


class ControlServer:
    """Serves ``handler(request_dict) -> result`` on a Unix socket in a daemon thread."""

    def __init__(self, path: str, handler: Handler) -> None:
        self.path = path
        self.handler = handler
        check_private_dir(os.path.dirname(os.path.abspath(path)))
        if os.path.lexists(path):
            os.unlink(path)
        outer = self

        class _RequestHandler(socketserver.StreamRequestHandler):
            def handle(self) -> None:
                for line in self.rfile:
                    reply = outer._dispatch(line)
                    self.wfile.write(json.dumps(reply).encode() + b"\n")
                    self.wfile.flush()

        class _Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
            daemon_threads = True
            # socketserver's default backlog is 5. A Unix-socket connect to a full backlog
            # fails with EAGAIN, which asyncio mistakes for "connected": the client then
            # dies with EINVAL. Bursts of concurrent calls (one per finished completion)
            # are normal here.
            request_queue_size = socket.SOMAXCONN

        self._server = _Server(path, _RequestHandler)
        os.chmod(path, 0o600)
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="kvbranch-control", daemon=True
        )
        self._thread.start()
        logger.info("kvbranch control socket at %s", path)

    def _dispatch(self, line: bytes) -> dict:
        try:
            try:
                request = json.loads(line)
            except ValueError as exc:
                raise ControlError(400, f"malformed control request: {exc}") from None
            if not isinstance(request, dict) or "op" not in request:
                raise ControlError(400, "control request must be an object with 'op'")
            return {"ok": True, "result": self.handler(request)}
        except ControlError as exc:
            return {"ok": False, "status": exc.status, "message": exc.message}
        except Exception as exc:  # noqa: BLE001 - report, never kill the engine
            logger.exception("kvbranch control op failed")
            return {"ok": False, "status": 500, "message": f"internal error: {exc}"}

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        if os.path.exists(self.path):
            os.unlink(self.path)


def _unwrap(reply: dict) -> Any:
    if reply.get("ok"):
        return reply.get("result")
    raise ControlError(int(reply.get("status", 500)), str(reply.get("message", "error")))


def call_sync(path: str, request: ControlRequest[A], timeout: float = 5.0) -> A:
    """One typed op, blocking (for callers outside an event loop)."""
    return parse_answer(request, _exchange_sync(path, request_line(request), timeout))


def call_sync_raw(path: str, op: str, timeout: float = 5.0, **args: Any) -> Any:
    """Any op, untyped: the transport under :func:`call_sync` (and its tests)."""
    return _exchange_sync(path, {"op": op, **args}, timeout)


def _exchange_sync(path: str, line: dict[str, Any], timeout: float) -> Any:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except OSError as exc:
            raise ControlError(503, f"kvbranch connector not reachable: {exc}") from None
        sock.sendall(json.dumps(line).encode() + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(1 << 20)
            if not chunk:
                break
            data += chunk
    return _unwrap(json.loads(data))


class AsyncControlClient:
    """A small pool-less async client: one short connection per call (calls are rare)."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.path = path
        self.timeout = timeout

    async def call(self, request: ControlRequest[A]) -> A:
        """One typed op: ``request`` on the wire, the answer parsed into its answer model (an
        answer that does not match is a :class:`ControlError` 500 naming the field)."""
        return parse_answer(request, await self._exchange(request_line(request)))

    async def call_raw(self, op: str, **args: Any) -> Any:
        """Any op, untyped: the transport under :meth:`call` (and its tests)."""
        return await self._exchange({"op": op, **args})

    async def _exchange(self, line: dict[str, Any]) -> Any:
        op = line.get("op")
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_unix_connection(self.path, limit=MAX_LINE), self.timeout
            )
        except (OSError, asyncio.TimeoutError) as exc:
            raise ControlError(503, f"kvbranch connector not reachable: {exc}") from None
        try:
            writer.write(json.dumps(line).encode() + b"\n")
            await writer.drain()
            reply = await asyncio.wait_for(reader.readline(), self.timeout)
        except asyncio.TimeoutError:
            raise ControlError(504, f"kvbranch connector did not answer {op!r}") from None
        except OSError as exc:  # e.g. the engine went away mid-call
            raise ControlError(503, f"kvbranch connector connection failed: {exc}") from None
        finally:
            writer.close()
        if not reply:
            raise ControlError(503, "kvbranch connector closed the control connection")
        return _unwrap(json.loads(reply))
