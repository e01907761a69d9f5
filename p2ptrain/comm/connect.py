"""Dialing the members of an attempt: every lane out, every lane in, authenticated (handshake.py).

The listening side is dataplane.py's server; ring.py runs the transfer over what this returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence

from p2ptrain.comm.dataplane import (
    AllReduceError,
    Connection,
    DataPlaneServer,
    Registration,
    RingMember,
    RingSettings,
)
from p2ptrain.comm.handshake import AttemptBehind, PeerBusy, dial
from p2ptrain.comm.wire import PeerTimeout
from p2ptrain.identity import NodeIdentity, short_id

REFUSED_GRACE = 1.0
"""Seconds a refused or failed connect is retried before the member counts as gone."""
BUSY_RETRY_MAX = 0.5
"""Longest pause between dials to a member still in an earlier attempt (within setup_timeout)."""
GONE_PROBE_INTERVAL = 0.5
"""While a member's lane is awaited: seconds between probes of its port (one that refuses is gone)."""


async def refuses_connections(host: str, port: int, timeout: float = 1.0) -> bool:
    """True only when a TCP connection to host:port is actively refused (nobody listens there).

    A member listens on its published port until it leaves, so a refusal says its process is gone;
    a port that accepts, times out or cannot be routed proves nothing."""
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
    except ConnectionRefusedError:
        return True
    except (OSError, asyncio.TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return False


async def dial_member(
    identity: NodeIdentity,
    member: RingMember,
    step: int,
    digest: bytes,
    settings: RingSettings,
    lane: int = 0,
    attempt: int = 0,
) -> Connection:
    """Connect and authenticate lane `lane` of attempt `attempt` to `member`.

    A member publishes its address only once its server listens, so a refused connection means
    it is gone: that is retried only briefly (REFUSED_GRACE), not for the whole setup deadline. A
    member still in an earlier attempt of the step (PeerBusy) is dialed again until setup_timeout.
    """
    started = time.monotonic()
    refused_deadline = started + min(settings.setup_timeout, REFUSED_GRACE)
    busy_deadline = started + settings.setup_timeout
    refused_delay, busy_delay = 0.05, 0.02
    while True:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(member.host, member.port), settings.failure_timeout
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
                reader, writer, identity, member.key, step, digest, settings.setup_timeout, lane, attempt
            )
        except PeerTimeout as exc:
            writer.close()
            raise AllReduceError(
                f"{short_id(member.key)} did not answer the handshake: {exc}", member.key
            ) from None
        except PeerBusy as exc:
            writer.close()
            if time.monotonic() + busy_delay > busy_deadline:
                raise AllReduceError(f"step {step}: {exc} for {settings.setup_timeout:.0f} s") from None
            await asyncio.sleep(busy_delay)
            busy_delay = min(busy_delay * 2, BUSY_RETRY_MAX)
            continue
        except BaseException:
            writer.close()
            raise
        return reader, writer, session


async def connect_lanes(
    server: DataPlaneServer,
    members: Sequence[RingMember],
    out_peers: Sequence[int],
    registration: Registration,
    step: int,
    digest: bytes,
    connections: list[Connection],
) -> dict[tuple[int, int], Connection]:
    """Dial every lane to every out-peer and wait for every lane of every in-peer; all connections
    land in `connections`. Returns the outgoing ones by (peer, lane)."""
    settings = server.settings

    async def dial_one(peer: int, lane: int) -> tuple[tuple[int, int], Connection]:
        try:
            connection = await dial_member(
                server.identity, members[peer], step, digest, settings, lane, registration.attempt
            )
        except AttemptBehind as exc:
            server.learn_attempt(step, exc.attempt)
            raise AllReduceError(f"step {step}: {exc}") from None
        connections.append(connection)
        return (peer, lane), connection

    by_key = {member.key: member for member in members}

    async def incoming(key: bytes, future: asyncio.Future[Connection], deadline: float) -> Connection:
        """The lane `key` dials to us; a member that crashed meanwhile is not waited for."""
        while (remaining := deadline - time.monotonic()) > 0:
            with contextlib.suppress(asyncio.TimeoutError):
                return await asyncio.wait_for(asyncio.shield(future), min(remaining, GONE_PROBE_INTERVAL))
            member = by_key[key]
            if not future.done() and await refuses_connections(member.host, member.port):
                raise AllReduceError(
                    f"{short_id(key)} is gone: its data port {member.host}:{member.port} refuses connections",
                    key,
                )
        # one that dialed and was refused elected other members: alive, not to be blamed
        heard = key in registration.heard
        raise AllReduceError(
            f"{short_id(key)} did not connect within {settings.setup_timeout:.0f} s",
            None if heard else key,
            views_differ=heard,
        )

    async def connect_all() -> dict[tuple[int, int], Connection]:
        outgoing = dict(await asyncio.gather(*dials))
        deadline = time.monotonic() + settings.setup_timeout
        for (key, _), future in registration.incoming.items():
            connections.append(await incoming(key, future, deadline))
        return outgoing

    dials = [
        asyncio.create_task(dial_one(peer, lane))
        for peer in out_peers
        for lane in range(settings.connections)
    ]
    try:
        return await registration.unless_abandoned(connect_all())
    finally:
        for task in dials:
            task.cancel()
