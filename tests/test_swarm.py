"""A real bootstrap peer and real nodes on 127.0.0.1: discovery, persistence, losing the bootstrap peer."""

from __future__ import annotations

import signal
import time

from p2ptrain.procs import free_port
from tests.support.helpers import LocalSwarm, read_address, wait_until


def test_bootstrap_and_three_nodes_see_each_other(swarm: LocalSwarm) -> None:
    swarm.start_bootstrap()
    address_files = [swarm.start_node(f"node{i}") for i in range(3)]
    node_addrs = [read_address(path, timeout=60) for path in address_files]
    up = time.monotonic()
    # every node's own view of the DHT lists all three, within 10 s of the nodes being up
    for addr in node_addrs:

        def sees_all_three(addr: str = addr) -> bool:
            return len(swarm.live_ids(addr)) == 3

        wait_until(
            sees_all_three,
            timeout=max(1.0, 10 - (time.monotonic() - up)),
            what="all three heartbeats from every node",
        )
    status = swarm.status()
    assert {node["state"] for node in status["nodes"]} == {"idle"}
    assert all(node["last_seen_s"] < 6 for node in status["nodes"])


def test_restarted_bootstrap_keeps_its_multiaddress(swarm: LocalSwarm) -> None:
    listen = f"/ip4/127.0.0.1/tcp/{free_port()}"
    first = swarm.start_bootstrap(listen=listen)
    swarm.children.signal("bootstrap", signal.SIGTERM)
    assert swarm.children.wait("bootstrap", timeout=5) == 0
    second = swarm.start_bootstrap(name="bootstrap-again", listen=listen)
    assert first == second and first.startswith(listen + "/p2p/")
    swarm.start_node("node0")
    wait_until(lambda: len(swarm.live_ids(second)) == 1, timeout=60, what="a node joining the restarted peer")


def test_swarm_keeps_working_without_its_bootstrap_peer(swarm: LocalSwarm) -> None:
    swarm.start_bootstrap()
    first = read_address(swarm.start_node("node0"), timeout=60)
    second = read_address(swarm.start_node("node1"), timeout=60)
    wait_until(lambda: len(swarm.live_ids(first)) == 2, timeout=30, what="two nodes")
    swarm.children.signal("bootstrap", signal.SIGKILL)
    swarm.children.wait("bootstrap", timeout=10)
    wait_until(
        lambda: swarm.children.leftovers() == [],
        timeout=10,
        what="the killed peer's DHT child and p2pd to exit",
    )
    # a newcomer that only knows node0 joins and node1 sees it: records flow without the bootstrap peer
    swarm.start_node("node2", peer=first)
    status: dict = {}

    def newcomer_seen() -> bool:  # one `status` run a poll: it reads the records asserted on below
        status.update(swarm.status(second))
        return len([node for node in status["nodes"] if node["state"] != "dead"]) == 3

    wait_until(newcomer_seen, timeout=60, what="the newcomer seen through node1")
    assert all(node["last_seen_s"] < 6 for node in status["nodes"]), status
    # and a node still stops within 5 s, deathrattle included, with the dead peer in its routing table
    swarm.children.signal("node1", signal.SIGTERM)
    assert swarm.children.wait("node1", timeout=5) == 0
    assert "deathrattle sent" in swarm.log("node1")
    assert len(swarm.live_ids(first)) == 2
