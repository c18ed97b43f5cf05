"""vLLM's own server, not kvbranch's launcher: ``python -m vllm.entrypoints.openai.api_server``
(what ``vllm serve`` runs; the CPU wheel's ``vllm`` command itself does not start, see
docs/vllm-serve.md) with kvbranch's connector in ``--kv-transfer-config`` and
``VLLM_PLUGINS=kvbranch``. The session routes, the usage split and the host store must all come
with it through vLLM's plugin entry points and the config alone (no ``KVBRANCH_*`` environment),
and its answers must be token-identical to plain vLLM's (``plain_server``).

One server start for the module, sized like the session's others (0.5 GiB device KV cache,
0.25 GiB host store, 4096 tokens). It runs as ``python -m tests.integration.test_vllm_serve``:
:func:`main` only makes it stop with the test process, as every test server does
(:func:`server.launcher.process.die_with_launcher`, :func:`~server.launcher.process.start_reaper`),
and then runs vLLM's module as ``__main__``, exactly as ``python -m`` would.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

from tests import prestart
from tests.integration.helpers import (
    BLOCK,
    chat,
    client,
    reset_device_cache,
    system_prompt,
    text_of,
)
from tests.server_process import MODEL_NAME, ServerProcess

GIB = 1 << 30
SERVE_MODULE = "vllm.entrypoints.openai.api_server"


def serve_argv(model_path: str) -> list[str]:
    """The command line a user writes (docs/vllm-serve.md), with the test sizes and the flags
    ``plain_server`` gets from the launcher (so greedy outputs can be compared)."""
    kv_transfer_config = {
        "kv_connector": "KVBranchConnector",
        "kv_connector_module_path": "server.connector.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {
            "host_store_bytes": GIB // 4,
            "pin_budget_bytes": int(0.05 * GIB),
        },
    }
    return [
        "--model",
        model_path,
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--kv-cache-memory-bytes",
        str(GIB // 2),
        "--max-model-len",
        "4096",
        "--dtype",
        "float32",
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--uvicorn-log-level",
        "warning",
        "--kv-transfer-config",
        json.dumps(kv_transfer_config),
    ]


class VllmServe(ServerProcess):
    """vLLM's own OpenAI server with kvbranch's connector and plugin (see :func:`main`)."""

    module = "tests.integration.test_vllm_serve"


def _vllm_serve() -> tuple[VllmServe]:
    from server.model_cache import ensure_model

    # None of the launcher's environment: only vLLM's allow-list for its endpoint plugins.
    assert not os.environ.get("KVBRANCH_CONTROL_SOCKET")
    argv = serve_argv(str(ensure_model()))
    return (VllmServe(argv, name="vllm-serve", env={"VLLM_PLUGINS": "kvbranch"}),)


vllm_serve = prestart.fixture("vllm_serve", _vllm_serve, scope="module")


CONVERSATION = [
    "Tool result: weather in Paris is 18C, light rain, wind 12 km/h, humidity 80 percent.",
    "Tool result: hotel Le Marais has 3 rooms left at 142 EUR per night, breakfast included.",
]
FORK = "Instead, book a train. Which one?"


def _session(server, session):
    """Two turns and a fork at the first answer; with a session id the device cache is dropped
    before each later turn (the host store must bring the history back). Returns the three
    responses."""
    messages = [{"role": "system", "content": system_prompt(seed=11)}]
    responses = []
    for turn, observation in enumerate(CONVERSATION):
        if session and turn:
            reset_device_cache(server)
        messages.append({"role": "user", "content": f"Step {turn}. {observation} What next?"})
        responses.append(chat(server, messages, session=session, max_tokens=16))
        messages.append({"role": "assistant", "content": text_of(responses[-1])})
    forked = messages[:3] + [{"role": "user", "content": FORK}]
    if session:
        with client(server) as c:
            r = c.post(
                f"/v1/kvbranch/sessions/{session}/branches",
                json={"parent": "main", "branch_id": "alt", "messages": messages[:3]},
            )
        assert r.status_code == 201, r.text
        assert r.json()["fork_offset_tokens"] > 0
        reset_device_cache(server)
    responses.append(chat(server, forked, session=session, branch="alt" if session else None))
    return responses


def test_vllm_serve_runs_kvbranch_sessions_like_plain_vllm(vllm_serve, plain_server):
    with client(vllm_serve) as c:
        health = c.get("/v1/kvbranch/health")
    assert health.status_code == 200, health.text
    assert health.json()["connector"]["loaded"] is True
    assert health.json()["connector"]["block_size"] == BLOCK

    first, second, forked = _session(vllm_serve, "serve-session")
    for response in (first, second, forked):
        split, usage = response["kvbranch"], response["usage"]
        assert split["prompt_tokens"] == usage["prompt_tokens"]
        assert (
            split["device_hit_tokens"] + split["host_hit_tokens"] + split["recomputed_tokens"]
            == usage["prompt_tokens"]
        )
    # the device cache was dropped: the history came back from the host store
    for response in (second, forked):
        assert response["kvbranch"]["device_hit_tokens"] == 0
        assert response["kvbranch"]["host_hit_tokens"] >= BLOCK
        assert (
            response["usage"]["prompt_tokens_details"]["cached_tokens"]
            == (response["kvbranch"]["host_hit_tokens"])
        )
    assert forked["kvbranch"]["branch_id"] == "alt"

    plain = _session(plain_server, None)
    assert [text_of(r) for r in (first, second, forked)] == [text_of(r) for r in plain]

    with client(vllm_serve) as c:
        metrics = c.get("/metrics").text
    assert "kvbranch_connector_up 1.0" in metrics


def main(argv: list[str]) -> None:
    """``python -m tests.integration.test_vllm_serve ARGS``: vLLM's ``python -m
    vllm.entrypoints.openai.api_server ARGS``, stopped with the test process."""
    from server.launcher.process import die_with_launcher, start_reaper

    die_with_launcher()
    start_reaper()
    sys.argv = [SERVE_MODULE, *argv]
    runpy.run_module(SERVE_MODULE, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
