"""The message-queue spin plugin sets the busy-wait window of vLLM's real ``SpinCondition``."""

from __future__ import annotations

import time

import pytest
import zmq
from vllm.distributed.device_communicators import shm_broadcast

from server.engine import spin as engine_spin


@pytest.fixture
def restore_wait():
    original = shm_broadcast.SpinCondition.wait
    yield
    shm_broadcast.SpinCondition.wait = original


def reader(tmp_path) -> shm_broadcast.SpinCondition:
    return shm_broadcast.SpinCondition(
        is_reader=True, context=zmq.Context.instance(), notify_address=f"ipc://{tmp_path}/n"
    )


def test_without_the_variable_vllm_is_unchanged(monkeypatch, restore_wait):
    monkeypatch.delenv(engine_spin.ENV_MQ_SPIN_S, raising=False)
    before = shm_broadcast.SpinCondition.wait
    engine_spin.install()
    assert shm_broadcast.SpinCondition.wait is before


def test_a_reader_made_before_install_gets_the_window(monkeypatch, restore_wait, tmp_path):
    cond = reader(tmp_path)
    assert cond.busy_loop_s == 1  # vLLM's default
    monkeypatch.setenv(engine_spin.ENV_MQ_SPIN_S, "0.002")
    engine_spin.install()
    cond.last_read = time.monotonic() - 0.01  # past the new window, inside vLLM's 1 s
    started = time.monotonic()
    cond.wait(timeout_ms=50)  # sleeps on the socket (no writer: times out) instead of yielding
    assert cond.busy_loop_s == 0.002
    assert time.monotonic() - started >= 0.04


def test_install_twice_wraps_once_and_takes_the_last_value(monkeypatch, restore_wait, tmp_path):
    monkeypatch.setenv(engine_spin.ENV_MQ_SPIN_S, "0.5")
    engine_spin.install()
    first = shm_broadcast.SpinCondition.wait
    monkeypatch.setenv(engine_spin.ENV_MQ_SPIN_S, "0")
    engine_spin.install()
    assert shm_broadcast.SpinCondition.wait is first
    cond = reader(tmp_path)
    cond.wait(timeout_ms=1)
    assert cond.busy_loop_s == 0.0


@pytest.mark.parametrize(("raw", "expected"), [("", None), ("x", None), ("-1", 0.0), ("1", 1.0)])
def test_spin_seconds_reads_the_variable(monkeypatch, raw, expected):
    monkeypatch.setenv(engine_spin.ENV_MQ_SPIN_S, raw)
    assert engine_spin.spin_seconds() == expected
