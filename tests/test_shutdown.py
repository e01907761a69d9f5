"""Ctrl+C and SIGTERM stop a node cleanly (deathrattle, children, sockets); SIGKILL leaves no orphans."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from p2ptrain import procs
from tests.support.helpers import LocalSwarm, read_address, wait_until


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_node_stops_within_five_seconds_and_says_so(swarm: LocalSwarm, how: str) -> None:
    swarm.start_bootstrap()
    read_address(swarm.start_node("node0"), timeout=60)
    wait_until(lambda: len(swarm.live_ids()) == 1, timeout=30, what="the node's heartbeat")
    node = swarm.children.children["node0"]
    tree = procs.descendants(node.pid)
    assert len(tree) >= 2, "expected the DHT child and p2pd"
    swarm.children.remember_trees()
    started = time.monotonic()
    if how == "ctrl-c":
        os.killpg(node.pid, signal.SIGINT)  # what the terminal does: the whole foreground group
    else:
        node.send_signal(signal.SIGTERM)
    assert node.wait(timeout=5) == 0
    wait_until(
        lambda: not any(procs.is_alive(pid) for pid in tree),
        timeout=5 - (time.monotonic() - started),
        interval=0.05,
        what="the DHT child and p2pd to exit",
    )
    assert "deathrattle sent" in swarm.log("node0")
    # the others learn at once, without waiting for the heartbeat timeout
    states = {entry["state"] for entry in swarm.status()["nodes"]}
    assert states == {"dead"}


def test_sigkill_of_a_node_takes_its_dht_child_and_p2pd_along(swarm: LocalSwarm) -> None:
    swarm.start_bootstrap()
    read_address(swarm.start_node("node0"), timeout=60)
    node = swarm.children.children["node0"]
    tree = procs.descendants(node.pid)
    assert len(tree) >= 2
    swarm.children.signal("node0", signal.SIGKILL)
    node.wait(timeout=5)
    wait_until(
        lambda: not any(procs.is_alive(pid) for pid in tree),
        timeout=5,
        interval=0.05,
        what="the orphaned DHT child and p2pd to exit",
    )


def test_status_shows_killed_nodes_as_gone_or_silent_at_once(swarm: LocalSwarm) -> None:
    """One DHT read still holds a SIGKILLed node's last record (for up to 36 s): status probes the
    data ports (a refusal: the process is gone) and reads again to see whose heartbeat stopped."""
    swarm.start_bootstrap()
    drill = ["--steps", "1000", "--nodes", "1", "--set", 'node.data_host="127.0.0.1"']
    read_address(swarm.start_node("trainer", None, *drill, command="drill"), timeout=60)
    read_address(swarm.start_node("watcher"), timeout=60)
    ids: dict[str, dict] = {}

    def both_heartbeats() -> bool:  # one `status` run a poll: it reads the records the test uses
        ids.clear()
        ids.update((entry["id"], entry) for entry in swarm.status()["nodes"])
        live = [entry for entry in ids.values() if entry["state"] != "dead"]
        return len(live) == 2 and any(entry["state"] != "idle" for entry in live)

    wait_until(both_heartbeats, timeout=30, what="both heartbeats")
    trainer = next(key for key, entry in ids.items() if entry["state"] != "idle")
    for name in ("trainer", "watcher"):
        swarm.children.signal(name, signal.SIGKILL)
        swarm.children.wait(name, 5)
    states = {entry["id"]: entry["state"] for entry in swarm.status(once=False)["nodes"]}
    assert states[trainer] == "gone"
    assert set(states.values()) == {"gone", "silent"}, states


def test_a_drill_node_stops_within_five_seconds_in_the_middle_of_a_sync(swarm: LocalSwarm) -> None:
    """Its peer froze, so it waits in the election of a step (for up to a minute): SIGTERM ends that
    wait, and every drill.jsonl line written so far is complete."""
    swarm.start_bootstrap()
    patient = ["--set", "swarm.heartbeat_timeout=60", "--set", "swarm.straggler_deadline=60"]
    drill = ["--steps", "100", "--nodes", "2", "--inner", "0.2", *patient]
    for name in ("node0", "node1"):
        swarm.start_node(name, None, *drill, "--set", 'node.data_host="127.0.0.1"', command="drill")
    log_path = swarm.root / "node0" / "drill.jsonl"
    wait_until(lambda: log_path.exists() and len(log_path.read_text().splitlines()) >= 2, 120, what="steps")
    swarm.children.signal("node1", signal.SIGSTOP)
    wait_until(
        lambda: any(e["state"] in ("ready", "syncing") for e in swarm.status()["nodes"]),
        timeout=30,
        what="node0 waiting in a sync",
    )
    node = swarm.children.children["node0"]
    started = time.monotonic()
    node.send_signal(signal.SIGTERM)
    assert node.wait(timeout=5) == 0
    assert time.monotonic() - started < 5
    assert "left" in swarm.log("node0")
    assert all(json.loads(line)["step"] >= 0 for line in log_path.read_text().splitlines())


def test_a_benchmark_stopped_by_sigterm_stops_the_nodes_it_started(swarm: LocalSwarm, tmp_path: Path) -> None:
    """benchmarks.scale runs a bootstrap peer and drill nodes in sessions of their own, so nothing
    but the benchmark stops them: SIGTERM unwinds it like Ctrl+C (once it left them all running)."""
    argv = [sys.executable, "-m", "benchmarks.scale", "--json", "--simulate", "", "--drill", "2"]
    argv += ["--steps", "100"]
    bench = swarm.children.spawn("bench", argv, log_path=tmp_path / "bench.log")
    wait_until(
        lambda: sum("drill" in procs.command_line(pid) for pid in procs.descendants(bench.pid)) >= 2,
        timeout=60,
        what="the benchmark's two drill nodes",
    )
    tree = procs.descendants(bench.pid)
    swarm.children.remember_trees()  # so the fixture's teardown finds orphans where this fails
    bench.send_signal(signal.SIGTERM)
    assert bench.wait(timeout=20) == 143
    wait_until(
        lambda: not any(procs.is_alive(pid) for pid in tree),
        timeout=10,
        interval=0.1,
        what="the benchmark's bootstrap peer, drill nodes, DHT children and p2pd to exit",
    )
