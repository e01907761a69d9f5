"""A node's data-plane server (comm/dataplane.py), built from the run's config: the all-reduce
settings every member must share, the node's relay cap, and a closed run's tickets."""

from __future__ import annotations

from p2ptrain.comm.dataplane import DataPlaneServer, RingSettings
from p2ptrain.config import Config
from p2ptrain.identity import NodeIdentity
from p2ptrain.swarm.admission import run_credentials


def node_server(config: Config, identity: NodeIdentity) -> DataPlaneServer:
    """A node's data-plane server: the run's all-reduce settings, its relay cap, and in a closed run
    the tickets shown and checked in every handshake."""
    credentials = run_credentials(config.run.authority_key, config.node.ticket)
    return DataPlaneServer(identity, ring_settings(config), config.node.relay_mbps, credentials=credentials)


def ring_settings(config: Config) -> RingSettings:
    comm = config.comm
    return RingSettings(
        block=comm.quant_block,
        chunk_bytes=comm.chunk_bytes,
        failure_timeout=comm.failure_timeout,
        zstd=comm.zstd,
        topology=comm.topology,
        connections=comm.connections,
        clip=comm.clip,
        bits=comm.bits,
        setup_timeout=max(comm.failure_timeout, config.swarm.heartbeat_timeout),
    )
