"""One way for an async unit test to wait for a state: poll the condition until it holds.

The deadline is a hang guard, not a timing check: a condition that never holds fails the test
with a clear line instead of hanging the run; nothing asserts how long it took."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

#: Long enough that only a state that never comes reaches it, even on a loaded 2-core machine.
HANG_GUARD_S = 30.0


async def until(check: Callable[[], bool], timeout_s: float = HANG_GUARD_S) -> None:
    """Return once ``check()`` is true; AssertionError if it never becomes true."""

    async def poll() -> None:
        while not check():
            await asyncio.sleep(0.01)

    try:
        await asyncio.wait_for(poll(), timeout_s)
    except asyncio.TimeoutError:
        raise AssertionError("condition not reached") from None
