"""`--dashboard PORT`: the swarm's status page, served by any node or by the bootstrap peer.

The server reads the run's signed heartbeats from the DHT every `interval` seconds and keeps, in
memory, each node's outer-step losses and the tokens it said it contributed (from its heartbeats),
so the page can draw loss curves and count tokens that outlive the nodes; and the last reading in
which a node was live, which the page shows, marked as such, once every node has left. Routes:

    GET /             the page (static HTML + JS, no external assets: works offline)
    GET /api/status   {"run", "access", "authority", "progress", "nodes", "last_ring", "checkpoint",
                       "live", "updated", "last_known": {...} | null, "history": {id: [[step, loss]]}}
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from importlib import resources
from typing import Any

from aiohttp import web

from p2ptrain.swarm.records import TOKENS_TOTAL_FIELD, Heartbeat, NodeState, record_count, record_number
from p2ptrain.swarm.status import status_json
from p2ptrain.untrusted import decimal
from p2ptrain.web.server import Served, start_app

log = logging.getLogger(__name__)
MAX_POINTS = 5000
"""Loss points kept per node: enough for long runs, bounded for a page polled forever."""
MAX_NODES = 256
"""Nodes whose curves and token counts are kept, those seen last: keys are free in an open run,
and a stranger's 100 000 once held 56 MB here and made every poll of the page 8 MB."""
LAST_KNOWN = ("nodes", "last_ring", "checkpoint", "progress")
"""What the page keeps of the last reading with a live node, to show once all have left."""


class Dashboard:
    def __init__(
        self,
        read: Callable[[], Awaitable[list[Heartbeat]]],
        run_id: str,
        *,
        interval: float = 1.0,
        authority: bytes | None = None,
    ):
        self.read = read
        self.run_id = run_id
        self.authority = authority
        self.interval = interval
        self.status: dict[str, Any] = status_json([], run_id=run_id, authority=authority)
        self.history: dict[str, dict[int, float]] = {}
        self.tokens: dict[str, int] = {}
        """Node → the most tokens it said it contributed (the run's total counts those that left)."""
        self.updated = 0.0
        self.ring: dict[str, Any] | None = None
        """The ring of the latest step with the most members seen (for `last_known`)."""
        self.last_known: dict[str, Any] | None = None
        """The last reading in which a node was live, and when (`seen_at`)."""
        self._served: Served | None = None
        self._poller: asyncio.Task[None] | None = None
        self._page = resources.files("p2ptrain.web").joinpath("dashboard.html").read_text()
        app = web.Application()
        app.router.add_get("/", self._index)
        app.router.add_get("/api/status", self._api)
        self._app = app

    async def start(self, host: str, port: int) -> int:
        self._served, bound = await start_app(self._app, host, port=port)
        self._poller = asyncio.create_task(self._poll())
        return bound

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._served is not None:
            await self._served.close()

    def observe(self, heartbeats: list[Heartbeat]) -> None:
        """Take in one reading of the heartbeats."""
        status = status_json(heartbeats, run_id=self.run_id, authority=self.authority)
        self.updated = time.time()
        for beat in heartbeats:
            node = beat.node_key.hex()
            loss = record_number(beat.extra.get("loss"))
            if beat.params_hash and loss is not None:
                points = self.history.pop(node, {})
                self.history[node] = points  # the last seen go last; the first are dropped below
                points[beat.outer_step - 1] = loss
                while len(points) > MAX_POINTS:
                    points.pop(min(points))
            tokens = record_count(beat.extra.get(TOKENS_TOTAL_FIELD))
            if tokens is not None:
                self.tokens[node] = max(self.tokens.pop(node, 0), tokens)  # the last seen go last
        for kept in (self.history, self.tokens):
            while len(kept) > MAX_NODES:
                del kept[next(iter(kept))]
        status["progress"]["tokens"] = sum(self.tokens.values())
        ring = status["last_ring"]
        if ring is not None and (self.ring is None or _size(ring) >= _size(self.ring)):
            self.ring = ring
        live = sum(1 for beat in heartbeats if beat.state is not NodeState.DEAD)
        status["live"] = live
        if live:
            # the ring of the last step as its members completed it: one that left since (its
            # deathrattle) is no longer in the records' ring, yet took part in that step
            last = {key: status[key] for key in LAST_KNOWN} | {"last_ring": self.ring}
            self.last_known = last | {"seen_at": self.updated}
        self.status = status

    async def _poll(self) -> None:
        while True:
            try:
                self.observe(await self.read())
            except Exception as exc:  # the page shows the last good reading; the next poll retries
                log.warning("dashboard: reading the heartbeats failed: %s", exc)
            await asyncio.sleep(self.interval)

    async def _index(self, request: web.Request) -> web.Response:
        return web.Response(text=self._page, content_type="text/html")

    async def _api(self, request: web.Request) -> web.Response:
        history = {node: sorted(points.items()) for node, points in self.history.items()}
        # once nobody is live: what the page last saw of the run, which it shows marked as such
        last_known = self.last_known if not self.status.get("live") else None
        return web.json_response(
            {**self.status, "updated": self.updated, "last_known": last_known, "history": history}
        )


def _size(ring: dict[str, Any]) -> tuple[int, int]:
    """A ring's step, then its member count: a later step wins, then the fuller ring of one step."""
    return ring["step"], len(ring["members"])


def parse_dashboard_address(text: str) -> tuple[str, int]:
    """'PORT' (on 127.0.0.1) or 'HOST:PORT' → (host, port); ValueError with the reason."""
    host, _, port_text = text.rpartition(":")
    port = decimal(port_text, 5)
    if port is None or not 0 < port < 65536:
        raise ValueError(f"--dashboard {text}: expected PORT or HOST:PORT with a port in 1-65535")
    return (host.strip("[]") or "127.0.0.1"), port


async def serve_dashboard(
    address: str,
    read: Callable[[], Awaitable[list[Heartbeat]]],
    *,
    run_id: str,
    out: Any,
    authority: bytes | None = None,
) -> Dashboard:
    """Start the status page at `address`; says where it is. `authority`: the run's, if closed."""
    host, port = parse_dashboard_address(address)
    dashboard = Dashboard(read, run_id, authority=authority)
    try:
        bound = await dashboard.start(host, port)
    except OSError as exc:
        from p2ptrain.errors import NetworkError

        raise NetworkError(f"--dashboard {address}: cannot listen there ({exc.strerror or exc})") from None
    print(f"status page: http://{host}:{bound}/", file=out, flush=True)
    return dashboard
