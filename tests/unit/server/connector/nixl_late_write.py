"""Run by ``test_nixl_late_write.py`` in a process of its own (UCX reads its transports from the
environment when the first agent is made): two real NIXL agents, a reader and a peer that
stops progressing on command, and what a read posted meanwhile does. Prints one JSON line."""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from typing import Any

import torch

SIZE = 1 << 20


def peer(meta_q: Any, cmd_q: Any, ack_q: Any) -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("peer", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    buf = torch.ones(SIZE, dtype=torch.uint8)
    agent.register_memory(buf)
    meta_q.put((agent.get_agent_metadata(), agent.get_serialized_descs(agent.get_xfer_descs(buf))))
    progressing = True
    while True:
        try:
            cmd = cmd_q.get(timeout=0.001)
        except Exception:
            cmd = None
        if cmd == "pause":
            progressing = False
            ack_q.put(cmd)
        elif cmd == "resume":
            progressing = True
            ack_q.put(cmd)
        elif cmd == "quit":
            return
        if progressing:
            agent.get_new_notifs()  # drives UCX's progress, as the peer's thread would


class Worker:
    """What ``LateReads`` reads of NIXL's pull worker, around a real agent."""

    def __init__(self, agent: Any) -> None:
        self.nixl_wrapper = agent
        self._recving_transfers: dict[str, list[int]] = {}
        self._recv_failures: set[str] = set()


def main() -> None:
    from nixl._api import nixl_agent, nixl_agent_config

    from server.connector.pd.late_reads import LateReads

    meta_q, cmd_q, ack_q = mp.Queue(), mp.Queue(), mp.Queue()
    child = mp.Process(target=peer, args=(meta_q, cmd_q, ack_q), daemon=True)
    child.start()
    agent = nixl_agent("reader", nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    dst = torch.zeros(SIZE, dtype=torch.uint8)
    agent.register_memory(dst)
    metadata, descs = meta_q.get(timeout=60)
    name = agent.add_remote_agent(metadata)
    local, remote = agent.get_xfer_descs(dst), agent.deserialize_descs(descs)

    def read() -> int:
        handle = agent.initialize_xfer("READ", local, remote, name, b"n")
        agent.transfer(handle)
        return handle

    def settle(seconds: float) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            agent.get_new_notifs()
            time.sleep(0.002)

    first = read()  # wires the pair up
    end = time.monotonic() + 30
    while agent.check_xfer_state(first) == "PROC" and time.monotonic() < end:
        agent.get_new_notifs()
    out: dict[str, Any] = {"wired": agent.check_xfer_state(first)}
    agent.release_xfer_handle(first)

    # 1. A read released while in flight.
    dst.zero_()
    cmd_q.put("pause"), ack_q.get(timeout=10)
    handle = read()
    settle(0.3)
    out["before_release"] = int(dst.count_nonzero())
    out["state_at_release"] = agent.check_xfer_state(handle)
    agent.release_xfer_handle(handle)
    cmd_q.put("resume"), ack_q.get(timeout=10)
    settle(1.0)
    out["after_release"] = int(dst.count_nonzero())

    # 2. The same read given up through LateReads: polled until NIXL says it ended.
    dst.zero_()
    worker, late = Worker(agent), LateReads()
    cmd_q.put("pause"), ack_q.get(timeout=10)
    worker._recving_transfers["r"] = [read()]
    settle(0.3)
    late.give_up(worker, "r", [1, 2])
    late.poll(worker)
    given = late.report()
    out["given_up"] = {k: v[0] for k, v in given.given_up.items()} if given else {}
    out["in_flight_while_paused"] = len(late)
    cmd_q.put("resume"), ack_q.get(timeout=10)
    end = time.monotonic() + 30
    while len(late) and time.monotonic() < end:
        agent.get_new_notifs()
        late.poll(worker)
    written_when_ended = int(dst.count_nonzero())
    settle(0.5)
    ended = late.report()
    out["ended"] = sorted(ended.ended) if ended else []
    out["written_when_ended"] = written_when_ended
    out["written_later"] = int(dst.count_nonzero()) - written_when_ended
    out["size"] = SIZE
    cmd_q.put("quit")
    child.join(10)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
