"""Real agent conversations (for capacity through :mod:`benchmarks.traces.bfcl`), built from the
Berkeley Function Calling Leaderboard's multi-turn set, as the ``bfcl-eval`` package on PyPI
ships it.

Why this data set: it is the only public one found on the registry that has everything an agent
trace has — a large tools prompt (the JSON schemas of the APIs involved, 2-4k tokens), several
user turns per conversation, the ground-truth tool calls of each turn, and *executable* tool
backends (a file system, a Twitter-like API, a trading bot, travel booking, ...) shipped as
plain Python in the same wheel, so every tool output in the replay is the real output of the
real call on the conversation's own initial state, not a placeholder. (Other candidates on the
registry: single-turn function-calling sets, or harnesses that need a model hub at run time.)
License: Apache-2.0 (the bfcl-eval package).

The wheel is fetched once with ``pip download --no-deps`` (the ordinary client) into
``benchmarks/out/data/`` and read from there; nothing of it is installed into the venv. A
conversation is a list of *steps*: each step is the message list sent to the model at that
point (tools prompt, user turns, assistant tool calls, tool outputs); the model's own answers
are measured and compared between configurations, never fed back, so every configuration
replays the same prompts.

The tools go into the system prompt in the Hermes format (``<tools>`` with one JSON schema per
line; calls as ``<tool_call>`` JSON, outputs as ``tool`` messages), the format of the server's
``hermes`` tool parser: the embedded model's chat template renders neither ``tools`` nor
``tool_calls``, so passing them as fields would send a prompt without them.
"""

from __future__ import annotations

import ast
import copy
import importlib
import inspect
import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

PACKAGE = "bfcl-eval"
VERSION = "2026.3.23"
DATA_DIR = Path(__file__).resolve().parent / "out" / "data"
SUBSET = "BFCL_v4_multi_turn_base"
BACKENDS = "bfcl_eval.eval_checker.multi_turn_eval.func_source_code"
#: Classes of the multi-turn set and their modules (bfcl_eval/constants/executable_backend_config).
CLASS_MODULES = {
    "GorillaFileSystem": "gorilla_file_system",
    "MathAPI": "math_api",
    "MessageAPI": "message_api",
    "TwitterAPI": "posting_api",
    "TicketAPI": "ticket_api",
    "TradingBot": "trading_bot",
    "TravelAPI": "travel_booking",
    "VehicleControlAPI": "vehicle_control",
}
STATELESS = {"MathAPI"}
#: The assistant's text after a turn's tool outputs, in the replayed history (fixed, so that
#: all configurations send the same prompts).
AFTER_TOOLS = "Done."
#: BFCL's parameter types -> JSON Schema's.
TYPES = {"dict": "object", "float": "number", "tuple": "array", "any": "string"}


def ensure_wheel() -> Path:
    """The extracted wheel (downloaded and unpacked on first use)."""
    root = DATA_DIR / f"bfcl_eval-{VERSION}"
    if (root / "bfcl_eval" / "data" / f"{SUBSET}.json").is_file():
        return root
    DATA_DIR.mkdir(parents=True, exist_ok=True)
    name = f"bfcl_eval-{VERSION}-py3-none-any.whl"
    if not (DATA_DIR / name).is_file():
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(DATA_DIR)]
            + [f"{PACKAGE}=={VERSION}"],
            check=True,
        )
    with zipfile.ZipFile(DATA_DIR / name) as wheel:
        wheel.extractall(root)
    return root


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _schema(node: Any) -> Any:
    """A BFCL parameter schema as JSON Schema (its own type names; 'response' dropped)."""
    if isinstance(node, dict):
        out = {k: _schema(v) for k, v in node.items() if k != "response"}
        if isinstance(out.get("type"), str):
            out["type"] = TYPES.get(out["type"], out["type"])
        return out
    if isinstance(node, list):
        return [_schema(v) for v in node]
    return node


def tools_for(root: Path, classes: list[str], excluded: list[str]) -> list[dict]:
    docs = root / "bfcl_eval" / "data" / "multi_turn_func_doc"
    tools = []
    for cls in classes:
        for fn in _lines(docs / f"{CLASS_MODULES[cls]}.json"):
            if f"{cls}.{fn['name']}" in excluded or fn["name"] in excluded:
                continue
            tools.append(
                {
                    "type": "function",
                    "function": {
                        "name": fn["name"],
                        "description": fn["description"],
                        "parameters": _schema(fn["parameters"]),
                    },
                }
            )
    return tools


class Backends:
    """The conversation's tool backends on its initial state; :meth:`call` runs one call
    written as BFCL writes it (``mv(source='a', destination='b')``)."""

    def __init__(self, root: Path, classes: list[str], initial: dict) -> None:
        if str(root) not in sys.path:
            sys.path.insert(0, str(root))
        self.methods: dict[str, Any] = {}
        for cls in classes:
            module = importlib.import_module(f"{BACKENDS}.{CLASS_MODULES[cls]}")
            instance = getattr(module, cls)()
            if cls not in STATELESS:
                instance._load_scenario(copy.deepcopy(initial.get(cls, {})), long_context=False)
            for name, method in inspect.getmembers(instance, predicate=inspect.ismethod):
                if not name.startswith("_"):
                    self.methods[name] = method

    def call(self, text: str) -> tuple[str, dict, str]:
        """(function name, arguments, output as text)."""
        node = ast.parse(text.strip(), mode="eval").body
        assert isinstance(node, ast.Call) and isinstance(node.func, ast.Name), text
        name = node.func.id
        args = [ast.literal_eval(a) for a in node.args]
        kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
        method = self.methods[name]
        bound = inspect.signature(method).bind(*args, **kwargs)
        try:
            result = method(*bound.args, **bound.kwargs)
            output = result if isinstance(result, str) else json.dumps(result, default=str)
        except Exception as exc:  # noqa: BLE001 - the tool's error is its output, as in BFCL
            output = f"Error during execution: {exc}"
        return name, dict(bound.arguments), output


HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user "
    "query. Don't make assumptions about what values to plug into functions.\n<tools>\n"
    "{tools}\n</tools>\nFor each function call return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-dict>}}\n</tool_call>'
)


def system_message(tools: list[dict]) -> dict:
    lines = "\n".join(json.dumps(t["function"]) for t in tools)
    return {"role": "system", "content": HERMES_SYSTEM.format(tools=lines)}


def conversation(root: Path, entry: dict, answer: dict, max_turns: int) -> dict:
    """One conversation's steps: after each user turn, and after that turn's tool outputs."""
    classes = [c for c in entry["involved_classes"] if c in CLASS_MODULES]
    tools = tools_for(root, classes, entry.get("excluded_function", []))
    backends = Backends(root, classes, entry.get("initial_config", {}))
    messages: list[dict] = [system_message(tools)]
    steps: list[list[dict]] = []
    for turn, (user, calls) in enumerate(
        zip(entry["question"], answer["ground_truth"], strict=False)
    ):
        if turn >= max_turns:
            break
        messages += copy.deepcopy(user)
        steps.append(copy.deepcopy(messages))
        if not calls:
            messages.append({"role": "assistant", "content": AFTER_TOOLS})
            continue
        tool_calls, outputs = [], []
        for text in calls:
            name, arguments, output = backends.call(text)
            call = json.dumps({"name": name, "arguments": arguments}, default=str)
            tool_calls.append(f"<tool_call>\n{call}\n</tool_call>")
            outputs.append({"role": "tool", "content": output})
        messages.append({"role": "assistant", "content": "\n".join(tool_calls)})
        messages += outputs
        steps.append(copy.deepcopy(messages))
        messages.append({"role": "assistant", "content": AFTER_TOOLS})
    # The tools are in the system prompt; "tools" stays empty (see the module docstring).
    return {"id": entry["id"], "tools": [], "steps": steps}


def load(n: int, max_turns: int, skip: int = 0, max_chars: int = 0) -> list[dict]:
    """The first ``n`` conversations of the multi-turn set (after ``skip``) that have at least
    two turns, each cut to ``max_turns`` user turns; with ``max_chars``, only those whose last
    step serializes to at most that many characters (the smaller tools prompts: a benchmark
    that must fit a time budget on a CPU)."""
    root = ensure_wheel()
    data = root / "bfcl_eval" / "data"
    entries = _lines(data / f"{SUBSET}.json")
    answers = {a["id"]: a for a in _lines(data / "possible_answer" / f"{SUBSET}.json")}
    out: list[dict] = []
    for entry in entries[skip:]:
        if len(entry["question"]) < 2 or entry["id"] not in answers:
            continue
        conv = conversation(root, entry, answers[entry["id"]], max_turns)
        if max_chars and len(json.dumps(conv["steps"][-1])) > max_chars:
            continue
        out.append(conv)
        if len(out) == n:
            break
    return out
