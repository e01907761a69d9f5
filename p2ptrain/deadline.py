"""`within`: an await with a deadline that never loses a cancellation.

Python 3.11's `asyncio.wait_for` returns the awaitable's result when the caller is cancelled in
the same turn the awaitable finishes, and the caller then goes on as if it had never been
cancelled: a node's shutdown waited 60 s for a data-plane handler that should have ended, and a
dial that connects just as its attempt is abandoned would go on to its handshake.
`asyncio.timeout` (3.11+) cannot lose a cancellation, so every deadline in the package goes
through `within`. Python 3.10 has neither `asyncio.timeout` nor a fixed `wait_for` (the same
flaw); there `within_by_task` stands in.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within_by_task(awaitable: Awaitable[T], seconds: float | None) -> T:
    """`within` for Python 3.10: the awaitable runs as a task that `asyncio.wait` watches (it
    re-raises a cancellation, where 3.10's `wait_for` has the same flaw as 3.11's)."""
    task = asyncio.ensure_future(awaitable)
    try:
        await asyncio.wait({task}, timeout=seconds)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise asyncio.TimeoutError
    return task.result()


if sys.version_info >= (3, 11):

    async def within(awaitable: Awaitable[T], seconds: float | None) -> T:
        """`awaitable`'s result, or asyncio.TimeoutError after `seconds` (None: no deadline)."""
        async with asyncio.timeout(seconds):
            return await awaitable

else:
    within = within_by_task


async def pause(stop: asyncio.Event, seconds: float) -> None:
    """Wait `seconds`, or less where `stop` is set first: the pace of a loop between two looks at
    the world, cut short by a shutdown."""
    with contextlib.suppress(asyncio.TimeoutError):
        await within(stop.wait(), seconds)
