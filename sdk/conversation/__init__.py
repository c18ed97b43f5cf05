"""Conversations a framework drives: the framework keeps the history, kvbranch keeps the ids,
the forks and the prefetches.

Agent frameworks (LangChain, LangGraph, LlamaIndex) own their chat history and hand a model the
whole of it on every call. :class:`~sdk.Session`/:class:`~sdk.Branch` are the other way round
(the sdk keeps the history and re-sends it). A :class:`Conversation` sits between the two: each
call sends the framework's messages as they are, and the conversation adds what only kvbranch
knows about:

* **ids** - which session and branch a call continues (a :class:`BranchRef`), sent only when
  the server has the kvbranch routes (a plain OpenAI-compatible server gets plain requests);
* **forks** - a new branch of a session, forked on the server where the framework's messages
  agree with its parent, at once when the session exists, else lazily at the branch's first
  call; a fork the server cannot render falls back to a fork without shared prefix (answers are
  the same either way, only cache sharing is lost);
* **prefetch** - after an answer that calls a tool, the branch is prefetched in the background
  (a thread for sync calls, a task for async ones), so the turn carrying the tool result starts
  warm; a failed prefetch is logged, never raised;
* the explicit hooks ``pin``/``unpin``/``prefetch``/``info``/``delete_session``.

Sessions come in two kinds. *Named* sessions are whatever the framework calls a conversation
(a LangGraph ``thread_id``, a per-call ``session_id``): requests name them and the server makes
them on first use. An *owned* session (``Conversation(..., session=SessionSettings(...))``) is
created by the conversation with its pin settings through :meth:`~sdk.KVBranchClient.session`,
and its branches are sdk :class:`~sdk.Branch`\\ es: forks at a message index, pins and
prefetches go through them, so a server that lost the session gets it restored. For that the
conversation remembers each owned branch's *last exchange* (the messages of its last call plus
the answer, i.e. what the server's branch caches): it is where ``fork(at_message=...)`` cuts and
what a lost branch is restored from; it is never sent as history.

Every operation is written once, as a generator of client calls that a sync driver runs on
:class:`~sdk.KVBranchClient` and an async driver on :class:`~sdk.AsyncKVBranchClient`
(:mod:`sdk.conversation._flow`).

Modules: ``_flow`` (ids, refs, the drivers), ``_clients`` (:class:`ClientSet`), ``_owned``
(owned sessions), ``_conversation`` (:class:`Conversation`).
"""

from sdk.conversation._clients import ClientSet
from sdk.conversation._conversation import Conversation
from sdk.conversation._flow import (
    BranchRef,
    SessionSettings,
    answer_message,
    arun_flow,
    coerce_id,
    run_flow,
)

__all__ = [
    "BranchRef",
    "ClientSet",
    "Conversation",
    "SessionSettings",
    "answer_message",
    "arun_flow",
    "coerce_id",
    "run_flow",
]
