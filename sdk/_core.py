"""The sdk's one non-I/O core: configuration, request building, response parsing, and every
multi-step flow (model discovery, the kvbranch probe, chat), written once for both clients.

Why flows are generators: the sync and async clients differ only in how they send a request
and wait for its answer. So each operation is written once as a generator that *yields* the
:class:`Request`\\ s it needs and is *sent* their decoded JSON bodies (or has the request's
:class:`~sdk.errors.KVBranchError` thrown into it), and finally returns its result. The sync
client runs a flow with :meth:`KVBranchClient._run`, the async one with
:meth:`AsyncKVBranchClient._arun`; neither knows what the flow does. This is how httpx writes
its ``auth_flow``\\ s once for ``Client`` and ``AsyncClient``; sessions (``sdk._session_core``)
compose these flows with ``yield from`` for recovery and fork fallback.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from typing_extensions import Self, Unpack

from sdk import contract
from sdk._common import (
    CHAT_PATH,
    MODELS_PATH,
    ChatArgs,
    ForkArgs,
    chat_payload,
    check_keywords,
    make_timeout,
    resolve_api_key,
    resolve_base_url,
    user_agent,
)
from sdk.errors import APIResponseError, KVBranchError, NotFoundError, error_from_response
from sdk.retry import RetryPolicy
from sdk.types import ChatResult

__all__ = [
    "Request",
    "Flow",
    "ClientCore",
    "Flows",
    "Outcome",
    "Done",
    "advance",
    "parse_model",
    "copy_docs",
    "Callback",
    "Closing",
    "AsyncClosing",
]

logger = logging.getLogger("kvbranch.sdk")
T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

UNAVAILABLE_WARNING = (
    "kvbranch: {url} has no kvbranch routes (a plain OpenAI-compatible "
    "server); sessions, branches, pins and prefetch run client-side only "
    "(full history re-sent each turn, no server cache management)"
)


@dataclass(frozen=True)
class Request:
    """One HTTP request a flow needs; the client sends it (with retries) and sends back the
    decoded JSON body (``None`` for an empty body)."""

    method: str
    path: str
    body: Any = None
    headers: Mapping[str, str] | None = None


Flow = Generator[Request, Any, T]
"""An operation written once: yields requests, receives their JSON, returns a ``T``."""


@dataclass(frozen=True)
class Outcome:
    """What the last request of a flow gave: its JSON, or the error to throw into the flow."""

    value: Any = None
    error: KVBranchError | None = None


@dataclass(frozen=True)
class Done:
    value: Any


def advance(flow: Flow[Any], outcome: Outcome) -> Request | Done:
    """Resume ``flow`` with ``outcome``: the next request to send, or :class:`Done`."""
    try:
        if outcome.error is not None:
            return flow.throw(outcome.error)
        return flow.send(outcome.value)
    except StopIteration as stop:
        return Done(stop.value)


def parse_model(model: type[M], data: Any) -> M:
    """``data`` validated as the contract model ``model``; drift is an
    :class:`~sdk.errors.APIResponseError`, never a silently wrong value."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise APIResponseError(f"unexpected {model.__name__} from the server: {exc}") from exc


def model_ids(data: Any) -> list[str]:
    """Ids of a ``/v1/models`` response."""
    try:
        return [m["id"] for m in data["data"]]
    except (TypeError, KeyError) as exc:
        raise APIResponseError(f"unexpected /v1/models response: {data!r:.200}") from exc


def max_model_len_of(data: Any, model: str | None) -> int | None:
    """``max_model_len`` of ``model`` (else of the first model) in a ``/v1/models`` response;
    ``None`` when the model is not listed or the server does not report it (vLLM does)."""
    try:
        entries = [m for m in data["data"] if isinstance(m, dict)]
    except (TypeError, KeyError) as exc:
        raise APIResponseError(f"unexpected /v1/models response: {data!r:.200}") from exc
    entry = next((m for m in entries if model is None or m.get("id") == model), None)
    value = entry.get("max_model_len") if entry is not None else None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        return None
    return value


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(exclude_none=True)


def _sid(session_id: str) -> str:
    return contract.check_id(session_id, "session_id")


def _bid(branch_id: str) -> str:
    return contract.check_id(branch_id, "branch_id")


class ClientCore:
    """Configuration and state shared by the sync and async clients, and the I/O-free halves
    of sending: the headers every request carries, and reading a response into JSON."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        api_key: str | None = None,
        model: str | None = None,
        timeout: float | httpx.Timeout | None = 600.0,
        retry: RetryPolicy | None = None,
        default_headers: Mapping[str, str] | None = None,
        kvbranch: bool | None = None,
        transport: httpx.BaseTransport | httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = resolve_base_url(base_url)
        self.api_key = resolve_api_key(api_key)
        self.model = model
        self.timeout = make_timeout(timeout)
        self.retry = retry or RetryPolicy()
        self._headers = {"User-Agent": user_agent(), "Accept": "application/json"}
        if self.api_key:
            self._headers["Authorization"] = f"Bearer {self.api_key}"
        self._headers.update(default_headers or {})
        self._kvbranch = kvbranch
        self._health: contract.HealthInfo | None = None
        self._warned = False
        self._flows = Flows(self)
        self._connect(transport)

    def _connect(self, transport: Any) -> None:
        """Open the driver's httpx client (``self._http``) over ``transport``."""
        raise NotImplementedError

    def _mark_unavailable(self) -> None:
        """Remember that the server has no kvbranch routes (one warning)."""
        self._kvbranch = False
        if not self._warned:
            self._warned = True
            message = UNAVAILABLE_WARNING.format(url=self.base_url)
            logger.info(message)
            warnings.warn(message, RuntimeWarning, stacklevel=4)

    def _url(self, path: str) -> str:
        return f"{self.base_url}{path}"

    @staticmethod
    def _read(request: Request, response: httpx.Response) -> Any:
        """The JSON of a read response; its typed error for an error status."""
        if response.status_code >= 400:
            raise error_from_response(response)
        if not response.content:
            return None
        try:
            return response.json()
        except ValueError as exc:
            raise APIResponseError(
                f"{request.method} {request.path}: response is not JSON: {response.text[:200]!r}"
            ) from exc


class Flows:
    """Every client operation as a :data:`Flow` (see the module docs); the clients' public
    methods run these, one line each."""

    def __init__(self, core: ClientCore) -> None:
        self.core = core

    # --- discovery ------------------------------------------------------------------------
    def health(self) -> Flow[contract.HealthInfo]:
        self.core._health = parse_model(
            contract.HealthInfo, (yield Request("GET", contract.HEALTH_PATH))
        )
        return self.core._health

    def kvbranch_available(self) -> Flow[bool]:
        if self.core._kvbranch is None:
            try:
                yield from self.health()
                self.core._kvbranch = True
            except NotFoundError:
                self.core._mark_unavailable()
        return bool(self.core._kvbranch)

    def models(self) -> Flow[list[str]]:
        return model_ids((yield Request("GET", MODELS_PATH)))

    def max_model_len(self, model: str | None) -> Flow[int | None]:
        return max_model_len_of((yield Request("GET", MODELS_PATH)), model or self.core.model)

    def resolve_model(self, model: str | None) -> Flow[str]:
        if model:
            return model
        if not self.core.model:
            ids = yield from self.models()
            if not ids:
                raise APIResponseError("the server lists no models; pass model=")
            self.core.model = ids[0]
        return self.core.model

    # --- chat -----------------------------------------------------------------------------
    def chat_request(
        self, messages: Sequence[Mapping[str, Any]], *, stream: bool, **args: Unpack[ChatArgs]
    ) -> Flow[Request]:
        """The chat completion request (body checked, model resolved), not sent."""
        model = yield from self.resolve_model(args.get("model"))
        body = chat_payload(messages, args, model=model, stream=stream)
        return Request("POST", CHAT_PATH, body, args.get("extra_headers"))

    def chat(
        self, messages: Sequence[Mapping[str, Any]], **args: Unpack[ChatArgs]
    ) -> Flow[ChatResult]:
        request = yield from self.chat_request(messages, stream=False, **args)
        start = time.perf_counter()
        data = yield request
        return ChatResult.from_openai(data, latency_s=time.perf_counter() - start)

    # --- sessions and branches ------------------------------------------------------------
    def _model(
        self, model: type[M], method: str, path: str, body: BaseModel | None = None
    ) -> Flow[M]:
        data = yield Request(method, path, None if body is None else _dump(body))
        return parse_model(model, data)

    def create_session(
        self,
        session_id: str | None = None,
        *,
        auto_pin: bool = True,
        pin_ttl_s: float | None = None,
    ) -> Flow[contract.SessionInfo]:
        body = contract.CreateSessionRequest(
            session_id=session_id, auto_pin=auto_pin, pin_ttl_s=pin_ttl_s
        )
        return (yield from self._model(contract.SessionInfo, "POST", contract.SESSIONS_PATH, body))

    def get_session(self, session_id: str) -> Flow[contract.SessionInfo]:
        path = contract.session_path(_sid(session_id))
        return (yield from self._model(contract.SessionInfo, "GET", path))

    def delete_session(self, session_id: str) -> Flow[contract.DeleteResult]:
        path = contract.session_path(_sid(session_id))
        return (yield from self._model(contract.DeleteResult, "DELETE", path))

    def list_branches(self, session_id: str) -> Flow[list[contract.BranchInfo]]:
        data = yield Request("GET", contract.branches_path(_sid(session_id)))
        if not isinstance(data, list):
            raise APIResponseError(f"expected a list of branches, got {data!r:.200}")
        return [parse_model(contract.BranchInfo, b) for b in data]

    def get_branch(self, session_id: str, branch_id: str) -> Flow[contract.BranchInfo]:
        path = contract.branch_path(_sid(session_id), _bid(branch_id))
        return (yield from self._model(contract.BranchInfo, "GET", path))

    def fork_branch(self, session_id: str, **fork: Unpack[ForkArgs]) -> Flow[contract.BranchInfo]:
        check_keywords(fork, ForkArgs, "fork_branch")
        messages = fork.get("messages")
        body = contract.ForkRequest(
            parent=fork.get("parent", contract.DEFAULT_BRANCH),
            branch_id=fork.get("branch_id"),
            token_offset=fork.get("token_offset"),
            messages=None if messages is None else [dict(m) for m in messages],
        )
        path = contract.branches_path(_sid(session_id))
        return (yield from self._model(contract.BranchInfo, "POST", path, body))

    def delete_branch(self, session_id: str, branch_id: str) -> Flow[contract.DeleteResult]:
        path = contract.branch_path(_sid(session_id), _bid(branch_id))
        return (yield from self._model(contract.DeleteResult, "DELETE", path))

    def pin_branch(
        self, session_id: str, branch_id: str, ttl_s: float
    ) -> Flow[contract.BranchInfo]:
        body = contract.PinRequest(ttl_s=ttl_s)
        path = contract.pin_path(_sid(session_id), _bid(branch_id))
        return (yield from self._model(contract.BranchInfo, "POST", path, body))

    def unpin_branch(self, session_id: str, branch_id: str) -> Flow[contract.BranchInfo]:
        path = contract.pin_path(_sid(session_id), _bid(branch_id))
        return (yield from self._model(contract.BranchInfo, "DELETE", path))

    def prefetch_branch(
        self, session_id: str, branch_id: str, to_device: bool = False
    ) -> Flow[contract.PrefetchResult]:
        body = contract.PrefetchRequest(to_device=to_device)
        path = contract.prefetch_path(_sid(session_id), _bid(branch_id))
        return (yield from self._model(contract.PrefetchResult, "POST", path, body))

    def stats(self) -> Flow[contract.Stats]:
        return (yield from self._model(contract.Stats, "GET", contract.STATS_PATH))


def copy_docs(target: type, source: type) -> None:
    """Give ``target``'s undocumented public methods the docstrings of ``source``'s methods
    of the same name (the async classes document themselves by their sync twins)."""
    for name, member in vars(target).items():
        twin = getattr(source, name, None)
        if (
            not name.startswith("_")
            and callable(member)
            and member.__doc__ is None
            and twin is not None
            and twin.__doc__
        ):
            member.__doc__ = twin.__doc__


Callback = Callable[[ChatResult], None]


class Closing:
    """``with`` support for a sync object that has ``close()``."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClosing:
    """``async with`` support for an async object that has ``aclose()``."""

    async def aclose(self) -> None:
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
