"""`p2ptrain demo`: a whole swarm on 127.0.0.1, started, watched and stopped by one command.

A bootstrap peer and N nodes find each other through the DHT; then the nodes run outer steps with
synthetic pseudo-gradients (`join --drill`): election from the signed heartbeats and the int8
all-reduce, for real. The demo follows each step, checks that every node ends it with the same
bytes, prints a summary and stops every process, leaving none behind. Until the trainer lands,
this is the main job; identities, logs and per-node step logs stay in the work directory.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from p2ptrain.config import load_config
from p2ptrain.errors import UserError
from p2ptrain.identity import short_id
from p2ptrain.node import dht_settings
from p2ptrain.procs import ChildProcesses
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.membership import live, read_heartbeats
from p2ptrain.swarm.status import format_table

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
DRILL_VALUES = 1 << 20  # 4 MiB of fp32 per node and step


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


def read_steps(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class _Demo:
    def __init__(self, work_dir: Path, nodes: int, steps: int, timeout: float, quiet: bool):
        self.work_dir = work_dir.resolve()
        self.logs = self.work_dir / "logs"
        self.nodes = nodes
        self.steps = steps
        self.timeout = timeout
        self.quiet = quiet
        self.children = ChildProcesses()
        self.names = [f"node{index}" for index in range(nodes)]
        self.started = time.monotonic()

    def say(self, message: str) -> None:
        if not self.quiet:
            print(f"[demo] {message}", flush=True)

    def start(self) -> str:
        address_file = self.work_dir / "bootstrap.addr"
        address_file.unlink(missing_ok=True)
        for name in self.names:  # step logs are appended to: start each demo afresh
            (self.work_dir / name / "drill.jsonl").unlink(missing_ok=True)
        if self.logs.exists():
            shutil.rmtree(self.logs)
        self.say("starting the bootstrap peer")
        boot = self.children.spawn(
            "bootstrap",
            p2ptrain_command(
                "bootstrap",
                "--listen",
                LOOPBACK,
                "--identity",
                str(self.work_dir / "bootstrap"),
                "--address-file",
                str(address_file),
            ),
            self.logs / "bootstrap.log",
        )
        peer = wait_for_file(address_file, lambda: boot.poll() is None, self.timeout).split()[0]
        self.say(f"bootstrap peer up at {peer}")
        for name in self.names:
            self.children.spawn(
                name,
                p2ptrain_command(
                    "join",
                    "--peer",
                    peer,
                    "--config",
                    "debug",
                    "--work-dir",
                    str(self.work_dir / name),
                    "--listen",
                    LOOPBACK,
                    "--set",
                    'node.data_host="127.0.0.1"',
                    "--drill",
                    str(self.steps),
                    "--drill-nodes",
                    str(self.nodes),
                    "--drill-size",
                    str(DRILL_VALUES),
                    "--drill-inner",
                    "1.0",
                ),
                self.logs / f"{name}.log",
            )
        self.say(f"started {self.nodes} node(s); waiting until they see each other")
        return peer

    def check_children(self) -> None:
        crashed = [name for name in self.names if self.children.children[name].poll() not in (None, 0)]
        if crashed:
            raise UserError(f"{', '.join(crashed)} failed; see {self.logs}")

    def discover(self, peer: str) -> tuple[int, str]:
        config = load_config("debug")
        settings = dht_settings(config, p2p_key=None, client_mode=True)
        settings.peers, settings.listen = [peer], [LOOPBACK]
        seen = 0
        with SwarmDHT.start(settings) as observer:
            deadline = time.monotonic() + self.timeout
            while time.monotonic() < deadline:
                heartbeats = live(asyncio.run(read_heartbeats(observer, config.run.id)))
                if len(heartbeats) != seen:
                    seen = len(heartbeats)
                    self.say(
                        f"{seen}/{self.nodes} nodes in the swarm table "
                        f"({time.monotonic() - self.started:.1f} s)"
                    )
                if seen >= self.nodes:
                    return seen, format_table(heartbeats)
                self.check_children()
                time.sleep(0.5)
        raise UserError(f"only {seen} of {self.nodes} nodes found each other within {self.timeout:.0f} s")

    def follow_steps(self) -> list[dict[str, Any]]:
        """Report each outer step once every node logged it; returns one summary per step."""
        reported: list[dict[str, Any]] = []
        deadline = time.monotonic() + self.timeout + 10 * self.steps
        while len(reported) < self.steps and time.monotonic() < deadline:
            logs = [read_steps(self.work_dir / name / "drill.jsonl") for name in self.names]
            while all(len(log) > len(reported) for log in logs):
                step = len(reported)
                entries = [log[step] for log in logs]
                summary = _summarize(step, entries)
                reported.append(summary)
                if summary["given_up"]:
                    self.say(f"outer step {step}: given up by {summary['given_up']} node(s)")
                    continue
                self.say(
                    f"outer step {step}: {len(summary['members'])} members "
                    f"({' → '.join(summary['members'])}), "
                    f"results {'identical' if summary['agree'] else 'DIFFER'}, "
                    f"{summary['mb_sent']:.1f} MB sent per node, sync {summary['sync_s']:.2f} s"
                )
            if len(reported) < self.steps:
                self.check_children()
                time.sleep(0.3)
        return reported


def _summarize(step: int, entries: list[dict[str, Any]]) -> dict[str, Any]:
    done = [entry for entry in entries if "given_up" not in entry]
    return {
        "step": step,
        "given_up": len(entries) - len(done),
        "members": [short_id(bytes.fromhex(key)) for key in done[0]["members"]] if done else [],
        "agree": len(done) == len(entries) and len({entry["hash"] for entry in done}) == 1,
        "mb_sent": statistics.median(entry["bytes_sent"] for entry in done) / 1e6 if done else 0.0,
        "sync_s": statistics.median(entry["sync_s"] for entry in done) if done else 0.0,
    }


def run_demo(
    work_dir: Path, nodes: int = 3, steps: int = 5, timeout: float = 60.0, quiet: bool = False
) -> dict[str, Any]:
    """Run the local swarm and return the summary (also printed unless `quiet`)."""
    demo = _Demo(work_dir, nodes, steps, timeout, quiet)
    seen, discovery_s, step_summaries = 0, 0.0, []
    try:
        peer = demo.start()
        seen, table = demo.discover(peer)
        discovery_s = time.monotonic() - demo.started
        demo.say("swarm table, read from the DHT:")
        if not quiet:
            print(table, flush=True)
        demo.say(f"running {steps} outer steps: election + int8 all-reduce of {DRILL_VALUES} values per node")
        step_summaries = demo.follow_steps()
    finally:
        demo.say("stopping every process (SIGTERM)")
        orphans = demo.children.stop_all()
    agree = bool(step_summaries) and all(summary["agree"] for summary in step_summaries)
    summary = {
        "ok": seen >= nodes and len(step_summaries) == steps and agree and not orphans,
        "outer_steps": sum(1 for s in step_summaries if not s["given_up"]),
        "nodes_max": seen,
        "discovery_s": round(discovery_s, 2),
        "params_hash_agree": agree,
        "sync_s_median": round(statistics.median(s["sync_s"] for s in step_summaries), 3)
        if step_summaries
        else None,
        "mb_sent_per_step": round(step_summaries[0]["mb_sent"], 2) if step_summaries else None,
        "orphans": len(orphans),
        "work_dir": str(demo.work_dir),
        "logs": str(demo.logs),
    }
    demo.say(
        f"{'done' if summary['ok'] else 'FAILED'}: {seen}/{nodes} nodes found each other "
        f"in {discovery_s:.1f} s, "
        f"{summary['outer_steps']}/{steps} outer steps with identical results on every node: {agree}, "
        f"{len(orphans)} orphan process(es); logs in {demo.logs}, "
        f"step logs in {demo.work_dir}/node*/drill.jsonl"
    )
    return summary
