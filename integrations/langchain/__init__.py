"""LangChain integration: :class:`ChatKVBranch`, a session- and branch-aware chat model on
top of :mod:`sdk` (see :mod:`integrations.langchain.chat_models`)."""

from integrations.langchain.chat_models import BRANCH_KEY, SESSION_KEY, ChatKVBranch

__all__ = ["ChatKVBranch", "SESSION_KEY", "BRANCH_KEY"]
