"""What the commands share: config resolution, argument checks, and running until a signal."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from p2ptrain.config import Config, load_config
from p2ptrain.errors import UserError


def resolve_config(args: argparse.Namespace, options: dict[str, tuple[str, Any]] | None = None) -> Config:
    """The config `--config`, `--set` and the environment make, then `options`: config key →
    (flag, value) of a command's own flags, for those given (not None, not empty)."""
    given = [
        (key, value, flag) for key, (flag, value) in (options or {}).items() if value not in (None, [], "")
    ]
    return load_config(args.config, overrides=list(getattr(args, "overrides", [])), options=given)


def peers_of(args: argparse.Namespace, config: Config) -> list[str]:
    from p2ptrain.swarm.maddr import parse_peers

    given = (
        list(args.peer)
        or ([os.environ["PEER"]] if os.environ.get("PEER") else [])
        or list(config.swarm.peers)
    )
    return parse_peers(given)


def validate_listen(addresses: list[str]) -> list[str]:
    import multiaddr

    for address in addresses:
        try:
            multiaddr.Multiaddr(address)
        except Exception as exc:
            raise UserError(f"malformed listen/announce multiaddress '{address}': {exc}") from None
    return addresses


def validate_dashboard(address: str | None) -> None:
    if address:
        from p2ptrain.web.dashboard import parse_dashboard_address

        try:
            parse_dashboard_address(address)
        except ValueError as exc:
            raise UserError(str(exc)) from None


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def address_file_writer(address_file: str | None, addresses: Callable[[], list[str]]) -> Callable[[], None]:
    """What `--address-file` does once the process handles its signals: whoever waits for the file
    may then stop the process with SIGTERM and get a clean shutdown, not the default death."""

    def write() -> None:
        if address_file:
            write_atomic(Path(address_file), "\n".join(addresses()) + "\n")

    return write


SLOW_STOP = 2.0
"""A shutdown that takes longer than this many seconds says where the time went."""


class StopClock:
    """When the first signal came, so a slow shutdown can say which part took the time."""

    def __init__(self) -> None:
        self.signalled: float | None = None
        self.parts: list[str] = []

    def mark(self, part: str) -> None:
        if self.signalled is not None:
            self.parts.append(f"{part} at {time.monotonic() - self.signalled:.1f} s")

    def report(self) -> None:
        if self.signalled is not None and time.monotonic() - self.signalled > SLOW_STOP:
            self.mark("done")
            print(f"slow shutdown: {', '.join(self.parts)} after the signal", file=sys.stderr, flush=True)


def run_until_signal(
    main: Callable[[asyncio.Event], Coroutine[Any, Any, None]],
    on_force: Callable[[], None],
    *,
    clock: StopClock | None = None,
    on_ready: Callable[[], None] = lambda: None,
) -> None:
    """Run `main(stop)`; the first SIGINT/SIGTERM sets `stop`, a second one forces the shutdown.
    `on_ready` runs once the signal handlers are in place."""
    clock = clock or StopClock()

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()

        def request_stop(signum: int) -> None:
            if stop.is_set():
                print("second signal: forcing shutdown", file=sys.stderr, flush=True)
                on_force()
                os._exit(128 + signum)
            print(f"received {signal.Signals(signum).name}, shutting down…", file=sys.stderr, flush=True)
            clock.signalled = time.monotonic()
            stop.set()

        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, request_stop, signum)
        on_ready()
        await main(stop)
        clock.mark("the node's own shutdown")

    asyncio.run(runner())
    clock.mark("the event loop's threads")


def to_toml(config: Config) -> str:
    """Render the resolved config as TOML: a table per section and sub-section, of scalars and lists."""
    lines: list[str] = []
    for section, values in config.model_dump().items():
        _toml_table(section, values, lines)
    return "\n".join(lines)


def _toml_table(name: str, values: dict[str, Any], lines: list[str]) -> None:
    lines.append(f"[{name}]")
    tables = {key: value for key, value in values.items() if isinstance(value, dict)}
    for key, value in values.items():
        if value is None:
            lines.append(f"# {key} is unset")
        elif key not in tables:
            lines.append(f"{key} = {_toml_value(value)}")
    lines.append("")
    for key, value in tables.items():
        _toml_table(f"{name}.{key}", value, lines)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"cannot render {type(value).__name__} as TOML")
