"""The data plane's listening server (dialing: reduce/connect.py).

Every node listens on one TCP port. For each all-reduce step the reduction (reduce/allreduce.py)
tells the server which peers may connect and under which membership digest; the server
authenticates each incoming connection (transport/handshake.py) and hands it to the waiting step.
Peers that dial before this node has reached the step wait (bounded) instead of being refused.

Each try of a step is an attempt with a number (see handshake.py). The server keeps, per step, the
lowest number the next attempt may take: one past the last attempt here, or the highest a peer has
shown. A peer at a later attempt abandons ours at once (its connection into ours is gone, so ours
cannot succeed) and dials again into our next; a peer at an earlier one is refused with ours. So the
members of a step converge on one attempt instead of failing each other's dying attempts in turn.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Collection, Sequence

from p2ptrain.comm.net.attempt import Connection, LaneKey, Registration
from p2ptrain.comm.net.budget import (
    MAX_PROVING,
    MAX_PROVING_PER_SOURCE,
    CountingReader,
    Parked,
    ParkingLot,
    PendingBudget,
    Tickets,
    WaitingBudget,
    unread_bytes,
    wait_until,
)
from p2ptrain.comm.net.members import Member
from p2ptrain.comm.net.paths import PathBook
from p2ptrain.comm.net.reach import REACH_KINDS, ReachService
from p2ptrain.comm.net.record_push import HELD, NOT_HELD, RECORD_KIND, RecordSink, receive_record
from p2ptrain.comm.net.relay import RELAY_KINDS
from p2ptrain.comm.net.relay_service import RelayAdmit, RelayService
from p2ptrain.comm.net.warm import WarmLanes
from p2ptrain.comm.transport import lanes, resume
from p2ptrain.comm.transport.handshake import (
    MAX_HANDSHAKE_FRAME,
    Admission,
    Credentials,
    HandshakeError,
    Refusal,
    Session,
    ViewsDiffer,
    accept_any,
    check_member,
    refusal_fields,
)
from p2ptrain.comm.transport.wire import ClosedBetweenFrames, FrameError, WireError, read_frame, write_frame
from p2ptrain.config import CommConfig
from p2ptrain.deadline import within
from p2ptrain.identity import NodeIdentity, short_id
from p2ptrain.untrusted import ThrottledLog, budget_source

log = logging.getLogger(__name__)
KEPT_STEPS = 4
"""Steps whose next attempt number the server remembers (older ones cannot come back)."""
RELAY_DRAIN_S = 1.0
"""How long a closing server lets the edges it relays finish."""
ANSWER_CUT_S = 1.0
"""How long a closing server waits for the tasks of the connections it cut to end (each time)."""
MAX_ATTEMPT_JUMP = 8
"""How far ahead of ours a learned attempt number may take us at once (members converge in steps)."""
MAX_STEPS_AHEAD = 1
"""A hello for a step further ahead of this node's own is refused at once (a member dials only once
this node published ready for that step; one step of slack for a dialer that registered first)."""


class DataPlaneServer:
    """A node's listening socket; hands each incoming ring connection to the step that expects it.
    `credentials`: a closed run's tickets, shown and checked in every handshake. `relay_admit`: a
    standby relay's server, which probes and relays and refuses every hello (it is in no step)."""

    def __init__(
        self,
        *,
        identity: NodeIdentity,
        comm: CommConfig,
        setup_timeout: float = 30.0,
        relay_mbps: float = 100.0,
        relay_admit: RelayAdmit | None = None,
        credentials: Credentials | None = None,
    ):
        """`comm`: the run's data-plane settings; `setup_timeout`: how long members may take to
        arrive at a step and connect (a node sets it from the heartbeat timeout)."""
        self.identity = identity
        self.credentials = credentials
        self.comm = comm
        self.setup_timeout = setup_timeout
        self.relay_only = relay_admit is not None
        self._server: asyncio.Server | None = None
        self._expected: dict[int, Registration] = {}
        self._next_attempt: dict[int, int] = {}
        self._changed = asyncio.Event()
        self._latest_step = -1
        self._completed_step = -1
        self.pending = PendingBudget(parking=ParkingLot())
        """Connections before their hello; the idle ones that give way are parked (budget.py)."""
        self.proving = PendingBudget(total=MAX_PROVING, per_source=MAX_PROVING_PER_SOURCE)
        self.waiting = WaitingBudget()
        # one throttle per kind, so a flood of one kind never hides the other from the log
        self._refusals = ThrottledLog(log)
        self._over_cap = ThrottledLog(log)
        self._drops = ThrottledLog(log)
        self.address: tuple[str, int] = ("", 0)
        self.reach = ReachService()
        """Dial-back probes (reach.py): answered here, and our own proofs collected here."""
        self.relay = RelayService(
            identity=identity,
            mbps=relay_mbps,
            lanes=comm.connections,
            setup_timeout=setup_timeout,
            failure_timeout=comm.failure_timeout,
            wake=self._wake,
            admit=relay_admit,
        )
        """Edges between members behind NAT that this node splices (relay.py)."""
        self._dialed = asyncio.Event()
        self._woken_for = -1
        self.on_record: RecordSink | None = None
        """Where pushed records go (record_push.py); None: they are read and dropped."""
        self.lanes_accepted = 0
        """Ring connections handed to a step so far (benchmarks.scale counts them per step)."""
        self._answering: dict[asyncio.Task[None], asyncio.StreamWriter] = {}
        """Incoming connections still being answered (a handshake, a probe, a relayed edge)."""
        self.warm = WarmLanes(rebind=self._rebind, read_timeout=comm.failure_timeout)
        """Lanes kept from steps that succeeded, for the next (transport/resume.py)."""
        self.paths = PathBook()
        """Round trips and rates of our lanes to each peer, from the all-reduces: an attempt's
        deadline grows with its slowest path (paths.py)."""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        loop = asyncio.get_running_loop()

        def connection() -> asyncio.StreamReaderProtocol:  # asyncio.start_server's, counting bytes
            return asyncio.StreamReaderProtocol(CountingReader(loop=loop), self._on_connection, loop=loop)

        self._server = await loop.create_server(connection, host, port)
        self.address = self._server.sockets[0].getsockname()[:2]
        return self.address

    @property
    def pending_handshakes(self) -> int:
        """Incoming connections that have not sent their hello yet."""
        return len(self.pending)

    def at_step(
        self, step: int, candidates: Collection[bytes] = (), known: Collection[bytes] | None = None
    ) -> None:
        """This node works on `step` now, with these nodes ready for it as far as it knows: their
        hellos may wait for us, and hellos for steps beyond it are refused at once. `known`: the
        live nodes of the run we know of (relay requests of theirs may wait for us too)."""
        self._latest_step = max(self._latest_step, step)
        self.waiting.candidates = frozenset(candidates)
        if known is not None:
            self.relay.known = frozenset(known)

    def _wake(self, step: int) -> None:
        """A member dials us for our step before we registered it: it has decided its election,
        so ours should read the records again now (`dialed`). Once per step: a crowd of hellos,
        or a stranger's, wakes it once."""
        if step == self._latest_step and step != self._woken_for:
            self._woken_for = step
            self._dialed.set()

    async def dialed(self, timeout: float) -> None:
        """Return when the first hello for our step arrived before we registered the step (a
        member has decided its election and dials us: read the records again now), or after
        `timeout`. A wake that came since the last call returns at once, once."""
        with contextlib.suppress(asyncio.TimeoutError):
            await within(self._dialed.wait(), timeout)
        self._dialed.clear()

    async def close(self) -> None:
        # the edges it relays may still carry a step's last frames; a node stops within seconds
        await self.relay.drained(min(self.comm.failure_timeout, RELAY_DRAIN_S))
        self.relay.abort()
        if self._server is not None:
            self._server.close()
        if self.pending.parking is not None:  # before waiting: they hold no task, nothing ends them
            self.pending.parking.close_all()
        if self._server is not None:
            await self._server.wait_closed()
        await self._cut_answers()
        self.warm.close()
        for registration in self._expected.values():
            for future in registration.incoming.values():
                if not future.done():
                    future.cancel()
        for refusals in (self._refusals, self._over_cap, self._drops):
            refusals.flush()  # what a flood's last seconds did, counted, not lost

    async def _cut_answers(self) -> None:
        """Cut the connections still being answered and end their tasks, so that their peers learn
        at once that this node is gone: a hello waiting for a step would otherwise hold its dialer
        until setup_timeout. Twice at most: Python 3.11's wait_for can lose a cancellation that
        meets a frame just read, and the answer then goes on (its writes and reads fail now)."""
        for _ in range(2):
            if not self._answering:
                return
            for task, writer in list(self._answering.items()):
                writer.transport.abort()
                task.cancel()
            await asyncio.wait(list(self._answering), timeout=ANSWER_CUT_S)

    def expect(
        self,
        step: int,
        peers: Collection[bytes],
        *,
        digest: bytes,
        lanes: Collection[LaneKey] | None = None,
        members: Sequence[Member] = (),
    ) -> Registration:
        """Register an attempt of step `step`: one future per expected (peer, lane) — by default
        every lane of every peer in `peers` — resolved with its authenticated connection. Lanes
        count up to twice comm.connections: the upper half are reversed (connect.LanePlan).
        `members` (all of the attempt's): the edges between those behind NAT this node relays."""
        loop = asyncio.get_running_loop()
        count = self.comm.connections
        if lanes is None:
            lanes = [(key, lane) for key in peers for lane in range(count)]
        futures = {lane: loop.create_future() for lane in lanes}
        attempt = self._next_attempt.get(step, 0)
        allowed = {key for key, _ in futures}
        registration = Registration(
            attempt=attempt, admission=Admission(allowed, digest, 2 * count), incoming=futures
        )
        self._expected[step] = registration
        if members:
            self.relay.allow(step, digest, members)
        self.learn_attempt(step, attempt)
        self._latest_step = max(self._latest_step, step)
        self._dialed.clear()  # a hello that came after our election is no news for the next one
        self._changed.set()
        self._changed = asyncio.Event()
        return registration

    def forget(self, step: int) -> None:
        registration = self._expected.pop(step, None)
        if registration is not None:
            self.learn_attempt(step, registration.attempt + 1)

    def learn_attempt(self, step: int, attempt: int) -> None:
        """The next attempt of `step` here takes at least number `attempt` — at most MAX_ATTEMPT_JUMP
        past ours: a number a peer (or a relay) claims cannot send the step where no one can follow."""
        current = self._next_attempt.get(step, 0)
        self._next_attempt[step] = max(current, min(attempt, current + MAX_ATTEMPT_JUMP))
        for old in sorted(self._next_attempt)[:-KEPT_STEPS]:
            del self._next_attempt[old]

    def completed(self, step: int) -> None:
        """The all-reduce of `step` succeeded here: dials for it (or older) are refused at once."""
        self._completed_step = max(self._completed_step, step)

    def _known(self, step: int) -> Admission | None:
        """The admission of `step` if it is registered; HandshakeError for a step that is over
        here or far ahead (refused before the handshake signs anything); else None (it may come)."""
        registration = self._expected.get(step)
        if registration is not None:
            return registration.admission
        if self.relay_only:
            raise HandshakeError("this node only relays and probes: it is a member of no step")
        if step < self._latest_step or step <= self._completed_step:
            raise HandshakeError(f"step {step} is not a step this node is reducing")
        if self._latest_step >= 0 and step > self._latest_step + MAX_STEPS_AHEAD:
            raise HandshakeError(f"step {step} is far ahead of this node's step {self._latest_step}")
        return None

    async def _admission(self, step: int, key: bytes) -> Admission | None:
        """Wait (bounded) for the local node to reach `step`: a fast peer may dial before we get
        there. `key` is proven (handshake.accept_any)."""
        if self._known(step) is not None:
            return self._heard(step, key)
        if not self.waiting.may_wait(key):
            raise HandshakeError(f"{self.waiting.strangers} connections already wait for step {step}")
        stranger = key not in self.waiting.candidates
        self.waiting.waiting_strangers += stranger
        self._wake(step)
        try:
            deadline = time.monotonic() + self.setup_timeout
            if not await wait_until(lambda: step in self._expected, lambda: self._changed, deadline):
                return None
        finally:
            self.waiting.waiting_strangers -= stranger
        return self._heard(step, key)

    def _heard(self, step: int, key: bytes) -> Admission:
        registration = self._expected[step]
        # only members are asked after: strangers' proven keys once filled a bounded set and hid them
        if key in registration.admission.allowed:
            registration.heard.add(key)
        return registration.admission

    def _claim(self, session: Session) -> Refusal | None:
        """None when the attempt registered now for the session's step takes this connection."""
        step, attempt = session.step, session.attempt
        registration = self._expected.get(step)
        if registration is None or registration.admission.digest != session.digest:
            return Refusal(f"no attempt of step {step} with that membership is open here now", retry=True)
        if attempt > registration.attempt:
            self.learn_attempt(step, attempt)
            registration.abandon(f"step {step}: {short_id(session.peer_key)} is at attempt {attempt}")
            return Refusal(f"still in attempt {registration.attempt} of step {step}", retry=True)
        if attempt < registration.attempt:
            return Refusal(f"attempt {attempt} of step {step} is over here", attempt=registration.attempt)
        lane = (session.peer_key, session.lane)
        if lane in registration.claimed:
            return Refusal(f"lane {session.lane} of attempt {attempt} is taken here")
        registration.claimed.add(lane)
        return None

    async def _on_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """asyncio's task for one incoming connection. Cancelled when the node's event loop shuts
        down, it ends quietly: Python 3.11's stream callback would log a traceback for it."""
        task = asyncio.current_task()
        assert task is not None
        self._answering[task] = writer
        try:
            await self._serve(reader, writer)
        except asyncio.CancelledError:
            writer.transport.abort()
        finally:
            del self._answering[task]

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) and peer else "?"
        counted_as = budget_source(peer)  # an IPv6 /64 as one source

        def spoke() -> bool:
            return (isinstance(reader, CountingReader) and reader.received > 0) or unread_bytes(writer) > 0

        at_share = self.pending.held_by(counted_as) >= self.pending.per_source
        ticket = self.pending.enter(counted_as, writer, spoke, reader)
        if ticket is None:
            self._over_cap.warning(
                "data-plane connection from %s refused: %d of its handshakes already pending",
                source,
                self.pending.per_source,
            )
            writer.transport.abort()
            return
        if at_share:
            self._over_cap.warning(
                "data-plane connection from %s: %d of its handshakes pending, its oldest idle one set aside",
                source,
                self.pending.per_source,
            )
        try:
            await self._answer(reader, writer, source=source, ticket=ticket, counted_as=counted_as)
        finally:
            self.pending.leave(ticket)

    async def serve_relayed(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Our end of a relayed edge that carries a peer's frames to us (relay.py): its handshake
        comes in through the relay and is answered as if it had been dialed here directly."""
        await self._answer(reader, writer, source="relay", ticket=None, relayed=True)

    async def _answer(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        *,
        source: str,
        ticket: int | None,
        relayed: bool = False,
        counted_as: str | None = None,
    ) -> None:
        """Read the first frame and serve what it asks: a probe, a relay, or a ring lane's handshake.
        `counted_as`: whom the connection counts against in the budgets (`source` if None)."""
        tickets = Tickets(
            pending=self.pending,
            proving=self.proving,
            source=counted_as or source,
            writer=writer,
            ticket=ticket,
        )

        def peek(step: int) -> Admission | None:
            known = self._known(step)
            if known is not None and not tickets.awaiting_proof():
                raise HandshakeError(
                    f"{self.proving.per_source} hellos from {source} already await their proof"
                )
            return known

        async def resolve(step: int, key: bytes) -> Admission | None:
            tickets.proven()  # an early dialer holds its slot for one round trip
            return await self._admission(step, key)

        try:
            first = await read_frame(reader, self.comm.failure_timeout, MAX_HANDSHAKE_FRAME)
            if relayed and first.kind in REACH_KINDS | RELAY_KINDS | {RECORD_KIND}:
                raise WireError(f"a {first.kind!r} frame through a relay (only a handshake comes that way)")
            if first.kind == RECORD_KIND:
                # a pushed record holds its pending slot until it is read: the budget bounds them
                record = await receive_record(reader, self.comm.failure_timeout)
                held = self.on_record is not None and self.on_record(record, source)
                await write_frame(
                    writer, {"kind": HELD if held else NOT_HELD}, timeout=self.comm.failure_timeout
                )
                writer.close()
                return
            if first.kind in REACH_KINDS or first.kind in RELAY_KINDS:
                tickets.hello_read()
                service = self.reach if first.kind in REACH_KINDS else self.relay
                await service.handle(first, reader, writer, source)
                return
            session = await accept_any(
                reader,
                writer,
                identity=self.identity,
                resolve=resolve,
                timeout=self.comm.failure_timeout,
                claim=self._claim,
                log_refusal=lambda reason: self._refusals.warning(
                    "refused data-plane connection: %s", reason
                ),
                first=first,
                peek=peek,
                credentials=self.credentials,
            )
        except Parked:
            return  # it gave way to a newer connection of its source and is held open, unread
        except HandshakeError:
            writer.close()  # refused, and logged, by the handshake
            return
        except ClosedBetweenFrames:
            # connected and closed without a byte: a port probe (the crash watch's, a NAT check's,
            # a scanner's): nothing to warn about, and at 16 nodes hundreds a minute
            log.debug("data-plane connection from %s closed before its hello", source)
            writer.close()
            return
        except WireError as exc:
            self._drops.warning("data-plane connection from %s dropped in its handshake: %s", source, exc)
            writer.close()
            return
        finally:
            tickets.proven()  # or refused, or gone

        if not self._hand_over(session, (reader, writer, session)):
            writer.close()  # the attempt ended while "ok" was on its way

    def _hand_over(self, session: Session, connection: Connection) -> bool:
        """Give an accepted lane (handshaken or re-bound) to the attempt that waits for it; False
        when that attempt has ended meanwhile (the caller closes the lane)."""
        registration = self._expected.get(session.step)
        future = None
        if registration is not None and registration.attempt == session.attempt:
            future = registration.incoming.get((session.peer_key, session.lane))
        if future is None or future.done():
            return False
        self.lanes_accepted += 1
        future.set_result(connection)
        return True

    async def _rebind(self, lane: resume.WarmLane, header: dict) -> None:
        """A rebind on a lane a peer dialed and both ends kept (warm.py): answered as that peer's
        handshake would be once its key is proven (`_answer`), in one round trip; the lane goes to
        the step, or is closed with the reason sent."""
        peer, timeout = lane.session.peer_key, self.comm.failure_timeout
        try:
            asked = resume.parse_request(lane, header)
            if self._known(asked.step) is None:  # we have not reached the step: say so, then wait
                await self._tell(lane, {"kind": resume.HELD})
            admission = await self._admission(asked.step, peer)
            if admission is None:
                raise HandshakeError(f"step {asked.step} is not a step this node is reducing")
            number = lane.session.lane
            check_member(
                admission, self.identity, peer=peer, step=asked.step, lane=number, digest=asked.digest
            )
            wanted = dataclasses.replace(
                lane.session, step=asked.step, attempt=asked.attempt, digest=asked.digest
            )
            refusal = self._claim(wanted)
            if refusal is not None:
                log.info("sent %s to another attempt: %s", short_id(peer), refusal.reason)
                await self._tell(lane, {"kind": resume.REFUSE, **refusal_fields(refusal)})
                lane.close()
                return
            accept = functools.partial(resume.accept, lane, asked, timeout)
            rebound = await lanes.on_own_thread(accept, "p2ptrain-rebind")
        except (HandshakeError, FrameError) as exc:
            self._refusals.warning("refused the rebind of a kept lane: %s", exc)
            refuse = {
                "kind": resume.REFUSE,
                "reason": str(exc)[:200],
                "views_differ": isinstance(exc, ViewsDiffer),
            }
            with contextlib.suppress(WireError, OSError):
                await self._tell(lane, refuse)
            lane.close()
            return
        except (WireError, OSError) as exc:
            self._drops.warning("kept lane from %s dropped in its rebind: %s", short_id(peer), exc)
            lane.close()
            return
        except asyncio.CancelledError:
            lane.close()
            raise
        if not self._hand_over(rebound.session, rebound):
            rebound.close()  # the attempt ended while "ok" was on its way
            return
        self.warm.rebound += 1

    async def _tell(self, lane: resume.WarmLane, header: dict) -> None:
        """One frame on a kept lane, from a thread of its own (a peer that does not read holds it)."""
        send = functools.partial(lane.send, header, self.comm.failure_timeout)
        await lanes.on_own_thread(send, "p2ptrain-rebind")
