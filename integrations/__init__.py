"""kvbranch integrations (LangChain, LlamaIndex) on top of sdk/."""
