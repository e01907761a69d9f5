"""Starting an aiohttp application on a host and port (0: a free one), for the sidecar and the page."""

from __future__ import annotations

from aiohttp import web


async def start_app(app: web.Application, host: str, port: int) -> tuple[web.AppRunner, int]:
    """Serve `app`; returns its runner (to clean up) and the port it listens on."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    return runner, int(runner.addresses[0][1])  # (host, port[, …]) of the bound socket
