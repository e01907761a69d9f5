"""Ports handed to a listener another process opens next (the ranks' rendezvous store)."""

from __future__ import annotations

import random
import socket

from p2ptrain.procs import ephemeral_ports, free_port


def test_a_free_port_lies_outside_the_ephemeral_range_where_outgoing_connections_take_theirs() -> None:
    # a port from that range may be taken by any connect() on the machine before the store binds it
    # (seen: EADDRINUSE in the FSDP tests while the other worker's swarm dialled)
    ephemeral = set(ephemeral_ports())
    ports = {free_port() for _ in range(200)}
    assert not ports & ephemeral, sorted(ports & ephemeral)[:5]


def test_a_port_someone_listens_on_is_passed_over() -> None:
    state = random.getstate()
    try:
        random.seed(7)
        first = free_port()
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", first))
            listener.listen()
            random.seed(7)  # the same first pick: taken now
            assert free_port() not in (first, 0)
    finally:
        random.setstate(state)
