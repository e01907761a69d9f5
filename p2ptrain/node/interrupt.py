"""Waiting for work that the node may have to abandon: Ctrl+C, SIGTERM, a rank that died."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, TypeVar

T = TypeVar("T")


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
