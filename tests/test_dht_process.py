"""The DHT child (swarm/dht_process.py): answers through the pipe, and fails calls at once once gone."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import signal
import time
from collections.abc import Callable

import pytest
from hivemind.utils import get_dht_time

from p2ptrain import procs
from p2ptrain.swarm.dht import DHTSettings, SwarmDHT
from tests.support.helpers import wait_until

pytestmark = pytest.mark.procs
"""Every test here starts processes."""


def test_a_dht_child_answers_then_fails_every_call_at_once_when_it_is_gone() -> None:
    timeout = 60.0  # far above what a call to a dead child may take
    with SwarmDHT.start(DHTSettings(listen=["/ip4/127.0.0.1/tcp/0"], timeout=timeout)) as dht:
        child = dht._pid
        assert child is not None
        daemons = procs.descendants(child)
        assert daemons, "the DHT child runs p2pd"
        assert any(address.startswith("/ip4/127.0.0.1/tcp/") for address in dht.visible_maddrs())

        async def store_then_get() -> bytes:
            assert await dht.store("key", b"subkey", value=b"value", expiration=get_dht_time() + 60)
            found = await dht.get("key")
            assert found is not None
            return bytes(found[b"subkey"].value)

        assert asyncio.run(store_then_get()) == b"value"
        os.kill(child, signal.SIGTERM)  # as the kernel does when the agent dies (PR_SET_PDEATHSIG)
        wait_until(
            lambda: not any(procs.is_alive(pid) for pid in [child, *daemons]),
            30,
            what="the DHT child and p2pd to exit",
        )
        started = time.monotonic()
        assert asyncio.run(dht.get("key")) is None
        assert not asyncio.run(dht.store("key", b"subkey", value=b"again", expiration=get_dht_time() + 60))
        assert time.monotonic() - started < timeout / 4


@pytest.mark.parametrize("how", ["cancelled", "cancelled_error"])
def test_a_call_cancelled_under_the_node_fails_that_call_and_leaves_the_node_running(how: str) -> None:
    """A DHT answer that comes back cancelled (hivemind's concurrent futures, a peer stopped under
    the call) is a failed read or store, not a cancellation of the node's own task: it once ended a
    drill node with a traceback mid-step. The child is stopped (SIGSTOP) so the call stays pending."""
    with SwarmDHT.start(DHTSettings(listen=["/ip4/127.0.0.1/tcp/0"], timeout=60.0)) as dht:
        child = dht._pid
        assert child is not None
        os.kill(child, signal.SIGSTOP)
        try:

            async def get_while_its_answer_is_cancelled() -> tuple[object, bool]:
                reading = asyncio.ensure_future(dht.get("key"))
                pending = dht._dht._pending  # the parent's side of the pipe: no way in from outside
                await asyncio.wait_for(_until(lambda: bool(pending)), 10)
                answer = next(iter(pending.values()))
                if how == "cancelled":
                    answer.cancel()
                else:  # an exception asyncio turns into its own CancelledError
                    answer.set_exception(concurrent.futures.CancelledError())
                return await reading, reading.cancelled()

            found, cancelled = asyncio.run(get_while_its_answer_is_cancelled())
            assert found is None and not cancelled
        finally:
            os.kill(child, signal.SIGCONT)


def test_cancelling_a_task_whose_dht_call_is_pending_cancels_it() -> None:
    """The other side of the test above: a node that stops cancels its tasks, and one waiting for
    the DHT must end as cancelled, not take it for a failed call and go on (a loop that reads again
    would keep the event loop, and the node, from ever exiting: seen at 16 drill nodes)."""
    with SwarmDHT.start(DHTSettings(listen=["/ip4/127.0.0.1/tcp/0"], timeout=60.0)) as dht:
        child = dht._pid
        assert child is not None
        os.kill(child, signal.SIGSTOP)
        try:

            async def cancel_a_pending_get() -> bool:
                reading = asyncio.ensure_future(dht.get("key"))
                await asyncio.wait_for(_until(lambda: bool(dht._dht._pending)), 10)
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading
                return reading.cancelled()

            assert asyncio.run(cancel_a_pending_get())
            assert not dht._dht._pending, "the call is cancelled in the child too"
        finally:
            os.kill(child, signal.SIGCONT)


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)
