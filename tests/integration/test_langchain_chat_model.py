"""ChatKVBranch against the real kvbranch server: LangChain's standard integration suite, plus
the kvbranch specifics the suite does not cover (cache split, fork, tool-call plumbing and
prefetch). One server for the whole pytest session (the shared ``kvbranch_server`` fixture).

Tool calling runs with the suite's own flags on (``has_tool_calling``/``has_tool_choice``):
the server marks every tool a client did not mark ``strict: false`` as ``strict``
(:mod:`server.plugin.tool_schema`), so vLLM constrains a call's arguments by the tool's JSON
schema even though ``ChatKVBranch.bind_tools`` sends no ``strict`` by default. (Before, a forced
call of the bundled SmolLM2-135M often carried a bare JSON string, ``"Paris"``, instead of an
object, and the flags were off.) Structured output uses ``method="json_schema"``, which the
server enforces by guided decoding.
"""

from __future__ import annotations

import pytest
from langchain_core.messages import AIMessage, HumanMessage
from langchain_tests.integration_tests import ChatModelIntegrationTests

from integrations.langchain import ChatKVBranch
from tests.integration.helpers import reset_device_cache

MAX_TOKENS = 48  # enough to close a small JSON object; keeps generations short
#: A tool call's budget (what ``bind_tools`` binds, as the examples do): the grammar lets the
#: model put whitespace between JSON tokens, and the 135M model does, so 48 tokens cut the
#: calls of the suite's tools short (measured: 160 closes them all but the no-argument one).
TOOL_MAX_TOKENS = 160

# langchain-tests 1.1.9 does not mark its async tests; pyproject sets asyncio_mode = "auto".


class SuiteChatKVBranch(ChatKVBranch):
    """ChatKVBranch whose ``bind_tools`` binds :data:`TOOL_MAX_TOKENS` unless told."""

    def bind_tools(self, tools, **kwargs):  # type: ignore[no-untyped-def, override]
        kwargs.setdefault("max_tokens", TOOL_MAX_TOKENS)
        return super().bind_tools(tools, **kwargs)


class TestChatKVBranchStandardIntegration(ChatModelIntegrationTests):
    @pytest.fixture(autouse=True)
    def _server(self, kvbranch_server):
        self._kvb = kvbranch_server

    @property
    def chat_model_class(self) -> type[ChatKVBranch]:
        return SuiteChatKVBranch

    @property
    def chat_model_params(self) -> dict:
        server = self._kvb
        return {
            "model": server.model,
            "base_url": server.url,
            "api_key": server.api_key,
            "temperature": 0,
            "max_tokens": MAX_TOKENS,
            "timeout": 300,
            "auto_session": True,
        }

    @property
    def has_tool_calling(self) -> bool:
        return True  # arguments constrained by the schema (see above)

    @property
    def has_tool_choice(self) -> bool:
        return True

    # Strict, and only on the suite's own assertion: a pass (the model learned it) must be
    # noticed, and a server error (a 500 raises the sdk's error, not AssertionError) must fail.
    @pytest.mark.xfail(
        reason="SmolLM2-135M fills the empty arguments object with whitespace, which the "
        "structural tag allows (vLLM's hermes tag sets no max_whitespace_cnt), until max_tokens "
        "cuts the call off",
        strict=True,
        raises=AssertionError,
    )
    def test_tool_calling_with_no_arguments(self, model) -> None:  # type: ignore[no-untyped-def]
        super().test_tool_calling_with_no_arguments(model)

    @pytest.mark.xfail(
        reason="tool_choice='auto': SmolLM2-135M's chat template does not show it the tools, and "
        "it answers in prose; the schema is enforced only once a call begins",
        strict=True,
        raises=AssertionError,
    )
    @pytest.mark.parametrize("model", [{}, {"output_version": "v1"}], indirect=True)
    def test_agent_loop(self, model) -> None:  # type: ignore[no-untyped-def]
        super().test_agent_loop(model)

    @property
    def has_structured_output(self) -> bool:
        return True

    @property
    def structured_output_kwargs(self) -> dict:
        return {"method": "json_schema"}

    @property
    def supported_usage_metadata_details(self) -> dict:
        return {"invoke": ["cache_read_input"], "stream": ["cache_read_input"]}

    def invoke_with_cache_read_input(self, *, stream: bool = False) -> AIMessage:
        llm = ChatKVBranch(**self.chat_model_params)
        prompt = [
            HumanMessage(
                "Read this and answer with one word. " + "The quick brown fox "
                "jumps over the lazy dog near the river bank. " * 20
            )
        ]
        llm.invoke(prompt, max_tokens=1)
        if stream:
            full = None
            for chunk in llm.stream(prompt, max_tokens=1):
                full = chunk if full is None else full + chunk
            return full  # type: ignore[return-value]
        return llm.invoke(prompt, max_tokens=1)


SYSTEM = (
    "You are a travel planner. Answer in one short sentence. The traveller likes "
    "museums, trains, small hotels and local food, and dislikes flying. "
) * 6


def make(server, **kwargs) -> ChatKVBranch:
    kwargs = {"temperature": 0, "max_tokens": 12, "timeout": 300, **kwargs}
    return ChatKVBranch(model=server.model, base_url=server.url, api_key=server.api_key, **kwargs)


def test_session_turns_hit_the_cache_and_forks_share_it(kvbranch_server):
    llm = make(kvbranch_server)
    config = {"configurable": {"thread_id": "lc-it-thread"}}
    history = [("system", SYSTEM), ("human", "Plan day one in Paris.")]
    first = llm.invoke(history, config=config)
    meta = first.response_metadata
    assert meta["session_id"] == "lc-it-thread" and meta["branch_id"] == "main"
    split = meta["kvbranch"]
    assert split["prompt_tokens"] == first.usage_metadata["input_tokens"]
    history += [first, ("human", "And day two?")]
    # vLLM's own prefix cache would read the history too: gone, only the host store has it
    reset_device_cache(kvbranch_server)
    second = llm.invoke(history, config=config)
    assert second.usage_metadata["input_token_details"]["cache_read"] >= 128
    assert second.response_metadata["kvbranch"]["host_hit_tokens"] >= 128
    alt = llm.fork("plan-b", config=config)
    info = alt.branch_info()
    assert info.parent == "main" and info.fork_offset_tokens > 0
    reset_device_cache(kvbranch_server)
    chunks = list(alt.stream(history[:3] + [("human", "Day two, by train?")]))
    last = [c for c in chunks if c.response_metadata.get("kvbranch")][-1]
    assert last.response_metadata["branch_id"] == "plan-b"
    assert last.usage_metadata["input_token_details"]["cache_read"] >= 128
    assert last.response_metadata["kvbranch"]["host_hit_tokens"] >= 128


def test_tool_call_plumbing(kvbranch_server):
    """A forced tool call comes back as a tool call whose arguments follow the schema (the
    server marks the tool strict), streamed as tool_call_chunks, and the branch is prefetched."""

    def get_weather(city: str) -> str:
        """Get the weather for a city."""
        return "sunny"

    llm = make(kvbranch_server, session_id="lc-it-tools", max_tokens=128)
    before = llm.client.stats()
    bound = llm.bind_tools([get_weather], tool_choice="get_weather")
    msg = bound.invoke("What is the weather in Paris?")
    assert not msg.invalid_tool_calls
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    assert isinstance(msg.tool_calls[0]["args"].get("city"), str)
    chunks = list(bound.stream("What is the weather in Paris?"))
    assert any(c.tool_call_chunks for c in chunks)
    llm.conversation.wait_prefetches()
    stats = llm.client.stats()
    # each answer's tool call prefetched the branch (skipped: still device-resident)
    done = stats.prefetches + stats.prefetches_skipped
    assert done - (before.prefetches + before.prefetches_skipped) >= 1
