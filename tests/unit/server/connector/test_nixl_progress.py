"""A peer's read of an instance's blocks completes while the instance's engine is busy (real
NIXL agents over UCX on loopback TCP, in one process).

Why: with NIXL's progress thread off, the engine progresses NIXL only when it polls it, once
per step, so D's read of a turn's prompt from P waited for P's whole forward of the next
prompt (docs/pd.md, "Where a first turn's time goes"). Here the target agent is never called
after the read starts, as during a forward: only its paced progress thread can serve it."""

from __future__ import annotations

import importlib
import time

import nixl._api as nixl_api  # the project installs NIXL (scripts/setup.sh): no skip without it
import torch

from server.connector import vllm_compat

#: A hang guard, not a timing check: the read either completes or never does (without a
#: progress thread it stays in flight for good).
HANG_S = 30.0


def _read(target, reader) -> tuple[str, torch.Tensor]:
    src = torch.full((1 << 20,), 7, dtype=torch.uint8)
    dst = torch.zeros(1 << 20, dtype=torch.uint8)
    target.register_memory(src)
    reader.register_memory(dst)
    name = reader.add_remote_agent(target.get_agent_metadata())
    handle = reader.initialize_xfer(
        "READ", reader.get_xfer_descs(dst), target.get_xfer_descs(src), name
    )
    reader.transfer(handle)
    deadline = time.monotonic() + HANG_S
    state = reader.check_xfer_state(handle)
    while state == "PROC" and time.monotonic() < deadline:
        time.sleep(0.001)  # the reader progresses its own side; the target is left alone
        state = reader.check_xfer_state(handle)
    return state, dst


def test_a_paced_progress_thread_serves_a_read_while_the_engine_never_polls(monkeypatch):
    # TCP only: a one-sided shared-memory read would not need the target's progress at all
    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    worker = importlib.import_module(vllm_compat._LAZY["nixl_base_worker"][0])
    assert worker.nixl_agent_config is not None, "vLLM found no NIXL (scripts/setup.sh installs it)"
    with vllm_compat.nixl_progress_thread(1000):
        target = nixl_api.nixl_agent("target", worker.nixl_agent_config(backends=["UCX"]))
    # the patch is undone: agents built afterwards are as vLLM builds them
    assert worker.nixl_agent_config.__name__ == "nixl_agent_config"
    reader = nixl_api.nixl_agent(
        "reader", worker.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    )
    state, dst = _read(target, reader)
    assert state == "DONE"
    assert bool((dst == 7).all())


def test_nixls_threads_keep_their_priority_and_are_watched_and_an_idle_one_is_not_lowered(
    monkeypatch,
):
    # a progress thread found spinning (its poll returning at once) starved the other replica
    # sharing its core until vLLM's 300 s step timeout; lowered for good, it served a busy
    # peer's reads in almost no CPU: NIXL's threads run at the forward's priority, watched
    import os

    from server.connector import nixl_threads

    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    worker = importlib.import_module(vllm_compat._LAZY["nixl_base_worker"][0])
    before = nixl_threads.native_threads()
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    with vllm_compat.nixl_progress_thread(1000):
        target = nixl_api.nixl_agent("watched", worker.nixl_agent_config(backends=["UCX"]))
    started = nixl_threads.native_threads() - before - nixl_threads.python_threads()
    assert started, "NIXL started no thread of its own"
    reader = nixl_api.nixl_agent(
        "watching", worker.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    )
    state, _ = _read(target, reader)  # a connection in, then idle: its thread sleeps in poll
    assert state == "DONE"
    time.sleep(nixl_threads.WINDOW_S * (nixl_threads.SPIN_WINDOWS + 1))
    for tid in started:
        assert os.getpriority(os.PRIO_PROCESS, tid) == mine, tid
        assert tid not in nixl_threads._watch.lowered, tid
    assert started & set(nixl_threads._watch._last), "NIXL's threads are not watched"
    del target, reader


def test_nixls_threads_asked_lowered_run_at_nice_19_from_the_start(monkeypatch):
    import os

    from server.connector import nixl_threads

    monkeypatch.setenv("UCX_TLS", "tcp")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    worker = importlib.import_module(vllm_compat._LAZY["nixl_base_worker"][0])
    before = nixl_threads.native_threads()
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    with vllm_compat.nixl_progress_thread(1000, lowered=True):
        agent = nixl_api.nixl_agent("lowered", worker.nixl_agent_config(backends=["UCX"]))
    started = nixl_threads.native_threads() - before - nixl_threads.python_threads()
    assert started, "NIXL started no thread of its own"
    for tid in started:
        assert os.getpriority(os.PRIO_PROCESS, tid) == nixl_threads.NIXL_THREAD_NICE, tid
        assert tid not in nixl_threads._watch._last, tid  # lowered, not watched
    assert os.getpriority(os.PRIO_PROCESS, 0) == mine
    del agent
