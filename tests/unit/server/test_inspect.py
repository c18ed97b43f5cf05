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


def _host_asked(argv: list[str]) -> str:
    """The host a command's request went to (the fake server answers whatever the host)."""
    fake = _fake_with_a_session()
    hosts: list[str] = []

    def recording(request: httpx.Request) -> httpx.Response:
        hosts.append(f"{request.url.host}:{request.url.port}{request.url.path}")
        return fake.transport().handle_request(request)

    code, _ = _run(argv, httpx.MockTransport(recording))
    assert code == 0
    return hosts[0]


def test_the_server_url_is_the_sdks_kvbranch_base_url(monkeypatch, caplog):
    monkeypatch.setenv("KVBRANCH_BASE_URL", "http://kvb.example:9000/v1/")  # as the sdk takes it
    monkeypatch.setenv("KVBRANCH_URL", "http://old.example:1")
    monkeypatch.setattr(inspect_cli, "_warned_deprecated_url", False)
    with caplog.at_level("WARNING", logger=inspect_cli.__name__):
        assert _host_asked(["health"]) == "kvb.example:9000/v1/kvbranch/health"
    assert not caplog.records  # the new name wins; the old one is not even read
    assert _host_asked(["--url", "http://flag.example:2", "health"]).startswith("flag.example:2/")


def test_the_former_kvbranch_url_still_works_and_warns_once(monkeypatch, caplog):
    monkeypatch.delenv("KVBRANCH_BASE_URL", raising=False)
    monkeypatch.setenv("KVBRANCH_URL", "http://old.example:7000")
    monkeypatch.setattr(inspect_cli, "_warned_deprecated_url", False)
    with caplog.at_level("WARNING", logger=inspect_cli.__name__):
        assert _host_asked(["health"]).startswith("old.example:7000/")
        assert _host_asked(["stats"]).startswith("old.example:7000/")
    warnings = [r.getMessage() for r in caplog.records]
    assert warnings == ["KVBRANCH_URL is deprecated: set KVBRANCH_BASE_URL instead"]
    monkeypatch.delenv("KVBRANCH_URL")
    assert _host_asked(["health"]).startswith("127.0.0.1:8000/")
