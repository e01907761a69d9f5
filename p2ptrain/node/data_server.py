"""A node's data-plane server (comm/net/server.py), built from the run's config: the all-reduce
settings every member must share, the node's relay cap, and a closed run's tickets."""

from __future__ import annotations

from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.config import Config
from p2ptrain.identity import NodeIdentity
from p2ptrain.swarm.admission import run_credentials


def node_server(config: Config, identity: NodeIdentity) -> DataPlaneServer:
    """A node's data-plane server: the run's all-reduce settings, its relay cap, and in a closed run
    the tickets shown and checked in every handshake."""
    credentials = run_credentials(config.run.authority_key, config.node.ticket)
    return DataPlaneServer(
        identity=identity,
        comm=config.comm,
        setup_timeout=setup_timeout(config),
        relay_mbps=config.node.relay_mbps,
        credentials=credentials,
    )


def setup_timeout(config: Config) -> float:
    """How long members may take to arrive at a step and connect: a member that has not is dead
    by its heartbeat by then."""
    return max(config.comm.failure_timeout, config.swarm.heartbeat_timeout)
