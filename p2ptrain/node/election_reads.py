"""How a node looks at the run's records while it elects: DHT reads, records pushed to it, and the
waits between looks that a push or a member's hello cuts short (outer_sync.py elects on them).

The DHT offers no change notification across processes, so an election polls it; a DHT read took
0.6 s at 16 nodes on 2 cores, and most of an election's time was spent in one. Records pushed over
the data plane (record_push.py) bring the news sooner: after a push the election looks at the view
as it is, and a push that arrives during a read cuts the wait for that read short.
"""

from __future__ import annotations

import asyncio
import time

from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.swarm.membership import Offered, SwarmView, live
from p2ptrain.swarm.records import Heartbeat

MIN_READ_GAP = 0.05
"""Seconds between two reads of the records in an election, however often members dial us."""
MIN_PUSH_GAP = 0.01
"""Seconds between two looks at the records pushed to us (no DHT read: a decision on what we have)."""


class ElectionReads:
    def __init__(self, view: SwarmView, config_digest: str, server: DataPlaneServer):
        self.view = view
        self._digest = config_digest
        self._server = server
        self._pushed = asyncio.Event()
        """A peer's pushed record changed our view since the election last looked."""
        self.records_taken = 0
        """Pushed records our view took (newer than the DHT's copy when they came)."""
        self._reading: asyncio.Future[list[Heartbeat]] | None = None
        """The DHT read of the records under way, if any."""
        server.on_record = self._record_pushed

    async def records(self, cached: bool = False) -> list[Heartbeat]:
        """Live nodes of this run with this config: a node of another config is never a member."""
        return [
            beat
            for beat in live(await self.view.read(cached=cached))
            if beat.config_digest in (self._digest, "")
        ]

    def start(self) -> None:
        """Start a DHT read now (when ready for a step: beside the ready record's store, not after
        it); the next `current` takes it."""
        if self._reading is None:
            self._reading = asyncio.ensure_future(self.view.read())

    def stop(self) -> None:
        """The step is over: a read under way is of no use now."""
        if self._reading is not None:
            self._reading.cancel()
            self._reading = None

    async def current(self) -> list[Heartbeat]:
        """The election's look at the records. After a record was pushed to us: the view as it is,
        no DHT round trip. Otherwise a DHT read (the one `start`ed, if it is still going), cut
        short by a record pushed meanwhile: the push is the news the read was for; the read goes
        on and lands in the view. Both only where the view's last read is recent enough to judge
        liveness on (`SwarmView.fresh`): on an older one, nodes would look silent."""
        if self._pushed.is_set() and self.view.fresh():
            self._pushed.clear()
            return await self.records(cached=True)
        self.start()
        reading = self._reading
        assert reading is not None
        if self.view.fresh():
            pushed = asyncio.ensure_future(self._pushed.wait())
            try:
                await asyncio.wait((reading, pushed), return_when=asyncio.FIRST_COMPLETED)
            finally:
                pushed.cancel()
            if not reading.done():
                self._pushed.clear()
                return await self.records(cached=True)
        self._reading = None
        await reading
        self._pushed.clear()  # what came during the read is in the view it judged
        return await self.records(cached=True)

    async def pause(self, seconds: float) -> None:
        """The election's wait between two looks: cut short when a peer pushes us a newer record
        (the next look is at what we have, no DHT round trip) or when a member dials us for the
        step (it has decided, so the records it saw are in the DHT). Never below MIN_PUSH_GAP and
        MIN_READ_GAP: pushes and hellos (anyone may send them) cannot make this node decide or
        read the DHT more often than that."""
        started = time.monotonic()
        await asyncio.sleep(min(seconds, MIN_PUSH_GAP))
        if self._pushed.is_set():
            return
        waits = {
            asyncio.ensure_future(self._pushed.wait()),
            asyncio.ensure_future(self._server.dialed(seconds - MIN_PUSH_GAP)),
        }
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if not self._pushed.is_set():
            await asyncio.sleep(max(0.0, min(seconds, MIN_READ_GAP) - (time.monotonic() - started)))

    def _record_pushed(self, value: bytes, source: str) -> bool:
        """A record a peer pushed to our data port: the view verifies it and takes it only for a
        node it knows, and only when newer (`SwarmView.offer_signed`). True when we hold it now."""
        offered = self.view.offer_signed(value, source)
        if offered is Offered.TAKEN:
            self.records_taken += 1
            self._pushed.set()
        return offered is not Offered.REFUSED
