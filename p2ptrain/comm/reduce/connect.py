"""Dialing the members of an attempt: every lane out, every lane in, authenticated (handshake.py).
A lane kept from an earlier step is re-bound first (transport/resume.py); where that fails for any
reason, a fresh dial follows, whose answer counts.

The listening side is net/server.py; allreduce.py runs the transfer over what this returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from p2ptrain.comm.net.attempt import AllReduceError, Connection, LaneKey, Registration, StreamConnection
from p2ptrain.comm.net.members import Member
from p2ptrain.comm.net.relay import RelayRefused, Role, Route, needs_relay, open_relayed, route
from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.comm.reduce.schedule import Schedule
from p2ptrain.comm.transport import resume
from p2ptrain.comm.transport.handshake import (
    AttemptBehind,
    Credentials,
    HandshakeError,
    PeerBusy,
    ViewsDiffer,
    dial,
)
from p2ptrain.comm.transport.lanes import on_own_thread
from p2ptrain.comm.transport.resume import WarmLane
from p2ptrain.comm.transport.wire import (
    PeerTimeout,
    WireError,
    expect,
    read_frame,
    stream_transport,
    write_frame,
)
from p2ptrain.deadline import within
from p2ptrain.identity import NodeIdentity, short_id

log = logging.getLogger(__name__)
REFUSED_GRACE = 1.0
"""Seconds a refused or failed connect is retried before the member counts as gone."""
BUSY_RETRY_MAX = 0.5
"""Longest pause between dials to a member still in an earlier attempt (within setup_timeout)."""
GONE_PROBE_INTERVAL = 0.5
"""While a member's lane is awaited: seconds between probes of its port (one that refuses is gone)."""
DIALS_CANCEL_S = 1.0
"""An attempt that ends waits this long at most for its cancelled dials to end."""


async def refuses_connections(host: str, port: int, timeout: float = 1.0) -> bool:
    """True only when a TCP connection to host:port is actively refused (nobody listens there).

    A member listens on its published port until it leaves, so a refusal says its process is gone;
    a port that accepts, times out or cannot be routed proves nothing."""
    try:
        _, writer = await within(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


async def _open(
    identity: NodeIdentity, member: Member, *, setup_timeout: float, failure_timeout: float, via: Route | None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP stream to `member`: direct, or through the relay of `via` (relay.py)."""
    if via is None:
        return await within(asyncio.open_connection(member.host, member.port), failure_timeout)
    relay, request = via
    try:
        return await open_relayed(identity, relay, request=request, timeout=setup_timeout)
    except RelayRefused as exc:
        if exc.attempt is not None:
            raise AttemptBehind(str(exc), exc.attempt) from None
        raise _relay_failed(exc, relay) from None
    except WireError as exc:
        raise _relay_failed(exc, relay) from None


def _relay_failed(exc: WireError, relay: Member) -> AllReduceError:
    """What an end makes of a relay that would not pair it. A refusal names no one: "absent" is the
    relay's word alone (a partner that really died goes by its heartbeat), and "views differ"
    blames no one anyway; a relay that cannot be reached or does not answer is named."""
    if isinstance(exc, RelayRefused):
        return AllReduceError(str(exc), None, views_differ=exc.views_differ)
    return AllReduceError(str(exc), relay.key)


async def dial_member(
    identity: NodeIdentity,
    member: Member,
    *,
    step: int,
    digest: bytes,
    setup_timeout: float,
    failure_timeout: float,
    lane: int = 0,
    attempt: int = 0,
    via: Route | None = None,
    credentials: Credentials | None = None,
) -> StreamConnection:
    """Connect and authenticate lane `lane` of attempt `attempt` to `member` (through the relay of
    `via`, where neither of us can be dialed).

    A member publishes its address only once its server listens, so a refused connection means
    it is gone: that is retried only briefly (REFUSED_GRACE), not for the whole setup deadline. A
    member still in an earlier attempt of the step (PeerBusy) is dialed again until setup_timeout.
    A silent peer costs failure_timeout.
    """
    started = time.monotonic()
    refused_deadline = started + min(setup_timeout, REFUSED_GRACE)
    busy_deadline = started + setup_timeout
    refused_delay, busy_delay = 0.05, 0.02
    while True:
        try:
            reader, writer = await _open(
                identity, member, setup_timeout=setup_timeout, failure_timeout=failure_timeout, via=via
            )
        except (OSError, asyncio.TimeoutError) as exc:
            if time.monotonic() + refused_delay > refused_deadline:
                raise AllReduceError(
                    f"cannot connect to {short_id(member.key)} at {member.host}:{member.port}: {exc}",
                    member.key,
                ) from None
            await asyncio.sleep(refused_delay)
            refused_delay = min(refused_delay * 2, 1.0)
            continue
        try:
            session = await dial(
                reader,
                writer,
                identity=identity,
                expected_peer=member.key,
                step=step,
                digest=digest,
                timeout=setup_timeout,
                lane=lane,
                attempt=attempt,
                credentials=credentials,
                answer_timeout=failure_timeout,
            )
        except PeerTimeout as exc:
            writer.close()
            # through a relay: the partner had just asked for the edge, so the relay let it down
            silent = member.key if via is None else via[0].key
            raise AllReduceError(
                f"{short_id(member.key)} did not answer the handshake: {exc}", silent
            ) from None
        except ViewsDiffer as exc:
            writer.close()
            raise AllReduceError(f"step {step}: {exc}", views_differ=True, refuser=member.key) from None
        except PeerBusy as exc:
            writer.close()
            if time.monotonic() + busy_delay > busy_deadline:
                raise AllReduceError(
                    f"step {step}: {exc} for {setup_timeout:.0f} s", out_of_step=True, refuser=member.key
                ) from None
            await asyncio.sleep(busy_delay)
            busy_delay = min(busy_delay * 2, BUSY_RETRY_MAX)
            continue
        except BaseException:
            writer.close()
            raise
        return reader, writer, session


def sender_dials(sender: Member, receiver: Member) -> bool:
    """Who dials the connection that carries `sender`'s frames to `receiver`: the sender, unless
    only the sender can be dialed (the receiver is behind NAT: connection reversal). Both ends
    derive this from the same member list, so they agree without talking."""
    return receiver.reachable or not sender.reachable


Slot = tuple[int, int]
"""(peer index, lane) of one connection we send or receive frames on."""


@dataclass(frozen=True, kw_only=True)
class LanePlan:
    """Which of one member's connections it dials and which it waits for, in handshake lanes: lane
    l < M (comm.connections) carries the dialer's frames, lane M + l the listener's (reversed)."""

    dial_to_send: list[Slot]
    dial_to_receive: list[Slot]
    await_to_send: list[Slot]
    await_to_receive: list[Slot]

    @classmethod
    def of(cls, members: Sequence[Member], schedule: Schedule) -> LanePlan:
        plan, me = (
            cls(dial_to_send=[], dial_to_receive=[], await_to_send=[], await_to_receive=[]),
            members[schedule.index],
        )
        for peer in schedule.out_peers():
            target = plan.dial_to_send if sender_dials(me, members[peer]) else plan.await_to_send
            target.extend((peer, lane) for lane in range(schedule.lanes))
        for peer in schedule.in_peers():
            target = plan.await_to_receive if sender_dials(members[peer], me) else plan.dial_to_receive
            target.extend((peer, lane) for lane in range(schedule.lanes))
        return plan

    def incoming_lanes(self, members: Sequence[Member], lanes: int) -> list[LaneKey]:
        """(peer key, handshake lane) of every connection that peers dial to us."""
        return [(members[peer].key, lane) for peer, lane in self.await_to_receive] + [
            (members[peer].key, lanes + lane) for peer, lane in self.await_to_send
        ]


async def connect_lanes(
    server: DataPlaneServer,
    *,
    members: Sequence[Member],
    plan: LanePlan,
    registration: Registration,
    step: int,
    digest: bytes,
    connections: list[Connection],
    standby: Sequence[Member] = (),
    failure_timeout: float,
) -> tuple[dict[Slot, Connection], dict[Slot, Connection]]:
    """Dial the lanes `plan` says we dial and wait for the others; every connection lands in
    `connections`. Returns the ones we send on and the ones we receive on, by (peer, lane).
    `standby`: relays for edges between members behind NAT where no member can relay;
    `failure_timeout`: the attempt's (from its paths: net/paths.py); the set-up waits at least as
    long (a node's is the larger of comm.failure_timeout and the heartbeat timeout: data_server.py)."""
    setup_timeout = max(server.setup_timeout, failure_timeout)
    lanes = server.comm.connections
    me = next(member for member in members if member.key == server.identity.public_key)
    paired: dict[LaneKey, bytes] = {}
    """Relayed lanes into us that the relay paired: a hello that never came then names the relay."""

    def relayed(sender: Member, receiver: Member, lane: int, role: Role) -> Route | None:
        """The relay of an edge neither end of which can be dialed; None for every other edge."""
        if not needs_relay(sender, receiver):
            return None
        try:
            return route(
                step,
                registration.attempt,
                digest=digest,
                members=members,
                sender=sender.key,
                receiver=receiver.key,
                lane=lane,
                role=role,
                standby=standby,
            )
        except WireError as exc:
            raise AllReduceError(str(exc)) from None

    async def dial_one(peer: int, lane: int) -> tuple[Slot, Connection]:
        via = relayed(me, members[peer], lane, "send")
        warm = server.warm.take(members[peer].key, lane) if via is None else None
        if warm is not None and (rebound := await rebind(warm)) is not None:
            connections.append(rebound)
            return (peer, lane % lanes), rebound
        try:
            connection = await dial_member(
                server.identity,
                members[peer],
                step=step,
                digest=digest,
                setup_timeout=setup_timeout,
                failure_timeout=failure_timeout,
                lane=lane,
                attempt=registration.attempt,
                via=via,
                credentials=server.credentials,
            )
        except AttemptBehind as exc:
            server.learn_attempt(step, exc.attempt)
            raise AllReduceError(f"step {step}: {exc}", out_of_step=True) from None
        except HandshakeError as exc:  # a plain no, or not the peer it should be
            peer_key = members[peer].key
            raise AllReduceError(f"step {step}: {short_id(peer_key)}: {exc}", refuser=peer_key) from None
        connections.append(connection)
        if lane >= lanes:
            await _send_go(connection, failure_timeout)
        slot: Slot = (peer, lane % lanes)
        return slot, connection

    async def rebind(warm: WarmLane) -> WarmLane | None:
        """`warm` re-bound to this attempt (resume.py); None where that failed, for whatever
        reason: the lane is closed, and a fresh dial (whose answer counts) follows."""
        try:
            request = functools.partial(
                resume.request,
                warm,
                step=step,
                attempt=registration.attempt,
                digest=digest,
                answer_timeout=failure_timeout,
                setup_timeout=setup_timeout,
            )
            rebound = await on_own_thread(request, f"p2ptrain-rebind-{step}")
        except (WireError, OSError) as exc:  # HandshakeError among them
            log.info(
                "kept lane to %s not re-bound (%s): dialing afresh", short_id(warm.session.peer_key), exc
            )
            warm.close()
            return None
        except asyncio.CancelledError:
            warm.close()
            raise
        server.warm.rebound += 1
        return rebound

    async def incoming(peer: int, lane: int, deadline: float) -> tuple[Slot, Connection]:
        """The lane `peer` dials to us; a member that crashed meanwhile is not waited for."""
        member = members[peer]
        future = registration.incoming[(member.key, lane)]
        while (remaining := deadline - time.monotonic()) > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                connection = await within(asyncio.shield(future), min(remaining, GONE_PROBE_INTERVAL))
                connections.append(connection)
                return (peer, lane % lanes), connection
            # behind NAT its port proves nothing (a router may answer for it)
            if member.reachable and not future.done() and await refuses_connections(member.host, member.port):
                raise AllReduceError(
                    f"{short_id(member.key)} is gone: its data port {member.host}:{member.port} refuses "
                    "connections",
                    member.key,
                )
        # one that dialed and was refused elected other members: alive, not to be blamed
        heard = member.key in registration.heard
        blamed = None if heard else member.key
        if needs_relay(member, me):  # the relay paired us (it had the peer's request) or said why not
            blamed = paired.get((member.key, lane))
        raise AllReduceError(
            f"{short_id(member.key)} did not connect within {setup_timeout:.0f} s",
            blamed,
            views_differ=heard,
        )

    async def open_door(peer: int, lane: int, via: Route) -> None:
        """A relayed edge into us: keep a stream open at its relay for the peer's handshake, which
        our server answers, until the lane is ours (or the attempt ends)."""
        future = registration.incoming[(members[peer].key, lane)]
        pause = 0.05
        while not future.done():
            try:
                relay, request = via
                reader, writer = await open_relayed(
                    server.identity, relay, request=request, timeout=setup_timeout
                )
            except WireError as exc:
                if isinstance(exc, RelayRefused) and exc.attempt is not None:
                    server.learn_attempt(step, exc.attempt)
                error = _relay_failed(exc, via[0])
            else:
                paired[(members[peer].key, lane)] = via[0].key
                await server.serve_relayed(reader, writer)
                await asyncio.sleep(pause)  # the handshake failed: the peer dials again (bounded)
                pause = min(2 * pause, 1.0)
                continue
            if not future.done():
                future.set_exception(error)

    async def connect_all() -> tuple[dict[Slot, Connection], dict[Slot, Connection]]:
        dialed = await asyncio.gather(*sending_dials, *receiving_dials)
        sending = dict(dialed[: len(sending_dials)])
        receiving = dict(dialed[len(sending_dials) :])
        deadline = time.monotonic() + setup_timeout
        for peer, lane in plan.await_to_receive:
            slot, connection = await incoming(peer, lane, deadline)
            receiving[slot] = connection
        for peer, lane in plan.await_to_send:
            slot, connection = await incoming(peer, lanes + lane, deadline)
            if not isinstance(connection, WarmLane):  # a kept lane has no asyncio stream to read ahead
                await _await_go(connection, failure_timeout)
            sending[slot] = connection
        return sending, receiving

    routes = [
        (peer, lane, relayed(members[peer], me, lane, "accept")) for peer, lane in plan.await_to_receive
    ]
    doors = [asyncio.create_task(open_door(peer, lane, via)) for peer, lane, via in routes if via is not None]
    sending_dials = [asyncio.create_task(dial_one(peer, lane)) for peer, lane in plan.dial_to_send]
    receiving_dials = [
        asyncio.create_task(dial_one(peer, lanes + lane)) for peer, lane in plan.dial_to_receive
    ]
    try:
        return await registration.unless_abandoned(connect_all())
    finally:
        # awaited, so no dial adds a connection after the attempt has closed `connections`
        tasks = [task for task in sending_dials + receiving_dials + doors if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=DIALS_CANCEL_S)


async def _send_go(connection: StreamConnection, timeout: float) -> None:
    """A reversed lane, dialer side (it receives): stop asyncio reading first, then let the
    listener send. Its frames then wait in the kernel for the raw socket (lanes.detach); frames
    sent before would have been swallowed by asyncio's read-ahead."""
    _, writer, _ = connection
    stream_transport(writer).pause_reading()
    await write_frame(writer, {"kind": "go"}, timeout=timeout)


async def _await_go(connection: StreamConnection, timeout: float) -> None:
    """A reversed lane, listener side (it sends): wait for the dialer's go (see `_send_go`)."""
    reader, writer, _ = connection
    transport = stream_transport(writer)
    transport.resume_reading()  # the dialer sends nothing after its go, so nothing is read ahead
    try:
        expect(await read_frame(reader, timeout, 0), "go")
    except WireError as exc:
        raise AllReduceError(f"reversed lane from {short_id(connection[2].peer_key)}: {exc}") from None
    finally:
        transport.pause_reading()
