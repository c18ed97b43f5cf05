"""LangChain integration: :class:`ChatKVBranch`, a session- and branch-aware chat model on
top of :mod:`sdk.conversation`.

Modules: :mod:`~integrations.langchain.chat_models` (the ``BaseChatModel``),
:mod:`~integrations.langchain.messages` (message and output conversion),
:mod:`~integrations.langchain.langgraph` (run config / LangGraph thread and checkpoint ids ->
kvbranch session and branch), :mod:`~integrations.langchain.structured` (tools and structured
output)."""

from integrations.langchain.chat_models import BRANCH_KEY, SESSION_KEY, ChatKVBranch

__all__ = ["ChatKVBranch", "SESSION_KEY", "BRANCH_KEY"]
