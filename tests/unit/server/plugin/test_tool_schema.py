"""Function tools are marked ``strict`` unless the client said (server.plugin.tool_schema), and
what that buys in vLLM 0.32: the structural tag pins the arguments to the tool's schema."""

from __future__ import annotations

import copy
import json

import pytest

from sdk.contract import CHAT_COMPLETIONS_PATH, COMPLETIONS_PATH, MESSAGES_PATH, RESPONSES_PATH
from server.plugin.middleware import rewrite_request
from server.plugin.tool_schema import TOOL_PATHS, default_strict_tools

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


def chat_tool(**function) -> dict:
    return {
        "type": "function",
        "function": {"name": "get_weather", "parameters": PARAMS, **function},
    }


def chat_body(*tools, tool_choice=None) -> dict:
    body = {"model": "m", "messages": [{"role": "user", "content": "Paris?"}], "tools": list(tools)}
    if tool_choice is not None:
        body["tool_choice"] = tool_choice
    return body


# --- which tools are marked -------------------------------------------------------------------
def test_chat_tool_without_strict_is_marked():
    body = chat_body(chat_tool())
    assert default_strict_tools(body, CHAT_COMPLETIONS_PATH) == 1
    assert body["tools"][0]["function"]["strict"] is True


@pytest.mark.parametrize("said", [True, False])
def test_the_clients_own_strict_wins(said):
    body = chat_body(chat_tool(strict=said))
    assert default_strict_tools(body, CHAT_COMPLETIONS_PATH) == 0
    assert body["tools"][0]["function"]["strict"] is said


def test_null_strict_counts_as_unsaid():
    body = chat_body(chat_tool(strict=None))
    default_strict_tools(body, CHAT_COMPLETIONS_PATH)
    assert body["tools"][0]["function"]["strict"] is True


def test_each_tool_on_its_own():
    body = chat_body(chat_tool(), chat_tool(name="free", strict=False), chat_tool(name="other"))
    assert default_strict_tools(body, CHAT_COMPLETIONS_PATH) == 2
    assert [t["function"]["strict"] for t in body["tools"]] == [True, False, True]


def test_responses_function_tools_are_marked_others_left_alone():
    body = {
        "input": "Paris?",
        "tools": [
            {"type": "function", "name": "get_weather", "parameters": PARAMS},
            {"type": "function", "name": "free", "parameters": PARAMS, "strict": False},
            {"type": "web_search_preview"},
            {"type": "custom", "name": "grammar_tool", "format": {"type": "text"}},
            {"type": "mcp", "server_label": "x", "server_url": "http://x"},
        ],
    }
    before = copy.deepcopy(body["tools"][2:])
    assert default_strict_tools(body, RESPONSES_PATH) == 1
    assert body["tools"][0]["strict"] is True and body["tools"][1]["strict"] is False
    assert body["tools"][2:] == before


def test_anthropic_tools_are_marked_server_tools_left_alone():
    body = {
        "messages": [{"role": "user", "content": "Paris?"}],
        "tools": [
            {"name": "get_weather", "input_schema": PARAMS},
            {"type": "custom", "name": "lookup", "input_schema": PARAMS},
            {"type": "bash_20250124", "name": "bash"},
        ],
    }
    assert default_strict_tools(body, MESSAGES_PATH) == 2
    assert body["tools"][0]["strict"] is True and body["tools"][1]["strict"] is True
    assert "strict" not in body["tools"][2]


def test_invocations_carry_chat_tools():
    assert "/invocations" in TOOL_PATHS
    body = chat_body(chat_tool())
    assert default_strict_tools(body, "/invocations") == 1


@pytest.mark.parametrize("path", [COMPLETIONS_PATH, "/inference/v1/generate", "/v1/systemone"])
def test_routes_without_tools_are_untouched(path):
    body = chat_body(chat_tool())
    assert default_strict_tools(body, path) == 0
    assert "strict" not in body["tools"][0]["function"]


@pytest.mark.parametrize(
    "tools",
    [None, "x", {"type": "function"}, [1, "x", None, ["a"]], [{"type": "function"}], [{}]],
)
def test_malformed_tools_are_left_for_vllm(tools):
    body = {"tools": copy.deepcopy(tools)}
    assert default_strict_tools(body, CHAT_COMPLETIONS_PATH) == 0
    assert body["tools"] == tools


def test_no_tools_no_change():
    body = {"model": "m", "messages": []}
    assert default_strict_tools(body, CHAT_COMPLETIONS_PATH) == 0
    assert body == {"model": "m", "messages": []}


def test_rewrite_request_marks_tools():
    out = rewrite_request(chat_body(chat_tool()), tag="t", branch_header=None, owner=None)
    assert out["tools"][0]["function"]["strict"] is True
    free = rewrite_request(
        chat_body(chat_tool(strict=False)), tag="t", branch_header=None, owner="tenant"
    )
    assert free["tools"][0]["function"]["strict"] is False


# --- what vLLM 0.32 makes of it -----------------------------------------------------------------
def _tag_schema(body: dict):
    """The JSON schema vLLM's hermes structural tag puts on the call's arguments; None when
    vLLM builds no tag at all."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers.structural_tag_registry import get_model_structural_tag

    request = ChatCompletionRequest.model_validate(body)
    tag = get_model_structural_tag("hermes", request.tools, request.tool_choice, reasoning=False)
    if tag is None:
        return None
    dumped = json.dumps(tag.model_dump())
    schemas = [
        t["content"]["json_schema"]
        for t in json.loads(dumped)["format"]["tags"]
        if t.get("content", {}).get("type") == "json_schema"
    ]
    assert schemas
    return schemas[0]


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_vllm_pins_arguments_of_a_forced_call_only_when_strict(choice):
    unmarked = chat_body(chat_tool(), tool_choice=choice)
    assert _tag_schema(unmarked) is True  # any JSON: "Paris" passes
    marked = rewrite_request(
        chat_body(chat_tool(), tool_choice=choice), tag="t", branch_header=None, owner=None
    )
    assert _tag_schema(marked) == PARAMS


def test_vllm_guides_auto_calls_only_when_strict():
    assert _tag_schema(chat_body(chat_tool(), tool_choice="auto")) is None  # free text
    marked = rewrite_request(
        chat_body(chat_tool(), tool_choice="auto"), tag="t", branch_header=None, owner=None
    )
    assert _tag_schema(marked) == PARAMS


def test_vllm_keeps_an_explicit_strict_false_free():
    body = rewrite_request(
        chat_body(chat_tool(strict=False), tool_choice="required"),
        tag="t",
        branch_header=None,
        owner=None,
    )
    assert _tag_schema(body) is True
