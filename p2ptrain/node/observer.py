"""The watcher (`p2ptrain watch`): a node that trains nothing.

It joins the DHT (one more peer to keep records), publishes its signed heartbeat every
`heartbeat_interval`, prints the swarm table from time to time, can serve the status page, and
sends its deathrattle when it is told to stop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TextIO

from p2ptrain.config import Config
from p2ptrain.deadline import pause
from p2ptrain.identity import NodeIdentity
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.membership import HeartbeatPublisher, SwarmView
from p2ptrain.swarm.records import NodeState
from p2ptrain.swarm.status import format_table

log = logging.getLogger(__name__)


async def run_node(
    config: Config,
    identity: NodeIdentity,
    *,
    dht: SwarmDHT,
    stop: asyncio.Event,
    out: TextIO,
    table_every: float = 10.0,
) -> None:
    """Heartbeat until `stop` is set, then send the deathrattle (bounded by the DHT timeout)."""
    publisher = HeartbeatPublisher.for_run(dht, identity, config)
    view = SwarmView.for_run(dht, config)
    print(
        f"node {identity.short_id} joined run {config.run.id!r} as DHT peer {dht.peer_id}",
        file=out,
        flush=True,
    )
    next_table = time.monotonic() + min(table_every, 2 * config.swarm.heartbeat_interval)
    page = None
    if config.node.dashboard:
        from p2ptrain.web.dashboard import serve_dashboard

        page = await serve_dashboard(
            config.node.dashboard,
            view.read,
            run_id=config.run.id,
            out=out,
            authority=config.run.authority_key,
        )
    try:
        while not stop.is_set():
            if not await publisher.publish(state=NodeState.IDLE):
                log.warning("heartbeat not stored by any DHT peer; retrying")
            if table_every > 0 and time.monotonic() >= next_table:
                next_table = time.monotonic() + table_every
                print(format_table(await view.read()), file=out, flush=True)
            await pause(stop, config.swarm.heartbeat_interval)
    finally:
        if page is not None:
            await page.close()
        try:
            sent = await publisher.deathrattle()
        except Exception as exc:  # best effort: the swarm falls back to the heartbeat timeout
            log.warning("deathrattle not sent: %s", exc)
            sent = False
        outcome = "deathrattle sent" if sent else "deathrattle not confirmed; peers will time it out"
        print(f"node {identity.short_id} left the swarm ({outcome})", file=out, flush=True)
