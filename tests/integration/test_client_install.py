"""The client alone, as an agent app installs it: ``pip install "<clone>[langchain]"`` into a
clean virtual environment (no vLLM, no torch), then a LangChain ``ChatKVBranch`` and the sdk in
that environment talk to the real server this test session started — the answer is the plain
vLLM server's, token for token. LangGraph is its own extra: the LangChain integration works
without it. Keeps the README's "Install the client alone" true."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.integration.fresh_install import install
from tests.integration.helpers import chat, text_of

SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys
    from integrations.langchain import ChatKVBranch
    from sdk import KVBranchClient

    url, model, prompt = sys.argv[1:4]
    heavy = [m for m in ("vllm", "torch", "langgraph") if importlib.util.find_spec(m) is not None]
    llm = ChatKVBranch(model=model, base_url=url + "/v1", temperature=0, max_tokens=12)
    reply = llm.invoke(prompt, config={"configurable": {"thread_id": "client-only-1"}})
    with KVBranchClient(url) as client:
        info = client.get_session("client-only-1")
    print(json.dumps({
        "heavy": heavy,
        "text": reply.content,
        "cache_split": reply.response_metadata.get("kvbranch"),
        "branches": [b.branch_id for b in info.branches],
    }))
    """
)


@pytest.fixture(scope="module")
def client_venv(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("client-venv"), "langchain", timeout_s=900)


def test_the_client_alone_talks_to_the_server(client_venv, kvbranch_server, plain_server):
    prompt = "Name three colors."
    done = subprocess.run(
        [str(client_venv), "-c", SCRIPT, kvbranch_server.url, kvbranch_server.model, prompt],
        capture_output=True,
        text=True,
        timeout=300,
        cwd="/",  # not the clone: only what pip installed can be imported
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["heavy"] == []  # no vLLM, no torch, no LangGraph in the client's environment
    expected = text_of(chat(plain_server, [{"role": "user", "content": prompt}], max_tokens=12))
    assert out["text"] == expected
    assert out["cache_split"]["prompt_tokens"] > 0
    assert "main" in out["branches"]
    assert sys.executable != str(client_venv)
