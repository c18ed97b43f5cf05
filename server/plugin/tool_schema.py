"""Tool arguments checked by their JSON schema by default: every function tool of a request
that does not say ``strict`` is marked ``strict: true`` (called by the middleware's
:func:`server.plugin.middleware.rewrite_request`).

Why. vLLM 0.32 guides a tool call with an xgrammar structural tag, and how much of the call it
pins depends on each tool's ``strict`` (``vllm/tool_parsers/structural_tag_registry.py``):

* ``resolve_tool_strictness`` treats a tool without ``strict`` as non-strict ("its call
  envelope is still constrained, but its arguments stay free unless the server level is
  PARAMETER"), and with ``tool_choice="auto"`` and no strict tool builds no tag at all;
* ``get_function_parameters`` turns a non-strict tool's schema into ``True`` (any JSON), so
  even a forced call (``tool_choice="required"`` or a named tool: the hermes parser's
  ``supports_required_and_named`` is False, the structural tag replaces the old JSON-schema
  path) may carry ``"Paris"`` where ``{"city": "Paris"}`` is due.

Stock clients send no ``strict``: ``ChatOpenAI.bind_tools`` and LlamaIndex's
``to_openai_tool`` leave it out unless asked. Marking the tools here gives every client what a
``strict`` client gets: the arguments follow the schema (``tool_choice="auto"`` included: the
tag then lets the model write text or a call, and a call's arguments are constrained).

Why not vLLM's own ``--tool-strict-level parameter`` (``vllm/entrypoints/launchers/
cli_args.py``: "as if every tool were ``strict: true``"): it is a floor, so it also overrides a
tool the client marked ``strict: false`` (``_with_tool_strict(tool, strict_level >= PARAMETER
or _tool_is_strict(tool))``). Here an explicit ``strict`` — true or false — is the client's,
as in OpenAI's API: a schema the grammar cannot take, or free-form arguments on purpose, is
one ``strict: false`` away. (OpenAI's Responses API defaults ``strict`` to true as well.)

Shapes: Chat Completions ``{"type": "function", "function": {..., "strict"}}`` (also through
``/invocations``), Responses ``{"type": "function", "name", "parameters", "strict"}``,
Anthropic Messages ``{"name", "input_schema", "strict"}`` (vLLM copies its ``strict`` onto the
function it builds). Other tools (built-in, custom grammar, MCP) are left alone.
"""

from __future__ import annotations

from typing import Any

from sdk.contract import CHAT_COMPLETIONS_PATH, MESSAGES_PATH, RESPONSES_PATH

__all__ = ["STRICT_FIELD", "TOOL_PATHS", "default_strict_tools"]

#: The routes whose bodies carry tool definitions the model may call.
TOOL_PATHS = (CHAT_COMPLETIONS_PATH, RESPONSES_PATH, MESSAGES_PATH, "/invocations")
STRICT_FIELD = "strict"


def _strict_holder(tool: Any) -> dict[str, Any] | None:
    """The object of ``tool`` that carries its ``strict``; None for tools that are not
    schema-described functions."""
    if not isinstance(tool, dict):
        return None
    kind = tool.get("type")
    function = tool.get("function")
    if isinstance(function, dict) and kind in (None, "function"):
        return function  # Chat Completions
    if kind == "function" and isinstance(tool.get("name"), str):
        return tool  # Responses
    if isinstance(tool.get("input_schema"), dict) and kind in (None, "custom"):
        return tool  # Anthropic Messages
    return None


def default_strict_tools(payload: dict[str, Any], path: str) -> int:
    """Mark each function tool of ``payload`` ``strict: true`` unless it says ``strict``
    (``null`` counts as unsaid: vLLM reads it as non-strict). In place; how many it marked.
    Malformed ``tools`` are left for vLLM to refuse with its own message."""
    if path not in TOOL_PATHS:
        return 0
    tools = payload.get("tools")
    if not isinstance(tools, list):
        return 0
    marked = 0
    for tool in tools:
        holder = _strict_holder(tool)
        if holder is not None and holder.get(STRICT_FIELD) is None:
            holder[STRICT_FIELD] = True
            marked += 1
    return marked
