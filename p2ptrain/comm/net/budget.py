"""Budgets for the data port's unauthenticated connections, so a flood cannot starve the members.

Anyone can open a TCP connection to a node's data port. Until its handshake completes a connection
is a stranger's, and it costs the node a socket, a task and memory. Two phases, two budgets:

1. **Before the hello** (the dialer's first frame): at most `per_source` connections from one
   address and `total` in all. When the pool is full the *oldest* one is dropped for the newcomer:
   an honest dialer sends its hello within milliseconds, so idle connections — the flood — are the
   ones that grow old. A single source cannot fill the pool at all. When a source holds its share,
   its oldest connection that has sent nothing gives way to its newcomer, and one that has begun
   its hello never does: members behind one address (a home router, a carrier-grade NAT, a campus)
   share it with whoever floods from there, and refusing the newcomer, as before, kept a member
   whose peers dial from the flood's address out of every step. A hello for a step this node
   has not registered keeps its slot until the dialer has proven its key.
   **An idle connection that gives way is parked, not closed** (ParkingLot): held open and no
   longer read, for PARKED_S at most. Closed at once, a flooder reopens it at once: 500 idle
   connections from the members' own address cost a node ~4,500 accepts, tasks and closes a
   second, a quarter of its step rate on a drill. Parked, they cost a descriptor each and
   nothing per second. The lot is bounded too (its oldest give way, closed), by at most a quarter
   of the process's open-file limit.
   **A hello for a step under way** moves to a second pool of the same kind while our signed
   welcome waits for the dialer's proof (one round trip): MAX_PROVING, MAX_PROVING_PER_SOURCE of
   one address (a burst of a step's lanes from nodes behind one address fits). Outside any pool,
   one source once held a thousand such waits and ran a node out of descriptors.
2. **Waiting for this node to reach the step** the hello names (a fast member may dial before we got
   there): hellos from the nodes this node currently sees ready for its step (`candidates`) wait
   freely; anyone else shares `strangers` slots, refused when those are taken. Hellos for steps far
   from this node's own are refused at once (dataplane.py).

Every refusal is logged, but at most once per 10 s with a count (untrusted.ThrottledLog), so a
flood cannot fill the disk either.
"""

from __future__ import annotations

import asyncio
import contextlib
import resource
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Iterable, Sized
from dataclasses import dataclass, field
from typing import SupportsIndex

from p2ptrain.comm.transport import lanes
from p2ptrain.deadline import within

MAX_PENDING_HANDSHAKES = 64
"""Connections that have not sent their hello yet, in all."""
MAX_PENDING_PER_SOURCE = 32
"""…and from one source address: half the pool (members behind one carrier-grade NAT share an
address, and a relay takes two connections per relayed edge and lane)."""
MAX_PROVING = 512
"""Connections whose hello for a step under way was welcomed and whose proof has not come yet."""
MAX_PROVING_PER_SOURCE = 128
"""…from one source address."""
MAX_WAITING_STRANGERS = 32
"""Connections of non-candidates waiting for this node to reach their step."""
MAX_PARKED = 2048
"""Idle connections that gave way in the pending pool, held open and unread (ParkingLot), in all;
at most a quarter of the process's open-file limit."""
MAX_PARKED_PER_SOURCE = 1024
"""…from one source address: a flooder's 1,000 idle connections from one address sit still."""
PARKED_S = 60.0
"""How long a parked connection is held before it is closed (a flooder that then reopens it costs
the node its count / PARKED_S accepts a second)."""
PARKED_RCVBUF = 2048
"""Receive buffer asked for a parked socket: what its sender may still push is not read, and the
kernel keeps at most about this much of it."""


Spoke = Callable[[], bool]
"""Whether a pending connection has sent any byte yet (received here, or waiting in the kernel)."""


def _idle(entry: tuple[str, asyncio.StreamWriter, Spoke | None, object], source: str) -> bool:
    """A pending connection of `source` that has sent nothing (one of a pool that does not ask
    is never taken for idle)."""
    return entry[0] == source and entry[2] is not None and not entry[2]()


def unread_bytes(writer: asyncio.StreamWriter) -> int:
    """Bytes that have arrived on the connection's socket and wait to be read (Linux's FIONREAD)."""
    sock = writer.transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        return lanes.unread(sock.fileno())
    except OSError:
        return 0


class CountingReader(asyncio.StreamReader):
    """A StreamReader that counts the bytes that reached it (the data port's, for `Spoke`)."""

    received = 0

    def feed_data(self, data: Iterable[SupportsIndex]) -> None:
        self.received += len(data) if isinstance(data, Sized) else 1
        super().feed_data(data)


class Parked(Exception):
    """Set on the reader of a pending connection that was parked: its handshake ends, and the
    connection stays open, unread, in the ParkingLot (the handshake must not close it)."""


def parking_room(limit: int = MAX_PARKED) -> int:
    """MAX_PARKED, or a quarter of this process's open-file limit where that is less."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return limit if soft == resource.RLIM_INFINITY else max(0, min(limit, soft // 4))


@dataclass(kw_only=True)
class ParkingLot:
    """Idle connections that gave way in the pending pool, held open and unread until `hold_s`
    has passed or newer ones need the room (oldest closed first: of the same source when it holds
    its share, else of all). Expiry is looked at whenever one is parked: a lot nobody adds to
    keeps what it holds, bounded by the caps, until the node closes it."""

    total: int = field(default_factory=parking_room)
    per_source: int = MAX_PARKED_PER_SOURCE
    hold_s: float = PARKED_S
    clock: Callable[[], float] = time.monotonic
    _lot: OrderedDict[int, tuple[str, float, asyncio.WriteTransport]] = field(default_factory=OrderedDict)
    _by_source: Counter[str] = field(default_factory=Counter)
    _next: int = 0
    parked: int = 0
    """Connections parked so far."""
    closed: int = 0
    """…of which closed since, expired or displaced."""

    def __len__(self) -> int:
        return len(self._lot)

    def held_by(self, source: str) -> int:
        return self._by_source[source]

    def park(self, source: str, transport: asyncio.WriteTransport) -> bool:
        """Hold `transport` open, unread; False where the lot has no room at all (the caller
        closes it)."""
        now = self.clock()
        while self._lot and now - next(iter(self._lot.values()))[1] >= self.hold_s:
            self._close(next(iter(self._lot)))
        if min(self.total, self.per_source) <= 0:
            return False
        if self._by_source[source] >= self.per_source:
            self._close(next(ticket for ticket, entry in self._lot.items() if entry[0] == source))
        elif len(self._lot) >= self.total:
            self._close(next(iter(self._lot)))
        if isinstance(transport, asyncio.ReadTransport):
            transport.pause_reading()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, PARKED_RCVBUF)
        self._next += 1
        self._lot[self._next] = (source, now, transport)
        self._by_source[source] += 1
        self.parked += 1
        return True

    def _close(self, ticket: int) -> None:
        source, _, transport = self._lot.pop(ticket)
        self._by_source[source] -= 1
        if self._by_source[source] <= 0:
            del self._by_source[source]
        transport.abort()
        self.closed += 1

    def close_all(self) -> None:
        """Close every parked connection (the node stops)."""
        while self._lot:
            self._close(next(iter(self._lot)))


@dataclass(kw_only=True)
class PendingBudget:
    """Connections of one phase (before the hello; welcomed, before the proof), by source address,
    oldest dropped first: an idle one (it sent nothing) into `parking` where there is one, any
    other closed."""

    total: int = MAX_PENDING_HANDSHAKES
    per_source: int = MAX_PENDING_PER_SOURCE
    parking: ParkingLot | None = None
    _order: OrderedDict[int, tuple[str, asyncio.StreamWriter, Spoke | None, asyncio.StreamReader | None]] = (
        field(default_factory=OrderedDict)
    )
    _by_source: Counter[str] = field(default_factory=Counter)
    _next: int = 0
    refused: int = 0
    evicted: int = 0

    def __len__(self) -> int:
        return len(self._order)

    def held_by(self, source: str) -> int:
        """Connections of `source` in this pool."""
        return self._by_source[source]

    def enter(
        self,
        source: str,
        writer: asyncio.StreamWriter,
        spoke: Spoke | None = None,
        reader: asyncio.StreamReader | None = None,
    ) -> int | None:
        """A ticket for this connection, or None when its source holds its share and none of its
        connections is idle. `spoke`: whether the connection has sent bytes (such a one is not
        given up for another of its source; None: this pool does not ask). `reader`: where its
        handshake reads, told `Parked` if the connection is parked (None: it is closed instead)."""
        if self._by_source[source] >= self.per_source:
            idle = next((ticket for ticket, entry in self._order.items() if _idle(entry, source)), None)
            if idle is None:
                self.refused += 1
                return None
            self._evict(idle)
        elif len(self._order) >= self.total:
            self._evict(next(iter(self._order)))
        self._next += 1
        self._order[self._next] = (source, writer, spoke, reader)
        self._by_source[source] += 1
        return self._next

    def _evict(self, ticket: int) -> None:
        entry = self._order.pop(ticket)
        old_source, old_writer, _, old_reader = entry
        self._release(old_source)
        self.evicted += 1
        parking = self.parking
        if (
            parking is not None
            and old_reader is not None
            and _idle(entry, old_source)
            and parking.park(old_source, old_writer.transport)
        ):
            old_reader.set_exception(Parked())  # its handshake ends; the connection stays
            return
        old_writer.transport.abort()  # its handshake task ends on the closed connection

    def leave(self, ticket: int) -> None:
        """The connection left the phase (or ended): it no longer counts here."""
        entry = self._order.pop(ticket, None)
        if entry is not None:
            self._release(entry[0])

    def _release(self, source: str) -> None:
        self._by_source[source] -= 1
        if self._by_source[source] <= 0:
            del self._by_source[source]


@dataclass(kw_only=True)
class Tickets:
    """One connection's places in the two pools of phase 1, given up as its handshake moves on.
    `ticket`: its place in `pending`, None for a relayed connection (in neither pool)."""

    pending: PendingBudget
    proving: PendingBudget
    source: str
    writer: asyncio.StreamWriter
    ticket: int | None
    proof: int | None = None

    def hello_read(self) -> None:
        if self.ticket is not None:
            self.pending.leave(self.ticket)

    def awaiting_proof(self) -> bool:
        """A hello for a step under way: from the idle pool into the proving pool; False when its
        source holds its share of that pool."""
        if self.ticket is None or self.proof is not None:
            return True
        self.hello_read()
        self.proof = self.proving.enter(self.source, self.writer)
        return self.proof is not None

    def proven(self) -> None:
        """The dialer proved its key (or the handshake ended)."""
        self.hello_read()
        if self.proof is not None:
            self.proving.leave(self.proof)


@dataclass
class WaitingBudget:
    """Phase 2: hellos waiting for this node to reach their step; candidates are not counted."""

    strangers: int = MAX_WAITING_STRANGERS
    candidates: Collection[bytes] = frozenset()
    """Nodes this node last saw ready for its step (set by the node's sync before each election)."""
    waiting_strangers: int = 0

    def may_wait(self, key: bytes) -> bool:
        return key in self.candidates or self.waiting_strangers < self.strangers


async def wait_until(
    condition: Callable[[], bool], changed: Callable[[], asyncio.Event], deadline: float
) -> bool:
    """Whether `condition` came true by `deadline` (time.monotonic()); it is looked at again each
    time the event `changed()` returns (the current one: its owner replaces it at each change) is set."""
    while not condition():
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        with contextlib.suppress(asyncio.TimeoutError):
            await within(changed().wait(), remaining)
    return True
