"""Crashed nodes, noticed in about a second instead of at the heartbeat timeout.

A node publishes its data-plane address only once that port listens, and keeps it listening until
it leaves. So a port that *refuses* connections (the kernel answers RST: nobody listens) means the
node's agent is gone — killed, crashed, out of memory — even though its last heartbeat still
looks fresh. A port that accepts, times out or cannot be routed proves nothing: a frozen or
partitioned node still goes by the heartbeat timeout, as before.

The verdict belongs to the address that refused, not to one record: a record refreshed with the
same dead address (a stranger's, republished every half second; a node announcing an address
nobody can reach) stays out. The port is probed again every `interval`, so a node that restarted
on it, or moved to another address, is judged afresh. A node that says it cannot be dialed (behind
NAT) is not probed: a router may answer for its port.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterable

from p2ptrain.comm.net.reach import can_be_dialed
from p2ptrain.comm.reduce.connect import refuses_connections
from p2ptrain.comm.transport.handshake import NONCE_BYTES, hello_header
from p2ptrain.comm.transport.wire import WireError, read_frame, write_frame
from p2ptrain.deadline import within
from p2ptrain.identity import NodeIdentity, short_id
from p2ptrain.swarm.election import parse_address
from p2ptrain.swarm.records import Heartbeat

log = logging.getLogger(__name__)

PROBE_INTERVAL = 0.5
"""Seconds between two probes of the same node."""
PROBE_TIMEOUT = 1.0
PROBE_STEP = 1 << 62
"""The step of a probing hello: far beyond any node's, so a live node refuses it at once."""


async def answers_hello(address: str, identity: NodeIdentity, timeout: float = PROBE_TIMEOUT) -> bool:
    """True when the data port at `address` answers a hello (for a far step: a live node refuses it
    at once) within `timeout`; False for a port that refuses, never answers, or is unreachable, and
    for an answer "our views differ": no honest node elected members for a step nobody is at (it
    has no attempt to compare with), so that answer to every hello is a liar's, or a broken node's."""
    parsed = parse_address(address)
    if parsed is None:
        return False
    writer = None
    try:
        reader, writer = await within(asyncio.open_connection(*parsed), timeout)
        hello = hello_header(
            identity,
            PROBE_STEP,
            digest=bytes(32),
            nonce=secrets.token_bytes(NONCE_BYTES),
            ephemeral=bytes(32),
        )
        await write_frame(writer, hello, timeout=timeout)
        answer = await read_frame(reader, timeout, 4096)
    except (OSError, asyncio.TimeoutError, WireError):
        return False
    finally:
        if writer is not None:
            writer.close()
    return not (answer.kind == "refuse" and answer.header.get("views_differ") is True)


async def port_refuses(address: str, timeout: float = PROBE_TIMEOUT) -> bool:
    """True only when a TCP connection to `address` is actively refused (nobody listens there)."""
    parsed = parse_address(address)
    return parsed is not None and await refuses_connections(*parsed, timeout)


class CrashWatch:
    """Probes the data ports of the nodes a step waits for; `alive` leaves out those that refused."""

    def __init__(
        self,
        interval: float = PROBE_INTERVAL,
        timeout: float = PROBE_TIMEOUT,
        *,
        on_crash: Callable[[Heartbeat, str], None] | None = None,
    ):
        self.interval = interval
        self.timeout = timeout
        self.on_crash = on_crash
        """Told of each node found gone, with why (a node's roster logs it once); else a log line."""
        self._crashed: dict[bytes, str] = {}
        """node key → the data address that refused connections."""
        self._last_probe: dict[bytes, float] = {}
        self._running: dict[bytes, asyncio.Task[None]] = {}

    def alive(self, beats: Iterable[Heartbeat]) -> list[Heartbeat]:
        """`beats` without the nodes whose port refuses connections."""
        return [beat for beat in beats if self._crashed.get(beat.node_key) != beat.data_addr]

    def watch(self, beats: Iterable[Heartbeat]) -> None:
        """Probe these nodes in the background (each at most once per `interval`)."""
        now = time.monotonic()
        for beat in beats:
            if (
                not can_be_dialed(beat.data_reach)  # behind NAT: its port proves nothing either way
                or beat.node_key in self._running
                or now - self._last_probe.get(beat.node_key, -1e9) < self.interval
            ):
                continue
            self._last_probe[beat.node_key] = now
            self._running[beat.node_key] = asyncio.create_task(self._probe(beat))

    async def probe_now(self, beats: Iterable[Heartbeat]) -> None:
        """Probe these nodes and wait for the answers (bounded by the probe timeout)."""
        beats = list(beats)
        for beat in beats:
            self._last_probe.pop(beat.node_key, None)
        self.watch(beats)
        running = [self._running[b.node_key] for b in beats if b.node_key in self._running]
        if running:
            await asyncio.wait(running, timeout=self.timeout + 0.5)

    async def _probe(self, beat: Heartbeat) -> None:
        try:
            refused = await port_refuses(beat.data_addr, self.timeout)
            known = self._crashed.get(beat.node_key) == beat.data_addr
            if refused and not known:
                why = f"crashed: its data port {beat.data_addr} refuses connections"
                if self.on_crash is not None:
                    self.on_crash(beat, why)
                else:
                    log.warning("%s is gone (%s)", short_id(beat.node_key), why)
                self._crashed[beat.node_key] = beat.data_addr
            elif not refused and known:
                log.info("%s: its data port takes connections again", short_id(beat.node_key))
                del self._crashed[beat.node_key]
        finally:
            self._running.pop(beat.node_key, None)

    def close(self) -> None:
        for task in self._running.values():
            task.cancel()
        self._running.clear()
