"""Every attention family kvbranch is meant to serve (docs/models.md), on the real engine with
a tiny model of that shape (:mod:`tests.tiny_models`: weights that make the output depend on the
context, nothing downloaded), against plain vLLM with its hybrid KV cache manager on.

For each family one kvbranch server and one plain vLLM server (0.25 GiB of device KV each),
shared by the family's two tests and stopped after them. Three turns over a ~900-token prompt,
then a fork (turn 1's conversation with another second step) and a history that diverges from
what is stored (turn 3's prompt with one word of the context changed): kvbranch's device prefix
cache is reset before every request but the first, so every reused token comes from the host
store, and each answer's greedy tokens and their logprobs must be plain vLLM's.

Completions, not chat: vLLM renders a gpt-oss chat in Harmony's own token ids, which the
embedded tokenizer (vocabulary 49152) does not have.

The answers must be plain vLLM's in every family. Where the connector does not serve a family
yet (its host store stays off and kvbranch runs as plain vLLM), the host-store check is an
``xfail(strict=True)`` with the reason: the day it passes, the mark must go.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from collections.abc import Callable

import pytest
import redis

from sdk.contract import SESSION_HEADER
from server.common.tenants import ANONYMOUS
from server.connector.pd.transfer_auth import ENV_CLUSTER_SECRET
from server.index.redis_store import RedisKeys, digest
from tests import prestart
from tests.conftest import VanillaVLLM
from tests.integration.helpers import (
    client,
    empty_caches,
    pd_instance,
    reset_device_cache,
    stats,
    system_prompt,
)
from tests.prestart import BIND_ENV
from tests.redis_server import RedisServer
from tests.server_process import ServerProcess, free_port
from tests.tiny_models import ensure

SERVED = "tiny"
SIZES = ["--kv-cache-gib", "0.25", "--max-model-len", "2048", "--served-model-name", SERVED]
#: The same greedy tokens differ in their logprobs by float rounding only where the two servers
#: split the work differently (a host-store hit and vLLM's own prefix hit cover different
#: spans); a wrongly loaded block or state moves them by far more (docs/models.md).
LOGPROB_TOL = 1e-3
#: Alternatives compared at each position: a model whose next token is nearly certain (the
#: Gemma 3 shape here) shows a wrong context in the runners-up more than in the token it picks.
TOP_LOGPROBS = 5
#: Tokens of each turn's answer.
ANSWER_TOKENS = 16
STEPS = (
    "Tool result: train 8412 leaves 07:55 from platform 4, seats left in car 12. What next?",
    "Tool result: the museum opens 10:00, tickets 17 EUR, closed on Tuesdays. What next?",
    "Tool result: rain expected after 15:00, 40 mm. Should the plan change?",
)

#: vLLM options a family needs on CPU, for both servers (after ``--``).
VLLM_OPTIONS: dict[str, list[str]] = {
    # vLLM 0.32's CPU Mamba 2 kernel ignores return_intermediate_states, so its prefix caching
    # ("align" mode) fails on any prompt that crosses a block (IndexError in mamba_mixer2)
    "mamba2": ["--no-enable-prefix-caching"],
}
#: vLLM options only the plain vLLM reference needs (kvbranch's launcher chooses them).
PLAIN_OPTIONS: dict[str, list[str]] = {
    # vLLM 0.32's CPU worker raises the attention block size to 384 (one Gated DeltaNet state
    # per page) after the engine core copied its config: its scheduler would split prompts
    # at 128-token steps and keep no state at the 384-token blocks. Given the size, it keeps a
    # state per block boundary a prefill chunk ends on; kvbranch's launcher passes the size
    # vLLM's own rule gives, and the host-store check below fails without it.
    "gdn": ["--block-size", "384"],
}
#: Tokens per block where not vLLM's CPU default of 128 (the launcher's choice for a hybrid).
BLOCK_TOKENS = {"gdn": 384}
#: Families the connector does not serve yet, and why.
NOT_SERVED = {
    "mla": "vLLM's CPU MLA backend cannot continue from a loaded prefix (prefix caching is "
    "off for MLA on CPU): the host store stays off, nothing is loaded",
    "mamba2": "Mamba 2 state groups: the host store keeps attention KV only and stays off "
    "(and vLLM's CPU Mamba 2 has no prefix caching to resume from)",
}


def _factory(family: str):
    def servers() -> tuple[ServerProcess, ServerProcess]:
        model = ["--model", str(ensure(family)), *SIZES]
        options = VLLM_OPTIONS.get(family, [])
        vllm = ["--", *options] if options else []
        plain_options = [*options, *PLAIN_OPTIONS.get(family, [])]
        plain_vllm = ["--", *plain_options] if plain_options else []
        ours = ServerProcess([*model, "--host-store-gib", "0.25", *vllm], name=f"kvbranch-{family}")
        plain = VanillaVLLM([*model, "--no-connector", *plain_vllm], name=f"plain-{family}")
        ours.model = plain.model = SERVED
        return ours, plain

    return servers


dense_servers = prestart.fixture("dense_servers", _factory("dense"), scope="module", engines=2)
mla_servers = prestart.fixture("mla_servers", _factory("mla"), scope="module", engines=2)
gpt_oss_servers = prestart.fixture(
    "gpt_oss_servers", _factory("gpt-oss"), scope="module", engines=2
)
gemma3_servers = prestart.fixture("gemma3_servers", _factory("gemma3"), scope="module", engines=2)
gdn_servers = prestart.fixture("gdn_servers", _factory("gdn"), scope="module", engines=2)
mamba2_servers = prestart.fixture("mamba2_servers", _factory("mamba2"), scope="module", engines=2)


def _pd_factory(family: str):
    def instances() -> tuple[ServerProcess, ServerProcess]:
        args = [
            "--model",
            str(ensure(family)),
            *SIZES,
            "--host-store-gib",
            "0.25",
            "--pd-hold-ttl-s",
            "120",
        ]
        prefill = pd_instance(args, "prefill", "0", name=f"prefill-{family}")
        decode = pd_instance(args, "decode", "1", name=f"decode-{family}")
        prefill.model = decode.model = SERVED
        return prefill, decode

    return instances


#: P/D pairs of the sliding-window families (with the hybrid KV cache manager on, as plain
#: vLLM runs them); state families are refused by P/D (docs/models.md).
gpt_oss_pd = prestart.fixture("gpt_oss_pd", _pd_factory("gpt-oss"), scope="module", engines=2)
gemma3_pd = prestart.fixture("gemma3_pd", _pd_factory("gemma3"), scope="module", engines=2)


class FamilyReplicas:
    """Redis and two aggregated replicas of one family (``--role single --index``): a turn
    sent to the replica that did not serve the last one pulls the history from its peer."""

    engines = 2  # what tests.prestart counts against the memory budget

    def __init__(self, family: str) -> None:
        self.redis = RedisServer()
        env = {ENV_CLUSTER_SECRET: secrets.token_hex(32), "PYTHONHASHSEED": "0"}
        args = ["--model", str(ensure(family)), *SIZES, "--host-store-gib", "0.25"]
        args += ["--pd-hold-ttl-s", "60", "--index", self.redis.url]
        self.replicas = [
            ServerProcess(
                [*args, "--cpu-cores", os.environ.get(BIND_ENV) or core]
                + ["--nixl-port", str(free_port())],
                name=f"replica-{family}-{core}",
                ready_timeout=900,
                env=env,
            )
            for core in ("0", "1")
        ]
        for replica in self.replicas:
            replica.model = SERVED

    def launch(self) -> None:
        self.redis.start()
        for replica in self.replicas:
            replica.launch()

    def wait_ready(self) -> None:
        for replica in self.replicas:
            replica.wait_ready()

    def stop(self) -> None:
        for replica in self.replicas:
            replica.stop()
        self.redis.close()

    def wait_for_hold(self, session: str, timeout_s: float = 30.0) -> None:
        """Until the session's hold is in the index: a replica files it (and a turn takes it)
        as its answer ends, after the response."""
        key = RedisKeys("default").hold(
            digest(ANONYMOUS, session), digest(ANONYMOUS, session, "main")
        )
        deadline = time.monotonic() + timeout_s
        with redis.Redis(unix_socket_path=str(self.redis.socket), socket_timeout=5) as r:
            while not r.exists(key):
                assert time.monotonic() < deadline, f"no replica filed a hold for {session}"
                time.sleep(0.2)


gemma3_replicas = prestart.fixture(
    "gemma3_replicas", lambda: (FamilyReplicas("gemma3"),), scope="module", engines=2
)


def complete(server, prompt: str, session: str | None = None) -> dict:
    body = {
        "model": SERVED,
        "prompt": prompt,
        "max_tokens": ANSWER_TOKENS,
        "temperature": 0,
        "logprobs": TOP_LOGPROBS,
    }
    headers = {SESSION_HEADER: session} if session else {}
    with client(server) as c:
        r = c.post("/v1/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()


def answer(response: dict) -> list[tuple[str, float, dict[str, float]]]:
    """Each generated token, its logprob and the top :data:`TOP_LOGPROBS` alternatives'."""
    logprobs = response["choices"][0]["logprobs"]
    return list(
        zip(
            logprobs["tokens"],
            logprobs["token_logprobs"],
            logprobs["top_logprobs"],
            strict=True,
        )
    )


def turns(send: Callable[[int, str], dict]) -> tuple[list[dict], list[str]]:
    """Three agent turns over one long context, each prompt the last one with its answer and
    the next step appended, each answered by ``send(step, prompt)``; the answers and the
    prompts."""
    prompt = system_prompt(words=300, seed=41)
    responses, prompts = [], []
    for step, note in enumerate(STEPS):
        prompt += f"\nStep {step}. {note}\n"
        prompts.append(prompt)
        responses.append(send(step, prompt))
        prompt += responses[-1]["choices"][0]["text"]
    return responses, prompts


def at(server, *, reset_between: bool) -> Callable[[int, str], dict]:
    """:func:`turns`' sender for one server, its device cache reset before every turn but the
    first when ``reset_between``."""

    def send(step: int, prompt: str) -> dict:
        if reset_between and step:
            reset_device_cache(server)
        return complete(server, prompt)

    return send


def check_pulled(responses: list[dict]) -> None:
    """Turns 2 and 3 took nothing from the device cache or the host store and pulled the whole
    previous turn, but for a token the next prompt may re-tokenize."""
    for step in (1, 2):
        split = responses[step]["kvbranch"]
        before = responses[step - 1]["usage"]["prompt_tokens"]
        assert split["device_hit_tokens"] == split["host_hit_tokens"] == 0, (step, split)
        assert split["remote_hit_tokens"] >= before - 2, (step, before, split)


#: The fork's second step (the conversation's was ``STEPS[1]``).
FORK_STEP = "Tool result: the museum is closed today, the park is open until 20:00. What next?"


def with_one_word_changed(prompt: str) -> str:
    """The prompt with the context's word at 60% of the way replaced by another: a history
    that differs from the stored one after its first blocks."""
    words = prompt.split(" ")
    k = len(words) * 3 // 5
    words[k] = "changed" + words[k]
    return " ".join(words)


def first_difference(server, a: str, b: str) -> int:
    """The index of the first token where two prompts differ (vLLM's own tokenizer)."""
    with client(server) as c:
        ids = [c.post("/tokenize", json={"model": SERVED, "prompt": p}).json() for p in (a, b)]
    first, second = (answer["tokens"] for answer in ids)
    return next(i for i, (x, y) in enumerate(zip(first, second, strict=False)) if x != y)


def conversation(server, *, reset_between: bool) -> tuple[list[dict], int]:
    """:func:`turns`, then the fork and the diverging history; with the token index where the
    diverging history first differs from the stored one."""
    responses, prompts = turns(at(server, reset_between=reset_between))
    fork = prompts[0] + responses[0]["choices"][0]["text"] + f"\nStep 1. {FORK_STEP}\n"
    changed = with_one_word_changed(prompts[2])
    for prompt in (fork, changed):
        if reset_between:
            reset_device_cache(server)
        responses.append(complete(server, prompt))
    return responses, first_difference(server, prompts[2], changed)


_turns: dict[str, tuple[list[dict], list[dict], int]] = {}


def family_turns(family: str, servers) -> tuple[list[dict], list[dict], int]:
    """Each family's requests, (kvbranch's, plain vLLM's), and where the diverging history
    differs: run once, checked by the family's tests."""
    if family not in _turns:
        ours, plain = servers
        mine, diverges = conversation(ours, reset_between=True)
        reference, _ = conversation(plain, reset_between=False)
        _turns[family] = mine, reference, diverges
    return _turns[family]


def check_answers(family: str, servers) -> None:
    """Every answer's greedy tokens and logprobs are plain vLLM's."""
    mine, reference, _ = family_turns(family, servers)
    for got, want in zip(mine, reference, strict=True):
        assert_same_answer(got, want)


def assert_same_answer(got: dict, want: dict) -> None:
    """The same greedy tokens, their logprobs and the runners-up's within :data:`LOGPROB_TOL`."""
    got_answer, want_answer = answer(got), answer(want)
    assert [a[0] for a in got_answer] == [a[0] for a in want_answer], got_answer
    shifts = []
    for (token, lp, top), (_, want_lp, want_top) in zip(got_answer, want_answer, strict=True):
        shifts.append((abs(lp - want_lp), token, token))
        # runners-up in both top lists (a near tie may swap the last place)
        shifts += [
            (abs(top[other] - want_top[other]), token, other)
            for other in top.keys() & want_top.keys()
        ]
    assert max(shifts)[0] <= LOGPROB_TOL, max(shifts)


def check_host_store(family: str, servers) -> None:
    """Turns 2 and 3 took the previous turn's whole blocks from the host store (the device
    cache had been reset), the fork its parent's turn 1; the diverging history took nothing
    past its first changed token."""
    mine, _, diverges = family_turns(family, servers)
    block = BLOCK_TOKENS.get(family, 128)
    for step, parent in ((1, 0), (2, 1), (3, 0)):
        usage = mine[step]["kvbranch"]
        before = mine[parent]["usage"]["prompt_tokens"]
        assert usage["device_hit_tokens"] == 0, (step, usage)
        assert usage["host_hit_tokens"] >= before // block * block > 0, (step, before, usage)
    usage = mine[4]["kvbranch"]
    assert usage["device_hit_tokens"] == 0 and usage["host_hit_tokens"] <= diverges, usage
    if family in WINDOWED:
        share = check_window_parts(servers[0])
        print(f"{family}: host store bytes against every layer at every position: {share:.2f}")
    if family in STATEFUL:
        share = check_state_parts(servers[0])
        print(f"{family}: host store bytes against a state's room at every position: {share:.2f}")


#: Families with sliding-window layers: the store keeps their part of a position only near
#: resume points (server/connector/core/part_pool.py).
WINDOWED = {"gpt-oss", "gemma3"}


def check_window_parts(server) -> float:
    """The windowed layers' part was kept for fewer positions than the rest of the store (only
    the window before each prompt's and answer's end), no load missed one, and the bytes the
    store took for these turns against a store of every layer at every position: returned."""
    store = stats(server)["store"]
    assert store["window_misses"] == 0, store
    assert store["window_part_bytes"] > 0 and store["loaded_window_parts"] > 0, store
    positions = store["saved_blocks"] + store["saved_tails"]
    assert 0 < store["saved_window_parts"] < positions, store
    kept = (
        positions * store["block_bytes"] + store["saved_window_parts"] * store["window_part_bytes"]
    )
    return kept / (positions * (store["block_bytes"] + store["window_part_bytes"]))


#: Families with recurrent-state layers: the store keeps a state only where vLLM kept one
#: and, once a request ends, at its resume points (server/connector/core/part_pool.py).
STATEFUL = {"gdn"}


def check_state_parts(server) -> float:
    """States were kept for fewer positions than the store holds, and loaded; the bytes the
    store holds now against a slot with a state's room at every stored position: returned."""
    store = stats(server)["store"]
    assert store["state_part_bytes"] > 0 and store["loaded_states"] > 0, store
    assert 0 < store["state_parts_used"] < store["used_blocks"], store
    held = (
        store["used_blocks"] * store["block_bytes"]
        + store["state_parts_used"] * store["state_part_bytes"]
    )
    return held / (store["used_blocks"] * (store["block_bytes"] + store["state_part_bytes"]))


def capacity(server) -> list[str]:
    """vLLM's start-up line with the device's KV cache size and its concurrency."""
    lines = server.log_tail(5000, ("KV cache size",))
    return re.findall(r"KV cache size: [\d,]+ tokens, Maximum concurrency.*", lines)


def check_pd_pull(family: str, servers, instances) -> None:
    """Through P/D (router, P, D): turns 2 and 3 take their history from D alone (P's device
    cache and host store emptied before each), every answer is plain vLLM's; the diverging
    history, whose verified prefix ends before D's last block, pulls nothing (a window group
    cannot continue from there) and is still answered right."""
    _, reference, _ = family_turns(family, servers)
    prefill, decode = instances
    # vLLM's hybrid KV cache manager stays on under P/D: the window layers keep only their
    # window, so P and D hold as many tokens and requests as plain vLLM in the same memory
    want = capacity(servers[1])
    assert want and capacity(prefill) == want == capacity(decode), (want, capacity(prefill))
    args = ["--role", "router", "--prefill", prefill.url, "--decode", decode.url]
    router = ServerProcess(
        [*args, "--router-policy", "always-split", "--pd-hold-ttl-s", "120"],
        name=f"router-{family}",
        ready_timeout=120,
    )
    router.model = SERVED
    session = f"pd-{family}"

    def send(_step: int, prompt: str) -> dict:
        empty_caches(prefill, wait_s=30)
        return complete(router, prompt, session)

    with router:
        responses, prompts = turns(send)
        responses.append(send(3, with_one_word_changed(prompts[2])))
    for got, want in zip(responses, [*reference[:3], reference[4]], strict=True):
        assert_same_answer(got, want)
    check_pulled(responses)
    assert responses[3]["kvbranch"]["remote_hit_tokens"] == 0, responses[3]["kvbranch"]


def check_peer_pull(family: str, servers, cluster: FamilyReplicas) -> None:
    """Aggregated replicas taking turns (as round robin would send them): each turn after the
    first goes to the other replica with its caches emptied, pulls the previous turn from its
    peer, and answers as plain vLLM."""
    _, reference, _ = family_turns(family, servers)
    session = f"replicas-{family}"

    def send(step: int, prompt: str) -> dict:
        replica = cluster.replicas[step % 2]
        if step:
            cluster.wait_for_hold(session)
            empty_caches(replica, wait_s=60)
        return complete(replica, prompt, session)

    responses, _ = turns(send)
    for got, want in zip(responses, reference[:3], strict=True):
        assert_same_answer(got, want)
    check_pulled(responses)


def not_served(family: str) -> pytest.MarkDecorator:
    return pytest.mark.xfail(strict=True, reason=NOT_SERVED[family])


# Two tests per family, each naming its family's servers: they launch ahead of the first and
# stop after the second. The answers must be plain vLLM's in every family (where the host
# store is off kvbranch is plain vLLM); the host store serves the families not marked.
def test_dense_answers(dense_servers):
    check_answers("dense", dense_servers)


def test_dense_host_store(dense_servers):
    check_host_store("dense", dense_servers)


def test_mla_answers(mla_servers):
    check_answers("mla", mla_servers)


@not_served("mla")
def test_mla_host_store(mla_servers):
    check_host_store("mla", mla_servers)


def test_gpt_oss_answers(gpt_oss_servers):
    check_answers("gpt-oss", gpt_oss_servers)


def test_gpt_oss_host_store(gpt_oss_servers):
    check_host_store("gpt-oss", gpt_oss_servers)


def test_gpt_oss_pd_pull(gpt_oss_servers, gpt_oss_pd):
    check_pd_pull("gpt-oss", gpt_oss_servers, gpt_oss_pd)


def test_gemma3_answers(gemma3_servers):
    check_answers("gemma3", gemma3_servers)


def test_gemma3_host_store(gemma3_servers):
    check_host_store("gemma3", gemma3_servers)


def test_gemma3_pd_pull(gemma3_servers, gemma3_pd):
    check_pd_pull("gemma3", gemma3_servers, gemma3_pd)


def test_gemma3_peer_pull(gemma3_servers, gemma3_replicas):
    check_peer_pull("gemma3", gemma3_servers, gemma3_replicas)


def test_gated_deltanet_answers(gdn_servers):
    check_answers("gdn", gdn_servers)


def test_gated_deltanet_host_store(gdn_servers):
    check_host_store("gdn", gdn_servers)


def test_mamba2_answers(mamba2_servers):
    check_answers("mamba2", mamba2_servers)


@not_served("mamba2")
def test_mamba2_host_store(mamba2_servers):
    check_host_store("mamba2", mamba2_servers)
