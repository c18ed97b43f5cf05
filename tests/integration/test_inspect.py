"""``python -m server.inspect`` against the real server and the real P/D router: a session's
branches with their host-store blocks and pins, and — through the router — which decode
instance holds a conversation for the next turn's pull."""

from __future__ import annotations

import json
import subprocess
import sys

from server.launcher.process import ROOT
from tests.integration.helpers import chat, create_session, system_prompt


def _inspect(server, *argv: str) -> subprocess.CompletedProcess:
    key = ["--api-key", server.api_key] if server.api_key else []
    return subprocess.run(
        [sys.executable, "-m", "server.inspect", "--url", server.url, *key, *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_sessions_branches_and_their_kv(kvbranch_server):
    create_session(kvbranch_server, session_id="inspect-1")
    messages = [
        {"role": "system", "content": system_prompt(words=300, seed=5)},
        {"role": "user", "content": "Say hi."},
    ]
    chat(kvbranch_server, messages, session="inspect-1", max_tokens=4)
    done = _inspect(kvbranch_server, "--json", "session", "inspect-1")
    assert done.returncode == 0, done.stderr
    main = next(b for b in json.loads(done.stdout)["branches"] if b["branch_id"] == "main")
    assert main["num_tokens"] > 128 and main["stored_blocks"] >= 1, main
    table = _inspect(kvbranch_server, "session", "inspect-1")
    assert table.returncode == 0 and "main" in table.stdout
    missing = _inspect(kvbranch_server, "session", "nobody-here")
    assert missing.returncode == 2 and "404" in missing.stderr


def test_the_router_shows_its_instances_and_where_a_branch_is_held(keyed_pd):
    prefill, decode, router = keyed_pd
    messages = [{"role": "user", "content": "Name a river."}]
    chat(router, messages, session="inspect-pd", max_tokens=8)
    done = _inspect(router, "--json", "cluster")
    assert done.returncode == 0, done.stderr
    cluster = json.loads(done.stdout)
    assert {i["role"] for i in cluster["instances"]} == {"prefill", "decode"}
    held = [e for e in cluster["index"] if e["session_id"] == "inspect-pd"]
    assert held and held[0]["decode"] == decode.url, cluster["index"]
    table = _inspect(router, "session", "inspect-pd")
    assert table.returncode == 0 and decode.url in table.stdout, table.stdout
