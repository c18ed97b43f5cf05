"""The idle poll: vLLM's real ``EngineCoreProc._process_engine_step``, patched, on a stand-in
engine (its scheduler counts and input queue); the step itself is vLLM's code."""

from __future__ import annotations

import queue
import threading
import time
from types import SimpleNamespace

import pytest
from vllm.v1.engine.core import EngineCoreProc

from server.engine import idle as engine_idle


class Scheduler:
    def __init__(self, unfinished: int = 0, held: int = 1, finished_ids: set | None = None):
        self.unfinished, self.held = unfinished, held
        self.finished_req_ids = finished_ids or set()

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished

    def has_requests(self) -> bool:
        return bool(self.unfinished or self.held or self.finished_req_ids)


def engine(scheduler: Scheduler) -> SimpleNamespace:
    handled: list[tuple] = []
    return SimpleNamespace(
        scheduler=scheduler,
        batch_queue=None,
        engines_running=False,
        input_queue=queue.Queue(),
        output_queue=queue.Queue(),
        step_fn=lambda: (None, False),  # an empty step: nothing scheduled
        post_step=lambda executed: None,
        handled=handled,
        _handle_client_request=lambda *req: handled.append(req),
    )


@pytest.fixture
def patched(monkeypatch):
    original = EngineCoreProc._process_engine_step
    monkeypatch.setenv(engine_idle.ENV_IDLE_POLL_S, "0.2")
    engine_idle.install()
    yield EngineCoreProc._process_engine_step
    EngineCoreProc._process_engine_step = original


def timed_step(step, core) -> float:
    started = time.monotonic()
    assert step(core) is False
    return time.monotonic() - started


def test_without_the_variable_vllm_is_unchanged(monkeypatch):
    monkeypatch.delenv(engine_idle.ENV_IDLE_POLL_S, raising=False)
    before = EngineCoreProc._process_engine_step
    engine_idle.install()
    assert EngineCoreProc._process_engine_step is before


def test_an_engine_only_holding_blocks_waits_for_work(patched):
    assert timed_step(patched, engine(Scheduler())) >= 0.19


def test_a_new_request_ends_the_wait_and_is_handled(patched):
    core = engine(Scheduler())
    threading.Timer(0.05, lambda: core.input_queue.put(("ADD", "r1"))).start()
    assert timed_step(patched, core) < 0.15
    assert core.handled == [("ADD", "r1")]


@pytest.mark.parametrize(
    "scheduler",
    [
        Scheduler(unfinished=1),  # e.g. a request waiting for a peer's blocks: step on
        Scheduler(finished_ids={"r0"}),  # finished ids still to report
        Scheduler(held=0),  # nothing at all: vLLM's own loop blocks on the queue
    ],
)
def test_an_engine_with_anything_else_to_do_does_not_wait(patched, scheduler):
    assert timed_step(patched, engine(scheduler)) < 0.1


def test_a_request_already_queued_is_left_to_vllms_loop(patched):
    core = engine(Scheduler())
    core.input_queue.put(("ADD", "r1"))
    assert timed_step(patched, core) < 0.1
    assert core.handled == [] and core.input_queue.qsize() == 1


def test_install_twice_wraps_once_and_zero_turns_it_off(patched, monkeypatch):
    monkeypatch.setenv(engine_idle.ENV_IDLE_POLL_S, "0")
    engine_idle.install()
    assert EngineCoreProc._process_engine_step is patched
    assert timed_step(patched, engine(Scheduler())) < 0.1


@pytest.mark.parametrize(
    ("raw", "expected"), [("", None), ("x", None), ("-1", 0.0), ("0.02", 0.02)]
)
def test_idle_poll_seconds_reads_the_variable(monkeypatch, raw, expected):
    monkeypatch.setenv(engine_idle.ENV_IDLE_POLL_S, raw)
    assert engine_idle.idle_poll_seconds() == expected
