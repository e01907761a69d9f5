"""Start of a node agent: its keys and its DHT handle, with the validator that guards its run."""

from __future__ import annotations

import time
from pathlib import Path

from p2ptrain.config import Config
from p2ptrain.errors import UserError
from p2ptrain.identity import NodeIdentity, load_or_create_identity, short_id
from p2ptrain.swarm.admission import TicketError, check_admits, parse_ticket_text
from p2ptrain.swarm.dht import DHTSettings, SwarmDHT
from p2ptrain.swarm.p2p_key import ensure_p2p_identity
from p2ptrain.swarm.validator import HeartbeatValidator


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
        validators=(HeartbeatValidator(run_ids=(config.run.id,), authority=config.run.authority_key),),
    )


def start_node_dht(config: Config) -> tuple[NodeIdentity, SwarmDHT]:
    """Load (or create) the node's keys and join the DHT; raises UserError subclasses on failure."""
    directory = config.node.identity_dir
    identity = load_or_create_identity(directory)
    check_admission(config, identity)
    p2p_key = ensure_p2p_identity(directory)
    return identity, SwarmDHT.start(dht_settings(config, p2p_key=p2p_key))


def check_admission(config: Config, identity: NodeIdentity) -> None:
    """Refuse, in one line and before joining, a node of a closed run without a valid ticket:
    every other node would refuse its records."""
    authority = config.run.authority_key
    if authority is None:
        return
    if not config.node.ticket:
        raise UserError(
            f"run {config.run.id!r} is closed (run.authority {short_id(authority)}…): this node needs an "
            f"admission ticket; send its key {identity.node_id} to the run's operator "
            "('p2ptrain admit KEY') and pass the ticket with --set node.ticket=TICKET"
        )
    try:
        check_admits(
            parse_ticket_text(config.node.ticket), identity.public_key, authority=authority, now=time.time()
        )
    except TicketError as exc:
        raise UserError(f"node.ticket: {exc}") from None
