"""The model families kvbranch serves (docs/models.md), on the real engine, nothing downloaded.

* Sliding-window layers: the embedded model's weights under a config that makes every other
  layer a sliding-window layer (``layer_types``, a 256-token window: two blocks), the shape of
  Gemma 2/3, gpt-oss or Cohere 2. Both servers keep vLLM's hybrid KV cache manager on (a
  group per layer kind; kvbranch declares SupportsHMA), so the window layers' blocks are freed
  as the window moves and a load restores only the blocks the window still covers. The greedy
  tokens must be the same, also when every reused token of turn 2 and of a fork came from the
  host store (device cache reset between turns): the windowed layers must not load wrong KV.
* Hybrid attention/SSM: the tiny Granite 4.0 hybrid config (``tests/tiny_models.py``, Mamba 2
  and attention layers) is refused by a P/D instance's launcher in one line that names the
  model type, before vLLM loads anything (P/D runs with the hybrid manager off, which state
  layers need).

One kvbranch server and one plain vLLM server for the module (0.25 GiB of KV each), stopped at
its end.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from server.launcher.model_cache import ensure_model
from tests import prestart, tiny_models
from tests.conftest import VanillaVLLM
from tests.integration.helpers import (
    BLOCK,
    chat,
    client,
    reset_device_cache,
    system_prompt,
    text_of,
)
from tests.server_process import ServerProcess

ROOT = Path(__file__).resolve().parents[2]
SERVED = "smollm2-sliding"
WINDOW = 2 * BLOCK
#: What vLLM logs when it manages a model's sliding-window layers as full attention.
HMA_OFF_FOR_HYBRID = "Hybrid KV cache manager is disabled for this hybrid model"
DUMMY = ["--load-format", "dummy"]
SIZES = ["--kv-cache-gib", "0.25", "--max-model-len", "2048", "--served-model-name", SERVED]


def link_model(source: Path, target: Path, config: dict) -> Path:
    """``target``: ``source``'s files as links, with ``config`` as its config.json."""
    target.mkdir()
    for path in source.iterdir():
        if path.name != "config.json":
            (target / path.name).symlink_to(path)
    (target / "config.json").write_text(json.dumps(config, indent=1))
    return target


def sliding_model() -> Path:
    """The embedded model's weights under a config with every other layer a sliding window,
    in a folder of its own (made when the servers are launched, ahead of the module)."""
    source = ensure_model()
    config = json.loads((source / "config.json").read_text())
    layers = int(config["num_hidden_layers"])
    config["layer_types"] = [
        "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)
    ]
    config["sliding_window"] = WINDOW
    folder = Path(tempfile.mkdtemp(prefix="kvb-models-"))
    return link_model(source, folder / "sliding", config)


def _sliding_servers() -> tuple[ServerProcess, ServerProcess]:
    """(kvbranch, plain vLLM) on the sliding-window model, started side by side."""
    model = ["--model", str(sliding_model()), *SIZES]
    ours = ServerProcess([*model, "--host-store-gib", "0.25"], name="kvbranch-swa")
    plain = VanillaVLLM([*model, "--no-connector"], name="plain-swa")
    ours.model = plain.model = SERVED
    return ours, plain


sliding_servers = prestart.fixture("sliding_servers", _sliding_servers, scope="module", engines=2)


def turns(server, session: str | None, *, reset_between: bool) -> tuple[list[dict], list[dict]]:
    """Two agent turns over a long system prompt (several windows long); returns (responses,
    the message history)."""
    messages = [{"role": "system", "content": system_prompt(words=300, seed=41)}]
    responses = []
    for step, note in enumerate(
        (
            "Tool result: train 8412 leaves 07:55 from platform 4, seats left in car 12.",
            "Tool result: the museum opens 10:00, tickets 17 EUR, closed on Tuesdays.",
        )
    ):
        if reset_between and step:
            reset_device_cache(server)
        messages.append({"role": "user", "content": f"Step {step}. {note} What next?"})
        response = chat(server, messages, session=session, max_tokens=24)
        responses.append(response)
        messages.append({"role": "assistant", "content": text_of(response)})
    return responses, messages


def test_sliding_window_model_is_token_exact_through_the_host_store(sliding_servers):
    ours, plain = sliding_servers
    # both keep vLLM's hybrid KV cache manager on: a group for each kind of layer, the window
    # layers' blocks freed as the window moves (kvbranch declares SupportsHMA)
    for server in (ours, plain):
        groups = server.log_tail(5000, ("kv cache group sizes",))
        assert re.search(r"kv cache group sizes \(\d+, \d+\)", groups), groups
        assert not server.log_tail(5000, (HMA_OFF_FOR_HYBRID, "Turning off hybrid kv cache"))
    assert "host store disabled" not in ours.log_tail(5000, ("host store disabled",))
    # ... so the device holds as many tokens and requests as plain vLLM's in the same memory
    capacity = [
        re.findall(
            r"KV cache size: [\d,]+ tokens, Maximum concurrency.*",
            s.log_tail(5000, ("KV cache size",)),
        )
        for s in (ours, plain)
    ]
    assert capacity[0] and capacity[0] == capacity[1], capacity

    responses, history = turns(ours, "swa", reset_between=True)
    plain_responses, _ = turns(plain, None, reset_between=False)
    assert [text_of(r) for r in responses] == [text_of(r) for r in plain_responses]
    assert responses[0]["usage"]["prompt_tokens"] > 3 * WINDOW  # the window matters
    second = responses[1]["kvbranch"]
    assert second["device_hit_tokens"] == 0
    assert second["host_hit_tokens"] >= responses[0]["usage"]["prompt_tokens"] // BLOCK * BLOCK

    # a fork at turn 1's answer, continued differently, from the host store only
    with client(ours) as c:
        r = c.post(
            "/v1/kvbranch/sessions/swa/branches",
            json={"parent": "main", "branch_id": "alt", "messages": history[:3]},
        )
    assert r.status_code == 201, r.text
    alt = [*history[:3], {"role": "user", "content": "Instead, book a bus. Which one?"}]
    reset_device_cache(ours)
    forked = chat(ours, alt, session="swa", branch="alt", max_tokens=24)
    assert text_of(forked) == text_of(chat(plain, alt, max_tokens=24))
    assert forked["kvbranch"]["host_hit_tokens"] >= BLOCK


def test_hybrid_ssm_model_is_refused_by_pd_in_one_line(tmp_path):
    """P/D instances run with the hybrid KV cache manager off, which state layers need: the
    launcher refuses such a model there before vLLM loads anything (a single instance serves
    it with the host store off: test_model_families)."""
    source = ensure_model()
    model = tmp_path / "hybrid"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).symlink_to(source / name)
    # the tiny Granite 4.0 hybrid's config (Mamba 2 and attention layers); no weights needed
    config = tiny_models.full_config(tiny_models.family_of("mamba2"))
    (model / "config.json").write_text(json.dumps(config))
    run = subprocess.run(
        # random weights: nothing is computed, the launcher refuses first
        [sys.executable, "-m", "server", "--model", str(model), "--role", "prefill"]
        + [*SIZES[:4], "--", *DUMMY],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --model {model}: GraniteMoeHybridForCausalLM"), last
    for words in ("model_type granitemoehybrid", "hybrid attention/SSM", "--no-connector"):
        assert words in last, last
    assert "Traceback" not in run.stderr and "starting vLLM" not in run.stderr
