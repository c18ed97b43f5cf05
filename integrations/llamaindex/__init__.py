"""kvbranch for LlamaIndex: :class:`KVBranchLLM`, a ``FunctionCallingLLM`` whose conversations
keep their KV cache on a kvbranch server (a session per instance, branches via ``fork()``,
background prefetch on tool calls). Needs ``llama-index-core`` (the ``llamaindex`` extra)."""

from integrations.llamaindex._convert import resolve_tool_choice, tool_kwargs
from integrations.llamaindex.llm import KVBranchLLM

__all__ = ["KVBranchLLM", "resolve_tool_choice", "tool_kwargs"]
