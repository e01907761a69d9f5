"""`within`: a deadline that never loses the caller's cancellation (p2ptrain/deadline.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from p2ptrain.deadline import within, within_by_task

Within = Callable[[Awaitable[Any], "float | None"], Awaitable[Any]]
VARIANTS = [pytest.param(within, id="within"), pytest.param(within_by_task, id="within_by_task")]


@pytest.mark.parametrize("deadline", VARIANTS)
def test_a_caller_cancelled_in_the_turn_its_awaitable_finishes_stays_cancelled(deadline: Within) -> None:
    """The case Python 3.11's wait_for gets wrong: it returns the result and the caller goes on."""

    async def scenario() -> str:
        answer: asyncio.Future[str] = asyncio.get_running_loop().create_future()

        async def caller() -> str:
            await deadline(answer, 10.0)
            return "went on as if never cancelled"

        task = asyncio.create_task(caller())
        await asyncio.sleep(0)  # the caller now waits on `answer`
        answer.set_result("frame")
        task.cancel()  # same turn
        try:
            return await task
        except asyncio.CancelledError:
            return "cancelled"

    assert asyncio.run(scenario()) == "cancelled"


@pytest.mark.parametrize("deadline", VARIANTS)
def test_the_deadline_raises_timeout_and_cancels_the_awaitable(deadline: Within) -> None:
    async def scenario() -> tuple[bool, bool]:
        never: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        with pytest.raises(asyncio.TimeoutError):
            await deadline(never, 0.01)
        return never.cancelled(), await deadline(asyncio.sleep(0, result=True), 1.0)

    assert asyncio.run(scenario()) == (True, True)


@pytest.mark.parametrize("deadline", VARIANTS)
def test_no_deadline_waits_for_the_result(deadline: Within) -> None:
    async def scenario() -> int:
        return int(await deadline(asyncio.sleep(0.01, result=7), None))

    assert asyncio.run(scenario()) == 7
