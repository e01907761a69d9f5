"""Which address this node announces, and whether others can dial it (kept in its signed record).

A node listening on every interface (data_host 0.0.0.0, the default) with no `data_announce` used to
announce 127.0.0.1, which no other machine can use. It now announces the address of the interface
that routes to its bootstrap peer, and then the address its peers observe, once one of them has
dialed it back there (comm/reach.py). The probe runs once the node sees peers, again every
`RECHECK_SECONDS` (sooner while nobody could answer), and its result is the record's `data_reach`:
"closed" makes the others let this node dial its connections itself (connect.sender_dials).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import socket
import time
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

from p2ptrain.comm.net.reach import ProbeResult, Reach, can_be_dialed
from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.config import Config
from p2ptrain.deadline import pause
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.election import parse_address
from p2ptrain.swarm.membership import HeartbeatPublisher, SwarmView, live
from p2ptrain.swarm.records import NodeState
from p2ptrain.swarm.standby import StandbyRelays

log = logging.getLogger(__name__)

PROBERS = 3
"""Peers asked at once; any one whose dial-back arrives proves the port open."""
STANDBY_PROBERS = 2
"""Standby relays (bootstrap --relay) asked besides the peers."""
RECHECK_SECONDS = 60.0
UNKNOWN_RETRY_SECONDS = 5.0
FIRST_PROBE_SECONDS = 10.0
"""Before its first step a node asks again, a second apart, this long while nobody answered."""
WILDCARD_HOSTS = ("0.0.0.0", "", "::")
_NO_ROUTE_TARGET = "192.0.2.1"
"""TEST-NET-1: a UDP 'connect' to it sends nothing, but picks the interface of the default route."""


def outbound_ip(peers: list[str]) -> str:
    """The local address of the interface that routes to the first bootstrap peer (or to the
    default route); 127.0.0.1 when there is none."""
    targets = [_multiaddr_ip(peer) for peer in peers] + [_NO_ROUTE_TARGET]
    for target in targets:
        if not target:
            continue
        family = socket.AF_INET6 if ":" in target else socket.AF_INET
        with contextlib.suppress(OSError), socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((target, 9))
            return str(probe.getsockname()[0])
    return "127.0.0.1"


def _multiaddr_ip(maddr: str) -> str:
    parts = maddr.split("/")
    for index, part in enumerate(parts[:-1]):
        if part in ("ip4", "ip6"):
            return parts[index + 1]
    return ""


def data_address(config: Config, port: int) -> str:
    """What this node announces for its data plane before any peer has observed it."""
    node = config.node
    if node.data_announce:
        return node.data_announce
    host = node.data_host
    if host in WILDCARD_HOSTS:
        host = outbound_ip(list(config.swarm.peers))
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Reachability:
    """Probes this node's data port with the help of live peers and publishes what it learned."""

    def __init__(
        self,
        config: Config,
        server: DataPlaneServer,
        *,
        publisher: HeartbeatPublisher,
        view: SwarmView,
        dht: SwarmDHT,
        standby: StandbyRelays | None = None,
    ):
        self.config = config
        self.standby = standby
        self.dht = dht
        self.server = server
        self.publisher = publisher
        self.view = view
        self.port = server.address[1]
        self.result = ProbeResult(Reach.UNKNOWN)
        self._asked = False
        """Whether the last probe had anyone to ask."""
        self._switch: asyncio.Task[None] | None = None

    async def first_probe(self) -> ProbeResult:
        """The probe before this node's first step: `until_answered`. A node behind NAT that
        enters a step as dialable loses it: its peers dial the private address it announced."""
        return await until_answered(self.probe_once, lambda: self._asked, FIRST_PROBE_SECONDS)

    async def probe_once(self) -> ProbeResult:
        """Ask up to PROBERS peers; publish the result (and the observed address) if it changed."""
        me = self.publisher.current.node_key
        beats = [
            beat
            for beat in live(await self.view.read())
            if beat.node_key != me
            and beat.state not in (NodeState.LEAVING, NodeState.DEAD)
            and can_be_dialed(beat.data_reach)
            and parse_address(beat.data_addr) is not None
        ]
        # a different handful per asker, the same on every try: spreads the probing load
        beats.sort(key=lambda beat: hashlib.sha256(me + beat.node_key).digest())
        probers = [address for beat in beats[:PROBERS] if (address := parse_address(beat.data_addr))]
        # standby relays probe too: in a swarm of nodes behind NAT alone nobody else could answer
        relays = await self.standby.current() if self.standby is not None else []
        probers += [(relay.host, relay.port) for relay in relays[:STANDBY_PROBERS]]
        ckpt_addr = self.publisher.current.ckpt_addr
        self._asked = bool(probers)
        result = await self.server.reach.probe(probers, self.port, _port_of(ckpt_addr))
        changes: dict[str, Any] = {}
        if result.reach is not Reach.UNKNOWN and result.reach.value != self.publisher.current.data_reach:
            changes["data_reach"] = result.reach.value
            level = logging.INFO if result.reach is Reach.OPEN else logging.WARNING
            log.log(level, "data port %s: %s", self.publisher.current.data_addr, _said(result.reach))
        if result.ckpt is not Reach.UNKNOWN and result.ckpt.value != self.publisher.current.ckpt_reach:
            changes["ckpt_reach"] = result.ckpt.value
            level = logging.INFO if result.ckpt is Reach.OPEN else logging.WARNING
            said = "reachable from outside" if result.ckpt is Reach.OPEN else "not reachable from outside"
            log.log(level, "checkpoint sidecar %s: %s", ckpt_addr, said)
        if result.reach is Reach.CLOSED and not self.dht.settings.client_mode and self._switch is None:
            # nobody can dial it: no one's routing table should hold it. In the background: a DHT
            # takes seconds to start, and the node's first steps do not wait for it
            self._switch = asyncio.create_task(self._become_client())
        announced = self._observed_address(result)
        if announced and announced != self.publisher.current.data_addr:
            log.info("announcing data plane at %s (the address peers see)", announced)
            changes["data_addr"] = announced
        if changes:
            await self.publisher.publish(**changes)
        self.result = result
        return result

    async def _become_client(self) -> None:
        try:
            if await self.dht.become_client():
                await self.publisher.publish(peer_id=self.dht.peer_id)
        except Exception as exc:  # advice, like the probe: never let it end the node
            log.warning("the DHT stays a full peer: %s", exc)

    def _observed_address(self, result: ProbeResult) -> str | None:
        if result.observed is None or self.config.node.data_announce:
            return None
        if self.config.node.data_host not in WILDCARD_HOSTS:
            return None  # it listens on one interface only: that is its address
        host = result.observed
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def run(self, stop: asyncio.Event) -> None:
        """Probe again every RECHECK_SECONDS (UNKNOWN_RETRY_SECONDS while unknown) until `stop`."""
        while not stop.is_set():
            delay = RECHECK_SECONDS if self.result.reach is not Reach.UNKNOWN else UNKNOWN_RETRY_SECONDS
            await pause(stop, delay)
            if not stop.is_set():
                try:
                    await self.probe_once()
                except Exception as exc:  # a probe is advice: never let it end the node
                    log.warning("reachability probe failed: %s", exc)


async def until_answered(
    probe: Callable[[], Awaitable[ProbeResult]], asked: Callable[[], bool], seconds: float
) -> ProbeResult:
    """`probe()` again, a second apart, while it had probers (`asked()`) and none answered (one
    busy with a probe of another node of this network refuses), for up to `seconds` and one probe
    more (each is bounded by reach.ASK_TIMEOUT)."""
    deadline = time.monotonic() + seconds
    result = await probe()
    while result.reach is Reach.UNKNOWN and asked() and time.monotonic() + 1.0 < deadline:
        await asyncio.sleep(1.0)
        result = await probe()
    return result


def _port_of(url: str) -> int | None:
    """The TCP port of a sidecar URL (http://host:port), None where there is none."""
    try:
        return urllib.parse.urlsplit(url).port if url else None
    except ValueError:
        return None


def _said(reach: Reach) -> str:
    if reach is Reach.OPEN:
        return "reachable from outside (a peer dialed it back)"
    return "not reachable from outside (behind NAT or a firewall): this node dials its connections itself"
