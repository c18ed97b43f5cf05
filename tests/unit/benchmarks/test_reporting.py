"""A results section's command line carries the server switches of its environment (an A/B run
with ``KVBRANCH_BACKFILL=0`` must say so), and nothing else from the environment (pure logic)."""

from __future__ import annotations

import sys

from benchmarks import reporting


def test_the_command_line_shows_server_switches_and_no_secret(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/agent_workload.py", "--turns", "6"])
    monkeypatch.setenv("KVBRANCH_BACKFILL", "0")
    monkeypatch.setenv("KVBRANCH_CLUSTER_SECRET", "do-not-print")
    monkeypatch.delenv("KVBRANCH_PREFAULT", raising=False)
    monkeypatch.delenv("KVBRANCH_ASYNC_SAVE", raising=False)
    line = reporting.command_line()
    assert line == "KVBRANCH_BACKFILL=0 .venv/bin/python benchmarks/agent_workload.py --turns 6"
    assert "do-not-print" not in line


def test_the_command_line_without_switches_is_the_command(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["benchmarks/turn1_ab.py"])
    for name in reporting.REPORTED_ENV:
        monkeypatch.delenv(name, raising=False)
    assert reporting.command_line() == ".venv/bin/python benchmarks/turn1_ab.py"


def test_the_command_line_through_the_entry_names_the_entry(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["/x/benchmarks/__main__.py", "turn1_ab", "--rounds", "2"])
    for name in reporting.REPORTED_ENV:
        monkeypatch.delenv(name, raising=False)
    assert reporting.command_line() == ".venv/bin/python -m benchmarks turn1_ab --rounds 2"
