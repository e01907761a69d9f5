"""hivemind's own `hivemind-dht` works as the bootstrap peer of a p2ptrain swarm."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from p2ptrain.procs import free_port
from p2ptrain.swarm.p2p_key import ensure_p2p_identity, peer_id_of
from tests.support.helpers import LocalSwarm, read_address, wait_until


def test_hivemind_dht_as_bootstrap_peer(swarm: LocalSwarm, tmp_path: Path) -> None:
    key = ensure_p2p_identity(tmp_path / "hivemind")
    port = free_port()
    command = shutil.which("hivemind-dht", path=str(Path(sys.executable).parent))
    assert command, "hivemind-dht is installed with hivemind"
    log = tmp_path / "hivemind-dht.log"
    swarm.children.spawn(
        "hivemind-dht",
        [command, "--host_maddrs", f"/ip4/127.0.0.1/tcp/{port}", "--identity_path", str(key)],
        log_path=log,
    )
    # it imports all of hivemind and torch first (10-15 s on a busy 2-core machine), and a node
    # gives up on an unreachable bootstrap peer after 4 tries (~15 s): start the node once it listens
    wait_until(lambda: "Running a DHT instance" in log.read_text(), 120, what="hivemind-dht to listen")
    peer = f"/ip4/127.0.0.1/tcp/{port}/p2p/{peer_id_of(key)}"
    swarm.bootstrap_addr = peer
    first = read_address(swarm.start_node("node0"), timeout=60)
    swarm.start_node("node1")
    wait_until(
        lambda: len(swarm.live_ids(first)) == 2, timeout=60, what="two nodes meeting through hivemind-dht"
    )
    wait_until(
        lambda: len(swarm.live_ids(peer)) == 2, timeout=30, what="the heartbeats read through hivemind-dht"
    )
