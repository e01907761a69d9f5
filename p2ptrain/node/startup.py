"""Start of a node agent: its keys and its DHT handle, with the validator that guards its run."""

from __future__ import annotations

from pathlib import Path

from p2ptrain.config import Config
from p2ptrain.identity import NodeIdentity, ensure_p2p_identity, load_or_create_identity
from p2ptrain.swarm.dht import DHTSettings, SwarmDHT
from p2ptrain.swarm.records import HeartbeatValidator


def dht_settings(config: Config, *, p2p_key: Path | None, client_mode: bool = False) -> DHTSettings:
    """DHT settings of a node of `config.run`; its validator protects that run's heartbeats."""
    swarm = config.swarm
    return DHTSettings(
        peers=swarm.peers,
        listen=config.node.listen,
        announce=config.node.announce,
        p2p_key=p2p_key,
        client_mode=client_mode,
        timeout=swarm.dht_timeout,
        retries=swarm.connect_retries,
        backoff=swarm.connect_backoff,
        shutdown_timeout=swarm.shutdown_timeout,
        validators=(HeartbeatValidator(run_ids=(config.run.id,)),),
    )


def start_node_dht(config: Config) -> tuple[NodeIdentity, SwarmDHT]:
    """Load (or create) the node's keys and join the DHT; raises UserError subclasses on failure."""
    directory = config.node.identity_dir
    identity = load_or_create_identity(directory)
    p2p_key = ensure_p2p_identity(directory)
    return identity, SwarmDHT.start(dht_settings(config, p2p_key=p2p_key))
