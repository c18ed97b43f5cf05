"""Retry policy (tenacity): exponential backoff with full jitter, bounded attempts and total
time, ``Retry-After`` honoured.

Only errors whose ``retryable`` is true are retried: connection failures before a response,
429, 502, 503, 504. A stream is retried only until its first byte has arrived (see
``sdk.client``), so a generation is never duplicated silently.

The waits are injectable (``sleep``/``async_sleep``, ``random``) so tests run instantly.
"""

from __future__ import annotations

import asyncio
import logging
import random as _random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import tenacity

from sdk.errors import KVBranchError

__all__ = ["RetryPolicy", "NO_RETRY"]

logger = logging.getLogger("kvbranch.sdk")
T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How failed requests are retried.

    ``max_attempts`` counts the first try (1 = never retry). ``max_total_s`` bounds the time
    from the first try to the start of the last one: a wait that would cross it is not
    started and the last error is raised. The n-th wait is uniform in
    ``[0, min(max_backoff_s, initial_backoff_s * 2**(n-1))]`` (full jitter), or exactly the
    server's ``Retry-After`` when it sent one (a ``Retry-After`` past the time budget ends the
    retries: the error is raised with its ``retry_after`` for the caller to decide).
    """

    max_attempts: int = 4
    initial_backoff_s: float = 0.5
    max_backoff_s: float = 8.0
    max_total_s: float = 60.0
    jitter: bool = True
    sleep: Callable[[float], None] = field(default=time.sleep, compare=False)
    async_sleep: Callable[[float], Awaitable[None]] = field(default=asyncio.sleep, compare=False)
    random: Callable[[], float] = field(default=_random.random, compare=False)
    clock: Callable[[], float] = field(default=time.monotonic, compare=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        for name in ("initial_backoff_s", "max_backoff_s", "max_total_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")

    # --- pieces handed to tenacity ----------------------------------------------------------
    def backoff(self, attempt: int, error: BaseException | None) -> float:
        """Seconds to wait after failed attempt number ``attempt`` (1-based)."""
        retry_after = getattr(error, "retry_after", None)
        if retry_after is not None:
            return float(retry_after)
        ceiling = min(self.max_backoff_s, self.initial_backoff_s * float(2 ** (attempt - 1)))
        return ceiling * self.random() if self.jitter else ceiling

    @staticmethod
    def _should_retry(state: tenacity.RetryCallState) -> bool:
        if state.outcome is None or not state.outcome.failed:
            return False
        error = state.outcome.exception()
        return isinstance(error, KVBranchError) and error.retryable

    @staticmethod
    def _log(state: tenacity.RetryCallState) -> None:
        error = state.outcome.exception() if state.outcome is not None else None
        wait = state.next_action.sleep if state.next_action is not None else 0.0
        logger.info(
            "kvbranch: attempt %d failed (%s); retrying in %.2fs", state.attempt_number, error, wait
        )

    def _kwargs(self) -> dict[str, Any]:
        start = self.clock()
        # tenacity asks ``stop`` and then ``wait`` after each failure: share one jittered
        # draw per attempt so the wait that is checked against the budget is the one slept.
        draws: dict[int, float] = {}

        def wait(state: tenacity.RetryCallState) -> float:
            n = state.attempt_number
            if n not in draws:
                error = state.outcome.exception() if state.outcome is not None else None
                draws[n] = self.backoff(n, error)
            return draws[n]

        def stop(state: tenacity.RetryCallState) -> bool:
            if state.attempt_number >= self.max_attempts:
                return True
            return (self.clock() - start) + wait(state) > self.max_total_s

        return dict(
            retry=self._should_retry, wait=wait, stop=stop, reraise=True, before_sleep=self._log
        )

    def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` with retries (sync)."""
        return tenacity.Retrying(sleep=self.sleep, **self._kwargs())(fn)

    async def acall(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run ``fn`` with retries (async)."""
        return await tenacity.AsyncRetrying(sleep=self.async_sleep, **self._kwargs())(fn)


NO_RETRY = RetryPolicy(max_attempts=1)
