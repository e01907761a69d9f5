"""Closed runs: admission tickets checked by every validator and reader, and by the node at start."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import sys
import time
import urllib.request
from pathlib import Path

import msgpack
import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils import ValueWithExpiration

from p2ptrain.comm.net.members import Member
from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.comm.reduce.connect import dial_member
from p2ptrain.comm.transport.handshake import Credentials, HandshakeError
from p2ptrain.config import CommConfig
from p2ptrain.identity import NodeIdentity, load_or_create_identity
from p2ptrain.procs import free_port
from p2ptrain.swarm.admission import (
    TicketError,
    check_admits,
    decode_ticket,
    issue_ticket,
    parse_ticket_text,
    run_credentials,
)
from p2ptrain.swarm.membership import VerifiedRecords, decode_all
from p2ptrain.swarm.records import (
    Heartbeat,
    NodeState,
    RecordError,
    decode_heartbeat,
    heartbeat_key,
)
from p2ptrain.swarm.validator import HeartbeatValidator, key_id
from p2ptrain.untrusted import ThrottledLog
from tests.support.drills import DRILL, assert_agreement, drill_args, drill_log, finish
from tests.support.helpers import LocalSwarm, cli, read_address, wait_until
from tests.support.records import RUN, SOON

LATER = time.time() + 86400
RUN_ID = "p2ptrain-debug"
"""The debug config's run."""


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, NodeIdentity]:
    root = tmp_path_factory.mktemp("keys")
    return {name: load_or_create_identity(root / name) for name in ("authority", "rogue", "a", "b")}


def closed_beat(node: NodeIdentity, ticket: bytes, seq: int = 1) -> Heartbeat:
    return Heartbeat(
        run_id=RUN,
        node_key=node.public_key,
        seq=seq,
        timestamp=1.0,
        expiration=SOON,
        state=NodeState.READY,
        ticket=ticket,
    )


def stored(value: bytes, node: NodeIdentity, key: str) -> DHTRecord:
    return DHTRecord(key_id(key), msgpack.packb(node.public_key), msgpack.packb(value), SOON)


def test_a_ticket_round_trips_as_text_and_admits_its_node_only_until_it_expires(
    keys: dict[str, NodeIdentity],
) -> None:
    authority, a, b = keys["authority"].public_key, keys["a"], keys["b"]
    ticket = parse_ticket_text(issue_ticket(keys["authority"], a.public_key, LATER).to_text())
    check_admits(ticket, a.public_key, authority=authority, now=time.time())
    with pytest.raises(TicketError, match="admits"):
        check_admits(ticket, b.public_key, authority=authority, now=time.time())
    with pytest.raises(TicketError, match="expired"):
        check_admits(ticket, a.public_key, authority=authority, now=LATER + 1)
    with pytest.raises(TicketError, match="authority"):
        check_admits(ticket, a.public_key, authority=keys["rogue"].public_key, now=time.time())


def test_a_changed_or_cut_ticket_is_refused(keys: dict[str, NodeIdentity]) -> None:
    ticket = issue_ticket(keys["authority"], keys["a"].public_key, LATER)
    longer = dataclasses.replace(ticket, expires=LATER + 86400 * 365)  # the holder extends it
    with pytest.raises(TicketError, match="not signed"):
        decode_ticket(longer.to_bytes())
    for text in (ticket.to_text()[:-9], "p2pt1-???", "hello"):
        with pytest.raises(TicketError):
            parse_ticket_text(text)


def test_every_validator_keeps_a_closed_runs_key_for_records_its_authority_admitted(
    keys: dict[str, NodeIdentity],
) -> None:
    """A bootstrap-like validator (no run configured) tells, from the key alone, which authority
    must have signed the ticket of every record stored there."""
    authority, rogue, a, b = keys["authority"], keys["rogue"], keys["a"], keys["b"]
    closed = heartbeat_key(RUN, authority.public_key)
    good = issue_ticket(authority, a.public_key, LATER).to_bytes()
    for validator in (HeartbeatValidator(), HeartbeatValidator((RUN,), authority=authority.public_key)):
        assert validator.validate(stored(closed_beat(a, good).sign(a), a, closed))
        refused = {
            "no ticket": stored(closed_beat(b, b"", seq=2).sign(b), b, closed),
            "a ticket of its own authority": stored(
                closed_beat(b, issue_ticket(rogue, b.public_key, LATER).to_bytes()).sign(b), b, closed
            ),
            "an expired ticket": stored(
                closed_beat(b, issue_ticket(authority, b.public_key, time.time() - 1).to_bytes()).sign(b),
                b,
                closed,
            ),
            "a ticket under the open key": stored(closed_beat(a, good, seq=3).sign(a), a, heartbeat_key(RUN)),
        }
        assert [why for why, record in refused.items() if validator.validate(record)] == []
    with pytest.raises(RecordError, match="another node's ticket"):
        decode_heartbeat(closed_beat(b, good).sign(b))  # a ticket copied from a's record


def test_readers_of_a_closed_run_take_only_admitted_records(keys: dict[str, NodeIdentity]) -> None:
    """Records read from a DHT node that runs no validator are checked again by the reader."""
    authority, a, b = keys["authority"], keys["a"], keys["b"]
    admitted = closed_beat(a, issue_ticket(authority, a.public_key, LATER).to_bytes())
    items = [
        (admitted.node_key, ValueWithExpiration(admitted.sign(a), SOON)),
        (b.public_key, ValueWithExpiration(closed_beat(b, b"").sign(b), SOON)),
    ]
    refusals = ThrottledLog(logging.getLogger(__name__))
    found = decode_all(
        items, RUN, refusals=refusals, verified=VerifiedRecords(), authority=authority.public_key
    )
    assert [beat.node_key for beat in found] == [a.public_key]


def admit(swarm: LocalSwarm, name: str, authority_file: str) -> str:
    """A node key for `name`'s work dir and its ticket, printed by the CLI as an operator runs it."""
    identity = cli("identity", "--identity", str(swarm.root / name))
    node_key = identity.stdout.split()[2]
    result = cli("admit", node_key, "--authority-key", authority_file, "--days", "1")
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def page_nodes(port: int) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=5) as response:
        return {node["id"] for node in json.loads(response.read())["nodes"]}


def test_a_closed_run_takes_its_ticketed_nodes_and_refuses_everyone_else(swarm: LocalSwarm) -> None:
    """Three admitted drill nodes take every step; a stranger storing 'ready' records under the
    run's key with a ticket copied from an admitted node's record is never a member; a node without
    a ticket, or with another node's, is refused in one line before it joins."""
    authority_file = str(swarm.root / "authority.key")
    created = cli("admit", "--new", "--authority-key", authority_file)
    assert created.returncode == 0, created.stderr
    authority = created.stdout.split('authority = "')[1].split('"')[0]
    closed = ["--set", f'run.authority="{authority}"']
    names = [f"node{i}" for i in range(3)]
    tickets = {name: admit(swarm, name, authority_file) for name in names}
    page = free_port()
    swarm.start_bootstrap(extra=("--dashboard", str(page), "--run-id", RUN_ID, "--run-authority", authority))
    steps = 6
    for name in names:
        ticket = ["--set", f'node.ticket="{tickets[name]}"']
        swarm.start_node(name, None, *drill_args(steps, 3), *closed, *ticket, *DRILL, command="drill")
    key_file = swarm.root / "stranger.key"
    stranger_args = ["--closed-by", authority, "--ticket", "copied", "--address-file", str(key_file)]
    swarm.children.spawn(
        "stranger",
        [sys.executable, "-m", "tests.support.stranger", "--peer", swarm.bootstrap_addr, *stranger_args],
        log_path=swarm.root / "stranger.log",
    )
    stranger = read_address(key_file, timeout=60)
    # the bootstrap peer's status page shows the closed run, with its admitted nodes only
    wait_until(lambda: len(page_nodes(page)) == 3, timeout=60, what="the admitted nodes on the page")
    assert stranger not in page_nodes(page)
    for ticket in ([], ["--set", f'node.ticket="{tickets["node0"]}"']):
        refused = cli(
            "join", "--peer", swarm.bootstrap_addr, "--work-dir", str(swarm.root / "late"), *closed, *ticket
        )
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert "ticket" in refused.stderr and "Traceback" not in refused.stderr
    status = cli("status", "--peer", swarm.bootstrap_addr, "--config", "debug", *closed, "--json", "--once")
    listed = {node["id"] for node in json.loads(status.stdout.splitlines()[-1])["nodes"]}
    assert len(listed) == 3 and stranger not in listed, status.stdout
    logs = finish(swarm, names)
    assert all(len(log) == steps for log in logs.values()), logs
    assert_agreement(logs, range(steps))
    assert all(entry["members"] and stranger not in entry["members"] for entry in drill_log(swarm, "node0"))
    assert all(len(entry["members"]) == 3 for entry in logs["node0"])
    # no DHT node, the bootstrap peer included, stored one of its records
    assert "store refused" in swarm.log("stranger") and "store taken" not in swarm.log("stranger")


@pytest.mark.procs
def test_admission_mistakes_are_one_line_errors(tmp_path: Path) -> None:
    key_file = str(tmp_path / "authority.key")
    assert cli("admit", "--new", "--authority-key", key_file).returncode == 0
    node = "ab" * 32
    peer_id = cli("identity", "--identity", str(tmp_path / "peer")).stdout.split("DHT peer")[1].split()[0]
    nobody = f"/ip4/127.0.0.1/tcp/9/p2p/{peer_id}"  # never dialed: the ticket is checked first
    mistakes = {
        "exists already": ("admit", "--new", "--authority-key", key_file),
        "is not a key: 64 hex digits": ("admit", "xyz", "--authority-key", key_file),
        "no such key file": ("admit", node, "--authority-key", str(tmp_path / "missing.key")),
        "--days": ("admit", node, "--authority-key", key_file, "--days", "0"),
        "run.authority": ("config", "show", "--set", 'run.authority="not-hex"'),
    }
    joining = ("join", "--peer", nobody, "--work-dir", str(tmp_path / "n"), "--set", f"run.authority={node}")
    # a ticket pasted wrong says so in plain words, not "ticket is not msgpack (ValueError)"
    issued = cli("admit", node, "--authority-key", key_file).stdout.strip()
    changed = issued[:-10] + ("B" if issued[-10] == "A" else "A") + issued[-9:]  # in the signature
    pasted = {
        "node.ticket: not a ticket `p2ptrain admit` printed (it does not decode": "p2pt1-AAAAAAAAAAAA",
        "node.ticket: the ticket was changed after `p2ptrain admit` signed it": changed,
    }
    pasted["not an admission ticket"] = "hello"
    for needle, ticket in pasted.items():
        mistakes[needle] = (*joining, "--set", f"node.ticket={ticket}")
    for needle, args in mistakes.items():
        result = cli(*args)
        assert result.returncode == 2, (args, result.stderr)
        assert needle in result.stderr and result.stderr.count("\n") == 1, (args, result.stderr)
        assert "msgpack" not in result.stderr and "base64" not in result.stderr, result.stderr


def test_the_handshake_of_a_closed_run_admits_ticketed_members_only(keys: dict[str, NodeIdentity]) -> None:
    """Over real TCP: two members of a closed run with their tickets connect; a dialer that shows
    no ticket, or another node's, is refused before the listener signs anything, and a listener
    without one is refused by the dialer."""
    authority = keys["authority"]

    def credentials(node: NodeIdentity, holder: NodeIdentity | None = None) -> Credentials:
        ticket = issue_ticket(authority, (holder or node).public_key, LATER).to_text()
        found = run_credentials(authority.public_key, ticket)
        assert found is not None
        return found

    async def main() -> None:
        a, b = keys["a"], keys["b"]
        comm = CommConfig()
        listener = DataPlaneServer(identity=b, comm=comm, setup_timeout=3.0, credentials=credentials(b))
        host, port = await listener.start()
        member = Member(key=b.public_key, host=host, port=port)
        digest = bytes(32)
        try:

            async def dial(shown: Credentials | None) -> None:
                registration = listener.expect(3, [a.public_key], digest=digest)
                try:
                    _, writer, _ = await dial_member(
                        a,
                        member,
                        step=3,
                        digest=digest,
                        setup_timeout=3.0,
                        failure_timeout=comm.failure_timeout,
                        credentials=shown,
                    )
                    writer.close()
                finally:
                    listener.forget(3)
                assert registration.incoming[(a.public_key, 0)].done()

            await dial(credentials(a))
            for shown, reason in [(None, "no admission ticket"), (credentials(a, holder=b), "admits")]:
                with pytest.raises(HandshakeError, match=reason):
                    await dial(shown)
            listener.credentials = None  # a listener that shows nothing is no member of the run
            with pytest.raises(HandshakeError, match="is not admitted"):
                await dial(credentials(a))
        finally:
            await listener.close()

    asyncio.run(main())
