"""The control socket's transport: a real Unix socket server, its sync and async clients (the
untyped ``call_raw`` ops under the typed calls: see test_control_ops.py), error mapping."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import stat
import threading
import time

import pytest

from server.connector.control.transport import (
    AsyncControlClient,
    ControlError,
    ControlServer,
    call_sync_raw,
)


def handler(request: dict):
    op = request["op"]
    if op == "echo":
        return {k: v for k, v in request.items() if k != "op"}
    if op == "none":
        return None
    if op == "missing":
        raise ControlError(404, f"session {request.get('id')!r} not found")
    if op == "conflict":
        raise ControlError(409, "already exists")
    if op == "boom":
        raise RuntimeError("kaput")
    if op == "slow":
        time.sleep(request.get("s", 0.5))
        return "late"
    if op == "big":
        return "x" * request["n"]
    raise ControlError(400, f"unknown op {op!r}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # one server for the module: each close waits for serve_forever's 0.5 s poll
    path = str(tmp_path_factory.mktemp("ctl") / "c.sock")
    srv = ControlServer(path, handler)
    yield srv
    srv.close()


def raw_exchange(path: str, payload: bytes) -> dict:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        sock.sendall(payload)
        data = b""
        while not data.endswith(b"\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return json.loads(data)


# --- sync client ------------------------------------------------------------------------------
def test_call_sync_round_trip(server):
    assert call_sync_raw(server.path, "echo", a=1, b=[1, 2], c={"d": "é"}) == {
        "a": 1,
        "b": [1, 2],
        "c": {"d": "é"},
    }
    assert call_sync_raw(server.path, "none") is None


def test_socket_is_private(server):
    mode = os.stat(server.path).st_mode
    assert stat.S_ISSOCK(mode)
    assert stat.S_IMODE(mode) == 0o600


def test_errors_map_to_control_error_with_status(server):
    with pytest.raises(ControlError) as exc:
        call_sync_raw(server.path, "missing", id="s1")
    assert exc.value.status == 404
    assert exc.value.message == "session 's1' not found"
    assert str(exc.value) == "session 's1' not found"
    with pytest.raises(ControlError) as exc:
        call_sync_raw(server.path, "conflict")
    assert exc.value.status == 409


def test_unknown_op_is_handler_defined_400(server):
    with pytest.raises(ControlError) as exc:
        call_sync_raw(server.path, "frobnicate")
    assert exc.value.status == 400
    assert "frobnicate" in exc.value.message


def test_handler_exception_is_500_and_server_survives(server):
    with pytest.raises(ControlError) as exc:
        call_sync_raw(server.path, "boom")
    assert exc.value.status == 500
    assert "kaput" in exc.value.message
    assert call_sync_raw(server.path, "echo", ok=True) == {"ok": True}


def test_large_result(server):
    assert call_sync_raw(server.path, "big", n=3_000_000) == "x" * 3_000_000


def test_unreachable_socket_is_503(tmp_path):
    with pytest.raises(ControlError) as exc:
        call_sync_raw(str(tmp_path / "nobody.sock"), "echo")
    assert exc.value.status == 503


def test_close_removes_socket(tmp_path):
    path = str(tmp_path / "c.sock")
    srv = ControlServer(path, handler)
    assert os.path.exists(path)
    srv.close()
    assert not os.path.exists(path)
    with pytest.raises(ControlError) as exc:
        call_sync_raw(path, "echo")
    assert exc.value.status == 503


def test_stale_socket_file_is_replaced(tmp_path):
    path = str(tmp_path / "c.sock")
    with open(path, "w") as fh:
        fh.write("stale")
    srv = ControlServer(path, handler)
    try:
        assert call_sync_raw(path, "echo", x=1) == {"x": 1}
    finally:
        srv.close()


# --- malformed requests -----------------------------------------------------------------------
@pytest.mark.parametrize("payload", [b'{"no_op": 1}\n', b"[1, 2]\n", b'"op"\n', b"42\n"])
def test_request_without_op_is_400(server, payload):
    reply = raw_exchange(server.path, payload)
    assert reply["ok"] is False
    assert reply["status"] == 400
    assert "op" in reply["message"]


def test_malformed_json_is_400_and_server_survives(server):
    reply = raw_exchange(server.path, b"this is not json\n")
    assert reply["ok"] is False
    assert reply["status"] == 400
    assert call_sync_raw(server.path, "echo", still="up") == {"still": "up"}


def test_several_requests_on_one_connection(server):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(server.path)
        sock.sendall(
            b'{"op": "echo", "i": 1}\n{"op": "missing", "id": "z"}\n{"op": "echo", "i": 3}\n'
        )
        data = b""
        while data.count(b"\n") < 3:
            chunk = sock.recv(65536)
            assert chunk
            data += chunk
    replies = [json.loads(line) for line in data.splitlines()]
    assert replies[0] == {"ok": True, "result": {"i": 1}}
    assert replies[1]["ok"] is False and replies[1]["status"] == 404
    assert replies[2] == {"ok": True, "result": {"i": 3}}


# --- async client -----------------------------------------------------------------------------
def test_async_client_round_trip_and_errors(server):
    client = AsyncControlClient(server.path)

    async def main():
        assert await client.call_raw("echo", tag="t1") == {"tag": "t1"}
        with pytest.raises(ControlError) as exc:
            await client.call_raw("missing", id="q")
        assert exc.value.status == 404
        with pytest.raises(ControlError) as exc:
            await client.call_raw("boom")
        assert exc.value.status == 500
        assert await client.call_raw("big", n=2_000_000) == "x" * 2_000_000

    asyncio.run(main())


def test_burst_of_concurrent_async_calls(server):
    """More simultaneous connections than socketserver's default backlog of 5."""
    client = AsyncControlClient(server.path)

    async def main():
        return await asyncio.gather(*(client.call_raw("echo", i=i) for i in range(64)))

    assert asyncio.run(main()) == [{"i": i} for i in range(64)]


def test_concurrent_sync_calls_from_threads(server):
    results: dict[int, object] = {}

    def worker(i: int) -> None:
        results[i] = call_sync_raw(server.path, "echo", i=i)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == {i: {"i": i} for i in range(32)}


def test_async_client_unreachable_is_503(tmp_path):
    client = AsyncControlClient(str(tmp_path / "nobody.sock"), timeout=1.0)

    async def main():
        with pytest.raises(ControlError) as exc:
            await client.call_raw("echo")
        assert exc.value.status == 503

    asyncio.run(main())


def test_async_client_timeout_is_504(server):
    client = AsyncControlClient(server.path, timeout=0.1)

    async def main():
        with pytest.raises(ControlError) as exc:
            await client.call_raw("slow", s=0.3)
        assert exc.value.status == 504

    asyncio.run(main())
    # the server thread that was still busy does not block others
    assert call_sync_raw(server.path, "echo", after="timeout") == {"after": "timeout"}


def test_async_client_connection_closed_without_reply_is_503(tmp_path):
    path = str(tmp_path / "mute.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)

    def serve_once():
        conn, _ = listener.accept()
        conn.recv(1024)
        conn.close()

    thread = threading.Thread(target=serve_once, daemon=True)
    thread.start()
    try:

        async def main():
            with pytest.raises(ControlError) as exc:
                await AsyncControlClient(path, timeout=2.0).call_raw("echo")
            assert exc.value.status == 503

        asyncio.run(main())
    finally:
        thread.join(2)
        listener.close()


def test_handler_sees_op_and_args(tmp_path):
    seen = []
    srv = ControlServer(str(tmp_path / "h.sock"), lambda req: seen.append(req) or len(seen))
    try:
        assert call_sync_raw(srv.path, "split", tag="abc") == 1
        assert seen == [{"op": "split", "tag": "abc"}]
    finally:
        srv.close()


# --- where the socket lives (issue 13 item 11) ------------------------------------------------
@pytest.mark.parametrize("mode", [0o755, 0o750, 0o777, 0o1777])
def test_refuses_to_bind_in_a_shared_directory(tmp_path, mode):
    """In a directory others can list or write (like /tmp), another user could pre-create or
    swap the path, or connect first."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    with pytest.raises(PermissionError, match="private"):
        ControlServer(str(shared / "c.sock"), handler)
    assert not (shared / "c.sock").exists()


def test_refuses_a_symlinked_directory(tmp_path):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(PermissionError, match="private"):
        ControlServer(str(link / "c.sock"), handler)


def test_binds_in_a_private_directory(tmp_path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    srv = ControlServer(str(private / "c.sock"), handler)
    try:
        assert call_sync_raw(srv.path, "echo", x=1) == {"x": 1}
    finally:
        srv.close()


def test_one_socket_per_engine_core():
    from server.connector.control.transport import engine_socket_path

    base = "/run/kvbranch-x/control.sock"
    assert engine_socket_path(base, 0) == base  # the one the API server's routes call
    paths = {engine_socket_path(base, rank) for rank in range(4)}
    assert len(paths) == 4
    assert {os.path.dirname(p) for p in paths} == {"/run/kvbranch-x"}


def test_launcher_puts_the_socket_in_a_fresh_private_directory(tmp_path, monkeypatch):
    import json as _json

    from server.launcher.cli import build_parser, plan_launch

    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    model = tmp_path / "TinyModel"
    model.mkdir()
    (model / "config.json").write_text(_json.dumps({"architectures": ["LlamaForCausalLM"]}))
    args = build_parser().parse_args(["--model", str(model), "--port", "8123"])
    first, second = plan_launch(args, [], cuda=False), plan_launch(args, [], cuda=False)
    for plan in (first, second):
        folder = os.path.dirname(plan.control_socket)
        info = os.lstat(folder)
        assert stat.S_ISDIR(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o700
        assert info.st_uid == os.getuid()
        assert "8123" not in folder  # not derived from pid/port: not predictable
    assert os.path.dirname(first.control_socket) != os.path.dirname(second.control_socket)
