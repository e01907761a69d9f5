"""`p2ptrain demo`: a whole swarm on 127.0.0.1, started, watched and stopped by one command.

Until the trainer lands the demo shows discovery: a bootstrap peer and N nodes that find each
other through the DHT, the swarm table they agree on, and a clean stop that leaves no process.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from p2ptrain.config import load_config
from p2ptrain.errors import UserError
from p2ptrain.node import dht_settings
from p2ptrain.procs import ChildProcesses
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.membership import live, read_heartbeats
from p2ptrain.swarm.status import format_table

LOOPBACK = "/ip4/127.0.0.1/tcp/0"


def p2ptrain_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2ptrain", *args]


def wait_for_file(path: Path, child_alive: Any, timeout: float) -> str:
    """Contents of `path` once written; UserError if the writer died or time ran out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text()
        if not child_alive():
            raise UserError(f"the process that should write {path} exited early; see its log")
        time.sleep(0.1)
    raise UserError(f"{path} did not appear within {timeout:.0f} s")


def run_demo(work_dir: Path, nodes: int = 3, timeout: float = 60.0, quiet: bool = False) -> dict[str, Any]:
    """Run the local swarm and return the summary (also printed unless `quiet`)."""

    def say(message: str) -> None:
        if not quiet:
            print(f"[demo] {message}", flush=True)

    work_dir = work_dir.resolve()
    logs = work_dir / "logs"
    address_file = work_dir / "bootstrap.addr"
    address_file.unlink(missing_ok=True)
    config = load_config("debug", overrides=["node.listen=['/ip4/127.0.0.1/tcp/0']"])
    children = ChildProcesses()
    started = time.monotonic()
    seen = 0
    table = ""
    try:
        say("starting the bootstrap peer")
        boot = children.spawn(
            "bootstrap",
            p2ptrain_command(
                "bootstrap",
                "--listen",
                LOOPBACK,
                "--identity",
                str(work_dir / "bootstrap"),
                "--address-file",
                str(address_file),
            ),
            logs / "bootstrap.log",
        )
        peer = wait_for_file(address_file, lambda: boot.poll() is None, timeout).split()[0]
        say(f"bootstrap peer up at {peer}")
        for index in range(nodes):
            children.spawn(
                f"node{index}",
                p2ptrain_command(
                    "join",
                    "--peer",
                    peer,
                    "--config",
                    "debug",
                    "--work-dir",
                    str(work_dir / f"node{index}"),
                    "--listen",
                    LOOPBACK,
                    "--table-every",
                    "0",
                ),
                logs / f"node{index}.log",
            )
        say(f"started {nodes} node(s); waiting until they see each other")
        settings = dht_settings(config, p2p_key=None, client_mode=True)
        settings.peers = [peer]
        with SwarmDHT.start(settings) as observer:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                heartbeats = live(asyncio.run(read_heartbeats(observer, config.run.id)))
                if len(heartbeats) != seen:
                    seen = len(heartbeats)
                    say(f"{seen}/{nodes} nodes in the swarm table ({time.monotonic() - started:.1f} s)")
                if seen >= nodes:
                    table = format_table(heartbeats)
                    break
                crashed = [name for name, child in children.children.items() if child.poll() is not None]
                if crashed:
                    raise UserError(f"{', '.join(crashed)} exited early; see {logs}")
                time.sleep(0.5)
        discovery_s = time.monotonic() - started
        if table:
            say("swarm table, read from the DHT:")
            if not quiet:
                print(table, flush=True)
    finally:
        say("stopping every process (SIGTERM)")
        orphans = children.stop_all()
    summary = {
        "ok": seen >= nodes and not orphans,
        "nodes_max": seen,
        "discovery_s": round(discovery_s, 2),
        "orphans": len(orphans),
        "work_dir": str(work_dir),
        "logs": str(logs),
    }
    say(
        f"{'done' if summary['ok'] else 'FAILED'}: {seen}/{nodes} nodes found each other in "
        f"{discovery_s:.1f} s, {len(orphans)} orphan process(es); logs in {logs}"
    )
    return summary
