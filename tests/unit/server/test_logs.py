"""server/common/logs.py: kvbranch's log lines reach vLLM's handler at vLLM's level in a vLLM
process (before, the ``kvbranch.*`` loggers had no handler: info lines vanished, warnings came
out bare through Python's last resort)."""

from __future__ import annotations

import io
import logging

import pytest

from server.common import logs


@pytest.fixture
def vllm_handler(monkeypatch) -> io.StringIO:
    """vLLM's logger as vLLM configures it (one stream handler, its level); ours untouched."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("VLLMFMT %(levelname)s %(name)s %(message)s"))
    theirs, ours = logging.getLogger(logs.VLLM), logging.getLogger(logs.OURS)
    monkeypatch.setattr(theirs, "handlers", [handler])
    monkeypatch.setattr(theirs, "level", logging.INFO)
    monkeypatch.setattr(ours, "handlers", [])
    monkeypatch.setattr(ours, "level", logging.NOTSET)
    monkeypatch.setattr(ours, "propagate", True)
    return stream


def test_kvbranch_info_lines_go_where_vllms_lines_go(vllm_handler):
    assert logs.follow_vllm_logging()
    logging.getLogger("kvbranch.peer_pull").info("peer pulls on")
    logging.getLogger("kvbranch.peer_pull").debug("below vLLM's level")
    assert vllm_handler.getvalue() == "VLLMFMT INFO kvbranch.peer_pull peer pulls on\n"


def test_a_second_call_adds_no_second_handler(vllm_handler):
    assert logs.follow_vllm_logging()
    assert not logs.follow_vllm_logging()
    logging.getLogger("kvbranch.x").warning("once")
    assert vllm_handler.getvalue().count("once") == 1


def test_nothing_changes_where_vllm_configured_no_handler(monkeypatch, vllm_handler):
    monkeypatch.setattr(logging.getLogger(logs.VLLM), "handlers", [])
    assert not logs.follow_vllm_logging()
    assert logging.getLogger(logs.OURS).handlers == []


def test_the_package_registers_the_plugin():
    from importlib import metadata

    installed = {ep.name: ep for ep in metadata.entry_points(group="vllm.general_plugins")}
    if logs.PLUGIN_NAME not in installed:
        pytest.skip("this install predates the plugin (run ./scripts/setup.sh)")
    assert installed[logs.PLUGIN_NAME].load() is logs.install
