"""A bootstrap peer: a long-lived DHT node that trains nothing and only lets others find each other."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import multiaddr

from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.config import MAX_CONNECTIONS, CommConfig, SwarmConfig
from p2ptrain.deadline import pause
from p2ptrain.identity import NodeIdentity
from p2ptrain.swarm.dht import DHTSettings, SwarmDHT
from p2ptrain.swarm.membership import HeartbeatPublisher, SwarmView, keep_alive
from p2ptrain.swarm.p2p_key import ensure_p2p_identity
from p2ptrain.swarm.records import NodeState
from p2ptrain.swarm.roster import STEPS_EVERY, Roster
from p2ptrain.swarm.standby import RunEnds
from p2ptrain.swarm.validator import HeartbeatValidator
from p2ptrain.untrusted import ThrottledLog

log = logging.getLogger(__name__)
DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/31337"


def start_bootstrap_dht(
    identity: Path, listen: list[str], *, announce: list[str], shutdown_timeout: float = 5.0
) -> SwarmDHT:
    """Start the DHT with the persistent libp2p key in `identity`, so the address survives restarts."""
    p2p_key = ensure_p2p_identity(identity)
    settings = DHTSettings(
        listen=listen,
        announce=announce,
        p2p_key=p2p_key,
        retries=1,
        shutdown_timeout=shutdown_timeout,
        # Serves every run: verifies anything that claims to be a heartbeat, whatever its run.
        validators=(HeartbeatValidator(),),
    )
    return SwarmDHT.start(settings)


def join_line(addresses: list[str], join: str = "") -> str:
    """The command a node operator copies; prefers a public (non-loopback) address. `join`: the
    run's flags (its config, run id, authority)."""

    def rank(address: str) -> int:
        host = multiaddr.Multiaddr(address).protocols()[0].name
        loopback = "/127." in address or address.startswith("/ip6/::1/")
        return (2 if loopback else 0) + (1 if host == "ip6" else 0)

    best = sorted(addresses, key=rank)[0]
    run = f" {join}" if join else ""
    return f"p2ptrain join --peer {best}{run}      (or: PEER={best} p2ptrain join{run})"


@dataclass(frozen=True, kw_only=True)
class RelayOptions:
    """`bootstrap --relay`: where the standby relay listens, what it announces, its cap, and the
    node key (and, in a closed run, the ticket) its record is signed with."""

    identity: NodeIdentity
    host: str
    port: int
    announce_host: str
    mbps: float = 100.0
    ticket: bytes = b""


RELAY_RECORD_INTERVAL = 5.0
"""Seconds between two stores of the relay's record (it lives SwarmConfig.record_lifetime)."""


async def serve_relay(
    dht: SwarmDHT,
    options: RelayOptions,
    *,
    run_id: str,
    authority: bytes | None,
    stop: asyncio.Event,
    out: TextIO,
) -> None:
    """Relay the edges between `run_id`'s nodes behind NAT where no member can, and answer their
    reachability probes (swarm/standby.py), until `stop`; then withdraw the record."""
    # the run's settings are not known here: any lane count a run may use
    server = DataPlaneServer(
        identity=options.identity,
        comm=CommConfig(connections=MAX_CONNECTIONS),
        relay_mbps=options.mbps,
        relay_admit=RunEnds(dht, run_id, authority).check,
    )
    try:
        _, port = await server.start(options.host, options.port)
    except OSError as exc:
        from p2ptrain.errors import NetworkError

        raise NetworkError(
            f"--relay {options.host}:{options.port}: cannot listen there ({exc.strerror or exc})"
        ) from None
    host = options.announce_host
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    swarm = SwarmConfig()
    publisher = HeartbeatPublisher(
        dht, options.identity, run_id=run_id, ttl=swarm.record_lifetime, ticket=options.ticket
    )
    await publisher.publish(state=NodeState.RELAY, data_addr=address, data_reach="open")
    print(
        f"standby relay for run {run_id!r} at {address} (key {options.identity.node_id}, "
        f"at most {options.mbps:g} Mbit/s)",
        file=out,
        flush=True,
    )
    try:
        await keep_alive(publisher, RELAY_RECORD_INTERVAL, stop)
    finally:
        with contextlib.suppress(Exception):  # nodes stop choosing it before its record expires
            await publisher.publish(timeout=2.0, data_addr="")
        await server.close()
        relay = server.relay
        print(
            f"standby relay: {relay.edges_relayed} edges, {relay.bytes_relayed} bytes relayed",
            file=out,
            flush=True,
        )


async def serve_bootstrap(
    dht: SwarmDHT,
    stop: asyncio.Event,
    *,
    out: TextIO,
    dashboard: str | None = None,
    run_id: str = "",
    authority: bytes | None = None,
    relay: RelayOptions | None = None,
    join: str = "",
) -> None:
    """Serve as a bootstrap peer until `stop` (a status page and a standby relay for `run_id` on
    request); `join`: the run's flags for the join line it prints."""
    addresses = dht.visible_maddrs()
    print(f"bootstrap peer {dht.peer_id} is up; visible multiaddresses:", file=out)
    for address in addresses:
        print(f"  {address}", file=out)
    if addresses:
        print(f"join run {run_id!r} with:", file=out)
        print(f"  {join_line(addresses, join)}", file=out)
        if authority is not None:
            print(
                "  (a closed run: each node also needs --set node.ticket=TICKET, from p2ptrain admit)",
                file=out,
            )
    out.flush()
    # the default timeout: the bootstrap peer serves every run and reads no run's config
    view = SwarmView(dht, run_id, timeout=SwarmConfig().heartbeat_timeout, authority=authority)
    view.roster = Roster(
        run_id,
        timeout=SwarmConfig().heartbeat_timeout,
        say=lambda line: print(f"{time.strftime('%H:%M:%S')} {line}", file=out, flush=True),
        steps_every=STEPS_EVERY,
    )
    watcher = asyncio.create_task(watch_run(view, stop))
    page = None
    if dashboard:
        from p2ptrain.web.dashboard import serve_dashboard

        page = await serve_dashboard(dashboard, view.read, run_id=run_id, out=out, authority=authority)
    try:
        if relay is not None:
            await serve_relay(dht, relay, run_id=run_id, authority=authority, stop=stop, out=out)
        else:
            await stop.wait()
    finally:
        watcher.cancel()
        if page is not None:
            await page.close()


RUN_WATCH_INTERVAL = 2.0
"""Seconds between two reads of the run's records by a bootstrap peer, for the lines it prints
about joins, leaves and steps (a read of the status page's within the last second serves too)."""


async def watch_run(view: SwarmView, stop: asyncio.Event) -> None:
    """Read `view`'s run every RUN_WATCH_INTERVAL until `stop`: its roster says who joined and
    left, and how far the run got (at most one steps line per roster.STEPS_EVERY)."""
    failures = ThrottledLog(log)
    while not stop.is_set():
        try:
            await view.read(cached=True)
        except Exception as exc:  # the next read may do: the lines are advice, the peer serves on
            failures.warning("reading the records of run %r failed: %s", view.run_id, exc)
        await pause(stop, RUN_WATCH_INTERVAL)
