"""The connector's per-step trace: off without the variable, one JSON line per record."""

from __future__ import annotations

import json
import time

from server.connector.engine.step_trace import ENV_STEP_TRACE, StepTrace, scheduled_token_split


def test_off_without_the_variable(monkeypatch, tmp_path):
    monkeypatch.delenv(ENV_STEP_TRACE, raising=False)
    trace = StepTrace("worker")
    assert not trace.enabled
    trace.record(t=1.0)  # a no-op
    trace.close()


def test_records_lines_with_hook_times(monkeypatch, tmp_path):
    monkeypatch.setenv(ENV_STEP_TRACE, str(tmp_path / "steps"))
    trace = StepTrace("scheduler")
    trace.add_hook_time("match", time.perf_counter() - 0.01)
    trace.record(t=1.0, prefill=5, decode=2)
    trace.record(t=2.0, prefill=0, decode=3)
    trace.close()
    (path,) = (tmp_path / "steps").glob("scheduler-*.jsonl")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["t"] for r in rows] == [1.0, 2.0]
    assert rows[0]["hook_s"]["match"] >= 0.01
    assert "hook_s" not in rows[1]  # hook times are per step


def test_scheduled_token_split():
    assert scheduled_token_split({"a": 1, "b": 300, "c": 1, "d": 2}) == (302, 2)
    assert scheduled_token_split({}) == (0, 0)
