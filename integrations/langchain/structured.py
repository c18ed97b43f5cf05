"""Tool binding and structured output for :class:`~integrations.langchain.ChatKVBranch`: how
LangChain's spellings become OpenAI request parameters, and which parser reads the answer."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from operator import itemgetter
from typing import Any, Literal

from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.messages import AIMessage
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.base import OutputParserLike
from langchain_core.output_parsers.openai_tools import (
    JsonOutputKeyToolsParser,
    PydanticToolsParser,
)
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass

__all__ = ["ToolLike", "openai_tool_choice", "bind_tools_to", "structured_runnable"]

ToolLike = dict[str, Any] | type | Callable[..., Any] | BaseTool
Method = Literal["json_schema", "function_calling", "json_mode"]


def openai_tool_choice(choice: Any, tools: Sequence[dict[str, Any]]) -> Any:
    """LangChain's tool_choice spellings -> OpenAI's."""
    if choice is None or isinstance(choice, dict):
        return choice
    if choice is True or choice == "any":
        return "required"
    if choice is False:
        return "none"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, str):
        names = [t["function"]["name"] for t in tools]
        if names and choice not in names:
            raise ValueError(f"tool_choice {choice!r} is not one of the bound tools {names}")
        return {"type": "function", "function": {"name": choice}}
    raise ValueError(f"unsupported tool_choice {choice!r}")


def bind_tools_to(
    model: BaseChatModel,
    tools: Sequence[ToolLike],
    *,
    choice: Any,
    strict: bool | None,
    parallel_tool_calls: bool | None,
    **kwargs: Any,
) -> Runnable[LanguageModelInput, AIMessage]:
    """``model`` bound to OpenAI tool schemas (``choice`` checked now, not at the first call)."""
    formatted = [convert_to_openai_tool(t, strict=strict) for t in tools]
    if choice is not None:
        openai_tool_choice(choice, formatted)
        kwargs["tool_choice"] = choice
    if parallel_tool_calls is not None:
        kwargs["parallel_tool_calls"] = parallel_tool_calls
    return model.bind(tools=formatted, **kwargs)


def _json_schema_format(schema: Any, strict: bool | None) -> dict[str, Any]:
    function = convert_to_openai_tool(schema, strict=strict)["function"]
    json_schema: dict[str, Any] = {
        "name": function["name"],
        "schema": function.get("parameters") or {},
    }
    if function.get("description"):
        json_schema["description"] = function["description"]
    if strict is not None:
        json_schema["strict"] = strict
    return {"type": "json_schema", "json_schema": json_schema}


def structured_runnable(
    model: BaseChatModel,
    schema: dict[str, Any] | type | None,
    *,
    method: Method,
    include_raw: bool,
    strict: bool | None,
) -> Runnable[LanguageModelInput, Any]:
    """``json_schema`` has the server constrain the answer to the schema (guided decoding);
    ``function_calling`` forces a call of a tool with that schema; ``json_mode`` asks for any
    JSON object."""
    if schema is None and method != "json_mode":
        raise ValueError(f"schema is required for method={method!r}")
    is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    ls_format = {"kwargs": {"method": method, "strict": strict}, "schema": schema}
    parser: OutputParserLike[Any]
    if method == "function_calling":
        assert schema is not None
        tool_name = convert_to_openai_tool(schema)["function"]["name"]
        llm = bind_tools_to(
            model,
            [schema],
            choice=tool_name,
            strict=strict,
            parallel_tool_calls=None,
            ls_structured_output_format=ls_format,
        )
        parser = (
            PydanticToolsParser(tools=[schema], first_tool_only=True)  # type: ignore[list-item]
            if is_pydantic
            else JsonOutputKeyToolsParser(key_name=tool_name, first_tool_only=True)
        )
    elif method in ("json_schema", "json_mode"):
        response_format = (
            _json_schema_format(schema, strict)
            if method == "json_schema"
            else {"type": "json_object"}
        )
        llm = model.bind(response_format=response_format, ls_structured_output_format=ls_format)
        parser = (
            PydanticOutputParser(pydantic_object=schema)  # type: ignore[arg-type]
            if is_pydantic
            else JsonOutputParser()
        )
    else:
        raise ValueError(
            f"method must be 'json_schema', 'function_calling' or 'json_mode', got {method!r}"
        )
    if not include_raw:
        return llm | parser
    parser_with_fallback = RunnablePassthrough.assign(
        parsed=itemgetter("raw") | parser, parsing_error=lambda _: None
    ).with_fallbacks(
        [RunnablePassthrough.assign(parsed=lambda _: None)], exception_key="parsing_error"
    )
    return RunnableMap(raw=llm) | parser_with_fallback
