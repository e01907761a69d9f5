"""Serving an aiohttp application (the checkpoint sidecar, the status page) to strangers, within budgets.

Anyone who can reach the port can open connections, and each costs an open file. Without limits,
~1,100 slow connections exhausted a node's 1024 files and killed it. So:

- at most `per_source` connections from one address (more are closed at once, and logged at most
  every 10 s) and `total` in all: when that is full, the oldest connection gives way to the new
  one, so many sources together cannot lock honest clients out either (an interrupted download
  resumes with a Range request);
- a connection must deliver each complete request head within `request_timeout` seconds of
  opening (or of its last response): aiohttp's keep-alive timer closes a connection that is
  waiting for a request, which covers a client trickling its headers byte by byte. A download in
  progress is never cut;
- a request that is not HTTP (junk, a TLS hello on the port, a header line past 8 KiB, a bad
  Content-Length) is answered 400 and logged as one line, at most every 10 s with a count
  (`StrangersLog`): aiohttp's own log wrote a traceback for each, so anyone could fill a node's
  log. An exception of a handler of ours still gets its traceback: that is a bug to see.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from p2ptrain.deadline import within
from p2ptrain.untrusted import ThrottledLog, budget_source

log = logging.getLogger(__name__)

MAX_CONNECTIONS = 256
MAX_CONNECTIONS_PER_SOURCE = 32
REQUEST_TIMEOUT = 10.0


@dataclass(kw_only=True)
class ConnectionBudget:
    total: int = MAX_CONNECTIONS
    per_source: int = MAX_CONNECTIONS_PER_SOURCE
    open: Counter[str] = field(default_factory=Counter)
    refused: int = 0
    evicted: int = 0
    _oldest_first: dict[int, asyncio.BaseTransport] = field(default_factory=dict)

    def admit(self, source: str, transport: asyncio.BaseTransport) -> bool:
        if self.open[source] >= self.per_source:
            self.refused += 1
            return False
        if len(self._oldest_first) >= self.total:
            _, oldest = next(iter(self._oldest_first.items()))
            _abort(oldest)  # its connection_lost releases it
            self._oldest_first.pop(id(oldest), None)
            self.evicted += 1
        self.open[source] += 1
        self._oldest_first[id(transport)] = transport
        return True

    def release(self, source: str, transport: asyncio.BaseTransport) -> None:
        self._oldest_first.pop(id(transport), None)
        self.open[source] -= 1
        if self.open[source] <= 0:
            del self.open[source]


def _abort(transport: asyncio.BaseTransport) -> None:
    if isinstance(transport, asyncio.Transport):
        transport.abort()
    else:
        transport.close()


class _Budgeted(asyncio.Protocol):
    """One connection: handed to aiohttp's handler only if the budget admits its source."""

    def __init__(self, inner: asyncio.Protocol, budget: ConnectionBudget, refusals: ThrottledLog):
        self._inner = inner
        self._budget = budget
        self._refusals = refusals
        self._source: str | None = None
        self._transport: asyncio.BaseTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        source = budget_source(peer)
        if not self._budget.admit(source, transport):
            self._refusals.warning(
                "HTTP connection from %s refused: %d connections open (at most %d per source, %d in all)",
                source,
                self._budget.open[source],
                self._budget.per_source,
                self._budget.total,
            )
            _abort(transport)
            return
        self._source = source
        self._transport = transport
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self._source is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received() if self._source is not None else None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._source is not None and self._transport is not None:
            self._budget.release(self._source, self._transport)
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._source is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._source is not None:
            self._inner.resume_writing()


class StrangersLog(logging.LoggerAdapter):
    """aiohttp's server log for connections anyone may open (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__(logging.getLogger("aiohttp.server"), {})
        self.malformed = ThrottledLog(log)

    def exception(self, msg: object, *args: object, exc_info: Any = True, **kwargs: Any) -> None:
        if isinstance(exc_info, HttpProcessingError):
            reason = " ".join(str(exc_info.message).split())[:200]  # one line, whatever was sent
            self.malformed.warning("%s: %s (%s)", str(msg) % args, type(exc_info).__name__, reason)
            return
        super().exception(msg, *args, exc_info=exc_info, **kwargs)


class Served:
    """A running application: its aiohttp runner and our listening server."""

    def __init__(
        self,
        runner: web.AppRunner,
        server: asyncio.Server,
        budget: ConnectionBudget,
        logs: list[ThrottledLog],
    ):
        self.runner = runner
        self.server = server
        self.budget = budget
        self.logs = logs
        """What strangers did, counted: the last counts are said at close, not lost."""

    async def close(self) -> None:
        self.server.close()
        await self.runner.cleanup()
        with contextlib.suppress(asyncio.TimeoutError):
            await within(self.server.wait_closed(), 5.0)
        for throttled in self.logs:
            throttled.flush()


async def start_app(
    app: web.Application, host: str, *, port: int, budget: ConnectionBudget | None = None
) -> tuple[Served, int]:
    """Serve `app` on `host`:`port` (0: a free one) within `budget`; returns it and the bound port."""
    strangers = StrangersLog()
    runner = web.AppRunner(app, access_log=None, keepalive_timeout=REQUEST_TIMEOUT, logger=strangers)
    await runner.setup()
    assert runner.server is not None, "set up above"
    handler_factory, budget = runner.server, budget or ConnectionBudget()
    refusals = ThrottledLog(log)
    server = await asyncio.get_running_loop().create_server(
        lambda: _Budgeted(handler_factory(), budget, refusals), host, port
    )
    return Served(runner, server, budget, [refusals, strangers.malformed]), int(
        server.sockets[0].getsockname()[1]
    )
