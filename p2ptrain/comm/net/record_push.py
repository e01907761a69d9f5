"""Signed records pushed to the peers of a step over the data plane, beside the DHT.

A node that has finished its inner steps stores its signed ready record in the DHT, where the
others find it at their next read: they poll four times a second while they wait, and a read takes
a round trip to the key's replicas (a third of a second on a saturated machine). That wait was most
of what the control plane cost a step (benchmarks.scale). So the node also sends the same signed
bytes straight to the data ports of the nodes it expects in the step: one connection, two frames,
no answer.

This module only carries bytes. What the receiver makes of them is the swarm's business
(`SwarmView.offer`): the record is verified exactly like one read from the DHT and taken only for a
node already known and only when newer than what is known, so a push can make news arrive sooner
but can add no one to the swarm; the DHT stays the source of truth, and the election's poll the
fallback when a push is lost. The receiver answers one frame: whether it now holds the record (it
took it, or had it or a newer one already). A node whose pushes every peer of the step holds need
not wait for its DHT store before it elects (outer_sync.py); a peer that lies about it costs that
peer's own view, nothing more.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Iterable

from p2ptrain.comm.transport.wire import WireError, read_frame, write_frame
from p2ptrain.deadline import within

log = logging.getLogger(__name__)

RECORD_KIND = "record"
"""First frame of a data-plane connection that carries a pushed record (the next frame holds it)."""
MAX_PUSHED_RECORD = 4096
"""The largest record a server reads (heartbeats are at most 4 KiB, swarm/records.py)."""

HELD = "held"
"""The receiver's answer when it holds the pushed record (or a newer one of the same node)."""
NOT_HELD = "not held"

RecordSink = Callable[[bytes, str], bool]
"""What a server does with a pushed record's bytes (and the address they came from): True when it
holds that record now."""


async def push_record(host: str, port: int, *, record: bytes, timeout: float) -> bool:
    """Send `record` to the data port at host:port; True when the receiver says, within
    `timeout`, that it holds it."""
    writer = None
    try:
        reader, writer = await within(asyncio.open_connection(host, port), timeout)
        await write_frame(writer, {"kind": RECORD_KIND}, timeout=timeout)
        await write_frame(writer, {"kind": "body"}, payload=record, timeout=timeout)
        return (await read_frame(reader, timeout, 0)).kind == HELD
    except (OSError, asyncio.TimeoutError, WireError) as exc:
        log.debug("record not pushed to %s:%d: %s", host, port, exc)
        return False
    finally:
        if writer is not None:
            writer.close()


async def receive_record(reader: asyncio.StreamReader, timeout: float) -> bytes:
    """The record after a RECORD_KIND frame; WireError when it is not there within `timeout`."""
    frame = await read_frame(reader, timeout, MAX_PUSHED_RECORD)
    return bytes(frame.payload)


class RecordPusher:
    """A node's pushes in flight: started without waiting, each bounded by `timeout`, cancelled
    when the node stops (a peer that never answers costs one task for `timeout`, nothing more)."""

    def __init__(self, timeout: float):
        self.timeout = timeout
        self._tasks: set[asyncio.Task[bool]] = set()
        self.sent = 0
        """Records the receivers hold so far (benchmarks count them beside the ring's connections)."""

    def push(self, record: bytes, addresses: Iterable[tuple[str, int]]) -> list[asyncio.Task[bool]]:
        """Start pushing `record` to each address; the tasks, for `held_by_all`."""
        tasks = []
        for host, port in addresses:
            task = asyncio.create_task(push_record(host, port, record=record, timeout=self.timeout))
            self._tasks.add(task)
            task.add_done_callback(self._done)
            tasks.append(task)
        return tasks

    @staticmethod
    async def held_by_all(tasks: Collection[asyncio.Task[bool]]) -> bool:
        """Whether every push of `tasks` ended held (False for none). Cancelling this wait leaves
        the pushes running."""
        if not tasks:
            return False
        await asyncio.wait(tasks)
        return all(not task.cancelled() and task.exception() is None and task.result() for task in tasks)

    @property
    def in_flight(self) -> int:
        return len(self._tasks)

    def _done(self, task: asyncio.Task[bool]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is None and task.result():
            self.sent += 1

    def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
