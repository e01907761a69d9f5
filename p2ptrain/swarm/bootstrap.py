"""A bootstrap peer: a long-lived DHT node that trains nothing and only lets others find each other."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TextIO

import multiaddr

from p2ptrain.identity import ensure_p2p_identity
from p2ptrain.swarm.dht import DHTSettings, SwarmDHT
from p2ptrain.swarm.records import HeartbeatValidator

DEFAULT_LISTEN = "/ip4/0.0.0.0/tcp/31337"


def start_bootstrap_dht(
    identity: Path, listen: list[str], announce: list[str], shutdown_timeout: float = 5.0
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


def join_line(addresses: list[str]) -> str:
    """The command a node operator copies; prefers a public (non-loopback) address."""

    def rank(address: str) -> int:
        host = multiaddr.Multiaddr(address).protocols()[0].name
        loopback = "/127." in address or address.startswith("/ip6/::1/")
        return (2 if loopback else 0) + (1 if host == "ip6" else 0)

    best = sorted(addresses, key=rank)[0]
    return f"p2ptrain join --peer {best}      (or: PEER={best} p2ptrain join)"


async def serve_bootstrap(
    dht: SwarmDHT,
    stop: asyncio.Event,
    out: TextIO,
    dashboard: str | None = None,
    run_id: str = "",
    authority: bytes | None = None,
) -> None:
    addresses = dht.visible_maddrs()
    print(f"bootstrap peer {dht.peer_id} is up; visible multiaddresses:", file=out)
    for address in addresses:
        print(f"  {address}", file=out)
    if addresses:
        print("join it with:", file=out)
        print(f"  {join_line(addresses)}", file=out)
    out.flush()
    page = None
    if dashboard:
        from p2ptrain.config import SwarmConfig
        from p2ptrain.swarm.membership import SwarmView
        from p2ptrain.web.dashboard import serve_dashboard

        # the default timeout: the bootstrap peer serves every run and reads no run's config
        view = SwarmView(dht, run_id, SwarmConfig().heartbeat_timeout, authority=authority)
        page = await serve_dashboard(dashboard, view.read, run_id, out)
    try:
        await stop.wait()
    finally:
        if page is not None:
            await page.close()
