"""The relay's side of relay.py's protocol, in a reachable member's data-plane server: it checks
each request against the step it takes part in, pairs the two ends of an edge, and copies bytes
between them, capped and counted. Everything here faces the network: bounded in number and time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from p2ptrain.comm.net.budget import wait_until
from p2ptrain.comm.net.members import Member
from p2ptrain.comm.net.relay import RelayRequest, Stream, needs_relay, relay_for
from p2ptrain.comm.transport.wire import Frame, WireError, write_frame
from p2ptrain.deadline import within
from p2ptrain.identity import NodeIdentity, short_id
from p2ptrain.rate import RateCap
from p2ptrain.untrusted import ThrottledLog

log = logging.getLogger(__name__)

MAX_WAITING = 256
"""Requests waiting for their partner, in all (a relayed butterfly of h members behind NAT has
h(h − 1) edges per lane, spread over the reachable members)."""
MAX_PER_SIGNER = 32
"""…of one node (its relayed edges here, times the lanes)."""
VIEWS_DIFFER = "views differ: "
MAX_EARLY_STRANGERS = 8
"""Requests of nodes we know nothing of waiting for this node's attempt (anyone can sign one)."""
ABSENT = "did not ask for this edge in time"
MAX_SPLICES = 256
"""Edges relayed at once."""
COPY_BYTES = 256 << 10
RelayAdmit = Callable[[RelayRequest, float], Awaitable[str | None]]
"""A standby relay's own check of a request (it is in no step): why not, or None; by a deadline."""
KEPT_MEMBERSHIPS = 8
"""Memberships (step, digest) remembered for requests that arrive after this node's own attempt
ended: a fast relay may be done with the step while its edges still carry the last frames."""


@dataclass
class _Slots:
    """A count of waiting requests and its bound."""

    limit: int
    taken: int = 0


@dataclass(frozen=True, kw_only=True)
class RelayRefusal:
    """Why the relay will not pair an end; `views_differ`: its partner asked under another attempt
    or membership (no one is to blame); `absent`: its partner never asked in time (it is)."""

    reason: str
    views_differ: bool = False
    attempt: int | None = None
    """The partner's attempt, where only the attempts differ."""
    absent: bool = False

    def header(self, request: RelayRequest | None) -> dict:
        header: dict = {"kind": "refuse", "reason": self.reason, "views_differ": self.views_differ}
        if request is not None:
            header["absent"] = request.partner
        if self.attempt is not None:
            header["attempt"] = self.attempt
        return header


class RelayService:
    """The relay side, in a reachable member's data-plane server: pairs requests, splices the pairs.
    A standby relay (`p2ptrain bootstrap --relay`) takes part in no step: `admit` checks its
    requests instead of the memberships this node registered (swarm/standby.py)."""

    def __init__(
        self,
        *,
        identity: NodeIdentity,
        mbps: float,
        lanes: int,
        setup_timeout: float,
        failure_timeout: float,
        wake: Callable[[int], None] = lambda step: None,
        admit: RelayAdmit | None = None,
    ):
        """`lanes`: comm.connections (a member's parallel connections per edge); `setup_timeout`:
        how long an end waits for its partner; `wake`, `admit`: see the attributes below."""
        self.identity = identity
        self.admit = admit
        self.lanes = lanes
        self.idle_timeout = setup_timeout + 2 * failure_timeout
        """A splice that carried no byte either way this long is closed: both ends gave up long ago."""
        self._streams: set[Stream] = set()
        self.known: Collection[bytes] = frozenset()
        """The live nodes of the run this node knows of (set by its sync at every read of the records)."""
        self.wake = wake
        """Called with the step of an early request from a known node: our election should look again."""
        self._early_known = _Slots(MAX_WAITING)
        """Requests of known nodes waiting for this node's attempt."""
        self._early_strangers = _Slots(MAX_EARLY_STRANGERS)
        """Requests of nodes we know nothing of waiting for this node's attempt."""
        self.cap = RateCap(mbps * 1e6 / 8)
        self.partner_timeout = setup_timeout
        self._memberships: OrderedDict[tuple[int, bytes], tuple[Member, ...]] = OrderedDict()
        self._changed = asyncio.Event()
        self._waiting: dict[tuple, tuple[RelayRequest, Stream, asyncio.Future[RelayRefusal | None]]] = {}
        self._splices = 0
        self._none_spliced = asyncio.Event()
        self._none_spliced.set()
        self.bytes_relayed = 0
        """Bytes copied between the ends of relayed edges so far (both directions)."""
        self.edges_relayed = 0
        self._refusals = ThrottledLog(log)

    @property
    def active(self) -> int:
        """Edges relayed now."""
        return self._splices

    @property
    def waiting_ends(self) -> int:
        """Ends of edges waiting here for their partner now."""
        return len(self._waiting)

    async def drained(self, timeout: float) -> None:
        """Return once no edge is relayed here (or after `timeout`): a node that leaves lets the
        edges it carries finish first, else their step fails for the members at both ends."""
        with contextlib.suppress(asyncio.TimeoutError):
            await within(self._none_spliced.wait(), timeout)

    def abort(self) -> None:
        """Cut every edge still relayed and every end still waiting (this node is leaving)."""
        for _, writer in [*self._streams, *(mine for _, mine, _ in self._waiting.values())]:
            writer.transport.abort()

    def allow(self, step: int, digest: bytes, members: Sequence[Member]) -> None:
        """This node takes part in `step` under `digest`: relay its NAT'd members' edges."""
        self._memberships[(step, digest)] = tuple(members)
        self._memberships.move_to_end((step, digest))
        while len(self._memberships) > KEPT_MEMBERSHIPS:
            self._memberships.popitem(last=False)
        self._changed.set()
        self._changed = asyncio.Event()

    async def _membership(self, request: RelayRequest, deadline: float) -> tuple[Member, ...] | None:
        """The members of the request's (step, digest). An end may ask before this node registered
        that attempt: it waits (bounded), the live nodes we know of (`known`) up to MAX_WAITING in
        all, anyone else in MAX_EARLY_STRANGERS slots of its own, so a flood of such requests holds
        neither the members' slots nor those of early hellos. Older steps and steps further ahead
        are refused at once."""
        key = (request.step, request.digest)
        if key in self._memberships:
            return self._memberships[key]
        newest = max((step for step, _ in self._memberships), default=request.step)
        known = request.signer in self.known
        slots = self._early_known if known else self._early_strangers
        if not newest <= request.step <= newest + 1 or slots.taken >= slots.limit:
            return None
        if known:
            self.wake(request.step)
        slots.taken += 1
        try:
            if not await wait_until(lambda: key in self._memberships, lambda: self._changed, deadline):
                return None
        finally:
            slots.taken -= 1
        return self._memberships.get(key)

    def _check(self, request: RelayRequest, members: Sequence[Member] | None) -> str | None:
        """Why this node will not relay `request`, or None."""
        if members is None:
            return VIEWS_DIFFER + f"this node is in no attempt of step {request.step} with that membership"
        by_key = {member.key: member for member in members}
        sender, receiver = by_key.get(request.sender), by_key.get(request.receiver)
        if sender is None or receiver is None or sender == receiver:
            return "sender and receiver must be two members of the step"
        if not needs_relay(sender, receiver):
            return "one end of that edge can be dialed: it needs no relay"
        chosen = relay_for(request.step, members, sender=request.sender, receiver=request.receiver)
        if chosen is None or chosen.key != self.identity.public_key:
            return "this node is not that edge's relay"
        return None

    async def handle(
        self, first: Frame, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, source: str
    ) -> None:
        """One end's connection, its first frame a relay request: refuse it, or pair and splice it."""
        try:
            request = RelayRequest.parse(first.header)
            if request.relay != self.identity.public_key:
                raise WireError("the request names another relay")
            refusal = self._views_differ(request)  # behind its partner: which waits on for it
            if refusal is None:
                refusal = await self._pair(request, (reader, writer))
                if refusal is None:
                    return
                self._partner_refused(request)
        except WireError as exc:
            refusal = RelayRefusal(reason=str(exc))
        self._refusals.warning("relay request from %s refused: %s", source, refusal.reason)
        with contextlib.suppress(WireError):
            await write_frame(writer, refusal.header(request if refusal.absent else None), timeout=5.0)
        writer.close()

    def _partners(self, request: RelayRequest) -> list[tuple[tuple, RelayRequest, asyncio.Future]]:
        """The other ends of `request`'s edge (same step, pair and lane) waiting here, under any
        attempt or membership: (their edge key, their request, the future that answers them)."""
        return [
            (edge, theirs, future)
            for edge, (theirs, _, future) in self._waiting.items()
            if edge[0] == request.step
            and edge[3:] == request.edge[3:]
            and theirs.role != request.role
            and not future.done()
        ]

    def _views_differ(self, request: RelayRequest) -> RelayRefusal | None:
        """The other end of the same edge waits under another attempt or membership: the two
        elected differently, no one's fault, and they cannot meet. The one behind is told at once,
        with the other's attempt where only the attempts differ (it takes that number next, as
        after a handshake's refusal); the refusal for `request`, where it is the one behind."""
        partners = self._partners(request)
        if any(edge == request.edge for edge, _, _ in partners):
            return None  # its partner waits under the same attempt and membership: they pair
        for edge, theirs, future in partners:
            same_members = theirs.digest == request.digest
            if same_members and theirs.attempt > request.attempt:
                return RelayRefusal(
                    reason=f"{short_id(theirs.signer)} is at attempt {theirs.attempt}",
                    views_differ=True,
                    attempt=theirs.attempt,
                )
            del self._waiting[edge]
            reason = f"{short_id(request.signer)} asked under another attempt or membership"
            future.set_result(
                RelayRefusal(
                    reason=reason, views_differ=True, attempt=request.attempt if same_members else None
                )
            )
        return None

    def _partner_refused(self, request: RelayRequest) -> None:
        """`request` (validly signed by one end) was refused: the other end, if it waits here for
        it, is told now that they will not meet, blaming no one (it did ask)."""
        for edge, _, future in self._partners(request):
            del self._waiting[edge]
            future.set_result(
                RelayRefusal(
                    reason=f"{short_id(request.signer)} asked too, but was refused here", views_differ=True
                )
            )

    async def _pair(self, request: RelayRequest, mine: Stream) -> RelayRefusal | None:
        """None once this end is spliced to its partner (by whichever arrived second), else why not."""
        deadline = time.monotonic() + self.partner_timeout
        if self.admit is not None:
            reason = await self.admit(request, deadline)
        else:
            reason = self._check(request, await self._membership(request, deadline))
        if reason is not None:
            differ = reason.startswith(VIEWS_DIFFER)
            return RelayRefusal(reason=reason.removeprefix(VIEWS_DIFFER), views_differ=differ)
        if request.lane >= self.lanes:
            return RelayRefusal(reason=f"lane {request.lane} of {self.lanes}")
        if sum(theirs.signer == request.signer for theirs, _, _ in self._waiting.values()) >= MAX_PER_SIGNER:
            return RelayRefusal(reason=f"{MAX_PER_SIGNER} requests of that node wait already")
        entry = self._waiting.get(request.edge)
        if entry is not None:
            if entry[0].role == request.role:
                return RelayRefusal(reason="that end of the edge has asked already")
            del self._waiting[request.edge]
            _, theirs, partner = entry
            if self._splices >= MAX_SPLICES:
                partner.set_result(RelayRefusal(reason=f"{MAX_SPLICES} edges are relayed already"))
                return RelayRefusal(reason=f"{MAX_SPLICES} edges are relayed already")
            partner.set_result(None)
            await self._splice(request, theirs, mine)
            return None
        if len(self._waiting) >= MAX_WAITING:
            return RelayRefusal(reason=f"{MAX_WAITING} relay requests wait for their partner already")
        future: asyncio.Future[RelayRefusal | None] = asyncio.get_running_loop().create_future()
        entry = self._waiting[request.edge] = (request, mine, future)
        try:
            # the partner's task runs the splice; this one only hands its stream over
            return await within(asyncio.shield(future), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            if future.done():  # paired just as the deadline passed: the stream is spliced now
                return future.result()
            return RelayRefusal(reason=f"{short_id(request.partner)} {ABSENT}", absent=True)
        finally:
            if self._waiting.get(request.edge) is entry:
                del self._waiting[request.edge]

    async def _splice(self, request: RelayRequest, a: Stream, b: Stream) -> None:
        """Copy bytes both ways until both ends have closed, one fails, or the edge goes idle."""
        self._splices += 1
        self._streams.update((a, b))
        self._none_spliced.clear()
        self.edges_relayed += 1
        last_byte = [time.monotonic()]
        tasks: list[asyncio.Task] = []
        try:
            for _, writer in (a, b):
                await write_frame(writer, {"kind": "relay-ok"}, timeout=5.0)
            pumps = [
                asyncio.create_task(self._pump(a[0], b[1], last_byte)),
                asyncio.create_task(self._pump(b[0], a[1], last_byte)),
            ]
            watch = asyncio.create_task(_idle(last_byte, self.idle_timeout))
            tasks = [*pumps, watch]
            pending: set[asyncio.Task] = set(tasks)
            while not all(pump.done() for pump in pumps):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                failed = [task.exception() for task in done if not task.cancelled()]  # all retrieved
                if watch in done or any(failed):
                    log.info(
                        "relayed edge %s → %s closed: %s",
                        short_id(request.sender),
                        short_id(request.receiver),
                        "idle" if watch in done else "a connection failed",
                    )
                    break
        except WireError:
            pass
        finally:
            self._splices -= 1
            self._streams.difference_update((a, b))
            if not self._splices:
                self._none_spliced.set()
            for task in tasks:
                task.cancel()
            for _, writer in (a, b):
                writer.transport.abort()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, last_byte: list[float]
    ) -> None:
        """Copy one direction until its end closes, then close the other end's writing side."""
        while data := await reader.read(COPY_BYTES):
            await self.cap.take(len(data))
            writer.write(data)
            await writer.drain()
            self.bytes_relayed += len(data)
            last_byte[0] = time.monotonic()
        if writer.can_write_eof():
            writer.write_eof()


async def _idle(last_byte: list[float], timeout: float) -> None:
    """Return once no byte has moved for `timeout` seconds."""
    while (idle := time.monotonic() - last_byte[0]) < timeout:
        await asyncio.sleep(timeout - idle)
