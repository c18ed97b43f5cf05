"""``python -m server.inspect`` over the contract's fake server (sdk.testing) and a fake router:
each command's table and JSON, the router's cluster view with where a branch is held, and a
clear one-line error (exit 2) for a server that is down or speaks another contract."""

from __future__ import annotations

import io
import json

import httpx

from sdk import KVBranchClient
from sdk.contract import STATS_PATH, RouterStats, session_path
from sdk.testing import FakeKVBranchServer
from server.tools import inspect as inspect_cli


def _run(argv, transport):
    out = io.StringIO()
    code = inspect_cli.main(argv, out=out, transport=transport)
    return code, out.getvalue()


def _fake_with_a_session() -> FakeKVBranchServer:
    fake = FakeKVBranchServer()
    client = KVBranchClient("http://fake", transport=fake.transport())
    client.create_session(session_id="agent-1")
    client.fork_branch("agent-1", parent="main", branch_id="alt")
    return fake


def test_health_sessions_session_and_stats_of_a_single_server():
    fake = _fake_with_a_session()
    code, text = _run(["health"], fake.transport())
    assert code == 0 and "connector" in text
    code, text = _run(["sessions"], fake.transport())
    assert code == 0 and "agent-1" in text
    code, text = _run(["session", "agent-1"], fake.transport())
    assert code == 0 and "alt" in text and "main" in text
    code, text = _run(["--json", "session", "agent-1"], fake.transport())
    data = json.loads(text)
    assert {b["branch_id"] for b in data["branches"]} == {"main", "alt"}
    code, text = _run(["stats"], fake.transport())
    assert code == 0 and "host store" in text


def test_cluster_and_where_a_branch_is_held_through_a_router():
    fake = _fake_with_a_session()
    inner = fake.transport()
    stats = None

    def router(request: httpx.Request) -> httpx.Response:
        nonlocal stats
        if request.url.path == STATS_PATH:
            base = json.loads(inner.handle_request(request).read())
            base["cluster"] = {
                "instances": [
                    {"url": "http://p:1", "role": "prefill", "alive": True},
                    {"url": "http://d:2", "role": "decode", "alive": False},
                ],
                "index": [
                    {
                        "session_id": "agent-1",
                        "branch_id": "main",
                        "decode": "http://d:2",
                        "tokens": 321,
                        "expires_in_s": 40.0,
                    }
                ],
                "index_counters": {"puts": 1},
                "hold_ttl_s": 475.0,
            }
            stats = RouterStats.model_validate(base)  # the fake router speaks the contract
            return httpx.Response(200, json=base)
        return inner.handle_request(request)

    transport = httpx.MockTransport(router)
    code, text = _run(["cluster"], transport)
    assert code == 0 and "DOWN" in text and "http://d:2" in text and "321" in text
    code, text = _run(["session", "agent-1"], transport)
    assert code == 0
    main_row = next(line for line in text.splitlines() if line.startswith("main"))
    assert "http://d:2 (321 tok" in main_row
    assert stats is not None


def test_a_single_server_has_no_cluster_and_errors_are_one_line(capsys):
    fake = _fake_with_a_session()
    code, _ = _run(["cluster"], fake.transport())
    assert code == 2 and "not a P/D router" in capsys.readouterr().err
    code, _ = _run(["session", "nobody"], fake.transport())
    assert code == 2 and "HTTP 404" in capsys.readouterr().err

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    code, _ = _run(["health"], httpx.MockTransport(down))
    assert code == 2 and "ConnectError" in capsys.readouterr().err

    def other(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"sessions": "nope"})

    code, _ = _run(["sessions"], httpx.MockTransport(other))
    assert code == 2 and "contract" in capsys.readouterr().err
    assert session_path("x")  # the path builder the command uses
