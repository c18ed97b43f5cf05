"""Which kvbranch session and branch a LangChain call continues: call kwargs, run metadata,
the model's own ids, and LangGraph's ``thread_id``/``checkpoint_id``.

LangGraph puts ``thread_id`` (and, after a time-travel fork, ``checkpoint_id``) in the run
metadata the chat model sees, so a graph gets per-thread sessions with no code change: the thread
is the session, and a call from a checkpoint goes to a branch of its own (``ckpt-<id>``),
forked on the server from the session's ``main`` at its first call. Plain LangChain only copies a
few ``configurable`` keys into the metadata; :func:`lift_config` copies ours too.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from langchain_core.runnables import RunnableConfig

from sdk import DEFAULT_BRANCH
from sdk.conversation import BranchRef, coerce_id

__all__ = ["SESSION_KEY", "BRANCH_KEY", "ModelIds", "lift_config", "resolve_ref"]

#: Run-metadata / ``configurable`` keys read for the session and branch of a call.
SESSION_KEY = "kvbranch_session_id"
BRANCH_KEY = "kvbranch_branch_id"
_LIFTED_KEYS = (SESSION_KEY, BRANCH_KEY, "thread_id", "checkpoint_id")


@dataclass(frozen=True)
class ModelIds:
    """The ids a model instance is bound to (its fields)."""

    session_id: str | None = None
    branch_id: str | None = None
    fork_parent: str | None = None
    use_langgraph_ids: bool = True


def lift_config(config: RunnableConfig | None) -> RunnableConfig | None:
    """Copy session-related ``configurable`` keys into ``metadata`` (LangGraph already does
    this for ``thread_id``/``checkpoint_id``), so the chat model sees them in
    ``run_manager.metadata``."""
    if not config or not config.get("configurable"):
        return config
    configurable = config["configurable"]
    extra = {
        k: configurable[k]
        for k in _LIFTED_KEYS
        if isinstance(configurable.get(k), (str, int)) and configurable.get(k) != ""
    }
    if not extra:
        return config
    metadata = dict(config.get("metadata") or {})
    for key, value in extra.items():
        metadata.setdefault(key, value)
    return {**config, "metadata": metadata}


def resolve_ref(
    model: ModelIds, kwargs: dict[str, Any], metadata: Mapping[str, Any] | None
) -> BranchRef:
    """The call's session, branch and lazy-fork parent (pops ``session_id``/``branch_id``
    from ``kwargs``). Precedence: call kwargs, run metadata ``kvbranch_*`` keys, the model's
    own ids, then LangGraph's thread/checkpoint ids."""
    metadata = metadata or {}
    session = kwargs.pop("session_id", None) or metadata.get(SESSION_KEY)
    branch = kwargs.pop("branch_id", None) or metadata.get(BRANCH_KEY)
    parent = model.fork_parent
    if session is None:
        session = model.session_id
    if session is None and model.use_langgraph_ids and metadata.get("thread_id"):
        session = metadata["thread_id"]
        if branch is None and model.branch_id is None and metadata.get("checkpoint_id"):
            # time travel: continue on a branch of that checkpoint, forked from main
            branch = coerce_id(metadata["checkpoint_id"], "ckpt-")
            parent = DEFAULT_BRANCH
    if branch is None:
        branch = model.branch_id
    session_id = coerce_id(session)
    if session_id is None:
        return BranchRef()
    branch_id = coerce_id(branch) if branch else None
    return BranchRef(
        session_id, branch_id, parent if branch_id and branch_id != DEFAULT_BRANCH else None
    )


def config_ref(model: ModelIds, config: RunnableConfig | None) -> BranchRef:
    """The session and branch (``main`` when unnamed) a config designates, for the explicit
    hooks (fork, pin, prefetch, ...)."""
    metadata = dict((lift_config(config) or {}).get("metadata") or {})
    ref = resolve_ref(model, {}, metadata)
    return BranchRef(ref.session_id, ref.branch if ref.session_id else None)
