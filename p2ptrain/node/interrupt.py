"""Waiting for work that the node may have to abandon: Ctrl+C, SIGTERM, a rank that died."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")
LEAVING_GRACE_S = 2.0
"""How long a node that is told to stop lets an all-reduce under way finish (`finish_first`)."""


class Interrupted(Exception):
    """Something the node must react to happened while it waited for other work."""


async def unless(work: Awaitable[T], *interruptions: Awaitable[Any]) -> T:
    """`work`'s result, unless one of `interruptions` completes first: then `work` is cancelled
    (and awaited, so its cleanup runs) and Interrupted is raised."""
    task = asyncio.ensure_future(work)
    waiters = [asyncio.ensure_future(interruption) for interruption in interruptions]
    try:
        await asyncio.wait([task, *waiters], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise Interrupted


async def finish_first(work: Awaitable[T], grace: float) -> T:
    """`work`'s result. Cancelled meanwhile (the node stops), `work` still gets up to `grace`
    seconds to end before it is cancelled too; then the cancellation goes on. For an all-reduce
    under way: a member that left in the middle of the all-gather had its successors fail while
    members upstream had every frame and took the step (one result on some members, none on the
    others), where finishing takes a fraction of a second."""
    task = asyncio.ensure_future(work)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.wait([task], timeout=grace)
        task.cancel()
        await asyncio.wait([task])  # its cleanup (connections closed)
        if not task.cancelled():
            task.exception()  # failed in the grace: read, so asyncio does not log it as lost
        raise
