"""Tensor parallelism: kvbranch with ``--tensor-parallel-size 2`` against plain vLLM with the
same, greedy tokens and logprobs compared, turn 2 and a fork from the host store alone.

Each tensor-parallel rank's worker keeps its own host store of its shard of every block (the
connector's worker role runs in each rank; the scheduler side plans for all of them), so a
load restores every rank's heads. The model is the tiny dense family of ``tests/tiny_models``
(4 attention heads, 2 KV heads: one KV head per rank), with weights that make the answer
depend on the history. Both servers bind their two ranks to cores 0 and 1 (vLLM's
``VLLM_CPU_OMP_THREADS_BIND="0|1"``; ``--cpu-cores`` for kvbranch).
"""

from __future__ import annotations

from tests import prestart, tiny_models
from tests.conftest import VanillaVLLM
from tests.integration.helpers import BLOCK, chat, client, reset_device_cache, system_prompt
from tests.server_process import ServerProcess

SERVED = "tiny-dense-tp2"
TP2 = ["--", "--tensor-parallel-size", "2"]
SIZES = ["--kv-cache-gib", "0.25", "--max-model-len", "2048", "--served-model-name", SERVED]
CORES = "0|1"


def _tp_servers() -> tuple[ServerProcess, ServerProcess]:
    model = ["--model", str(tiny_models.ensure("dense")), *SIZES]
    ours = ServerProcess(
        [*model, "--host-store-gib", "0.25", "--cpu-cores", CORES, *TP2], name="kvbranch-tp2"
    )
    plain = VanillaVLLM(
        [*model, "--no-connector", *TP2],
        name="plain-tp2",
        env={"VLLM_CPU_OMP_THREADS_BIND": CORES},
    )
    ours.model = plain.model = SERVED
    return ours, plain


tp_servers = prestart.fixture("tp_servers", _tp_servers, scope="module", engines=2)


def greedy(server, messages, **kw) -> tuple[list[tuple[str, float]], dict]:
    """The greedy tokens with their logprobs (to 3 decimals: the ranks' float32 sums), and
    the response."""
    response = chat(server, messages, max_tokens=8, logprobs=True, **kw)
    content = response["choices"][0]["logprobs"]["content"]
    return [(c["token"], round(c["logprob"], 3)) for c in content], response


def test_tensor_parallel_turns_and_a_fork_from_the_host_store(tp_servers):
    ours, plain = tp_servers
    messages = [
        {"role": "system", "content": system_prompt(words=400, seed=7)},
        {"role": "user", "content": "Step 0. The tool returned 17 rows. What next?"},
    ]
    first, response = greedy(ours, messages, session="tp")
    assert first == greedy(plain, messages)[0]
    stored = response["usage"]["prompt_tokens"] // BLOCK * BLOCK
    history = [
        *messages,
        {"role": "assistant", "content": response["choices"][0]["message"]["content"]},
    ]

    turn2 = [*history, {"role": "user", "content": "Step 1. It failed. What now?"}]
    reset_device_cache(ours)
    second, response = greedy(ours, turn2, session="tp")
    assert second == greedy(plain, turn2)[0]
    assert response["kvbranch"]["device_hit_tokens"] == 0
    assert response["kvbranch"]["host_hit_tokens"] >= stored

    with client(ours) as c:
        r = c.post(
            "/v1/kvbranch/sessions/tp/branches",
            json={"parent": "main", "branch_id": "alt", "messages": history},
        )
    assert r.status_code == 201, r.text
    alt = [*history, {"role": "user", "content": "Instead, retry with 3 rows. Which first?"}]
    reset_device_cache(ours)
    forked, response = greedy(ours, alt, session="tp", branch="alt")
    assert forked == greedy(plain, alt)[0]
    assert response["kvbranch"]["device_hit_tokens"] == 0
    assert response["kvbranch"]["host_hit_tokens"] >= stored
