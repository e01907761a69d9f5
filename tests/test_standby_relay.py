"""A bootstrap peer that relays (`p2ptrain bootstrap --relay`): a real bootstrap process on 127.0.0.1,
real records in its DHT. It publishes its relay record; it splices two ends that its run's records
show ready for the step and behind NAT, and refuses everyone else with the reason; it takes part in
no step; stopping it withdraws the record and says what it relayed. Where the elections list it:
only when no member of a step can relay."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from p2ptrain.cli.commands import relay_options
from p2ptrain.cli.parser import build_parser
from p2ptrain.comm.net.members import Member, membership_digest
from p2ptrain.comm.net.relay import RelayRefused, RelayRequest, open_relayed, relay_for
from p2ptrain.comm.reduce.connect import dial_member
from p2ptrain.comm.transport.handshake import HandshakeError
from p2ptrain.errors import UserError
from p2ptrain.identity import NodeIdentity, load_or_create_identity
from p2ptrain.swarm.dht import DHTSettings, SwarmDHT
from p2ptrain.swarm.election import decide
from p2ptrain.swarm.membership import HeartbeatPublisher
from p2ptrain.swarm.records import Heartbeat, NodeState
from p2ptrain.swarm.standby import REFRESH_S, StandbyRelays
from p2ptrain.swarm.validator import HeartbeatValidator
from tests.support.helpers import LocalSwarm, assert_one_line_error, cli, wait_until

RUN = "p2ptrain-debug"  # the debug config's, which `status` reads
STEP = 4
ANNOUNCED = re.compile(r"standby relay for run '[^']+' at (\S+):(\d+) \(key ([0-9a-f]{64})")


def start_relaying_bootstrap(swarm: LocalSwarm) -> Member:
    swarm.start_bootstrap(extra=("--relay", "127.0.0.1:0", "--run-id", RUN))
    wait_until(lambda: ANNOUNCED.search(swarm.log("bootstrap")) is not None, 30, what="the relay's line")
    found = ANNOUNCED.search(swarm.log("bootstrap"))
    assert found is not None
    return Member(key=bytes.fromhex(found.group(3)), host=found.group(1), port=int(found.group(2)))


async def publish(dht: SwarmDHT, identity: NodeIdentity, *, state: NodeState, step: int, reach: str) -> None:
    publisher = HeartbeatPublisher(dht, identity, run_id=RUN, ttl=60.0)
    assert await publisher.publish(state=state, outer_step=step, data_addr="127.0.0.1:1", data_reach=reach)


def test_a_relaying_bootstrap_splices_its_runs_ends_behind_nat_and_refuses_everyone_else(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    relay = start_relaying_bootstrap(swarm)
    ids = {name: load_or_create_identity(tmp_path / name) for name in ("home0", "home1", "public", "late")}
    stranger = load_or_create_identity(tmp_path / "stranger")
    settings = DHTSettings(
        peers=[swarm.bootstrap_addr],
        listen=["/ip4/127.0.0.1/tcp/0"],
        client_mode=True,
        validators=(HeartbeatValidator(),),
    )
    digest = bytes(32)

    def request(sender: str, receiver: str, role: str, signer: NodeIdentity | None = None) -> RelayRequest:
        keys = {name: identity.public_key for name, identity in ids.items()}
        if signer is not None:
            keys[sender if role == "send" else receiver] = signer.public_key
        return RelayRequest(
            step=STEP,
            attempt=0,
            digest=digest,
            sender=keys[sender],
            receiver=keys[receiver],
            lane=0,
            role=role,  # type: ignore[arg-type]
            relay=relay.key,
        )

    async def refused(identity: NodeIdentity, asked: RelayRequest) -> str:
        started = time.monotonic()
        with pytest.raises(RelayRefused) as refusal:
            await open_relayed(identity, relay, request=asked, timeout=10.0)
        assert time.monotonic() - started < 5.0, "refused within a read of the records, not a timeout"
        return str(refusal.value)

    async def scenario(dht: SwarmDHT) -> None:
        listed = await StandbyRelays(dht, RUN).current()
        assert listed == [relay], listed
        await publish(dht, ids["home0"], state=NodeState.READY, step=STEP, reach="closed")
        await publish(dht, ids["home1"], state=NodeState.SYNCING, step=STEP, reach="closed")
        await publish(dht, ids["public"], state=NodeState.READY, step=STEP, reach="open")
        await publish(dht, ids["late"], state=NodeState.TRAINING, step=STEP, reach="closed")
        (r0, w0), (r1, w1) = await asyncio.gather(
            open_relayed(ids["home0"], relay, request=request("home0", "home1", "send"), timeout=10.0),
            open_relayed(ids["home1"], relay, request=request("home0", "home1", "accept"), timeout=10.0),
        )
        payload = bytes(range(256)) * 1024
        w0.write(payload)
        w1.write(payload[::-1])
        assert await r1.readexactly(len(payload)) == payload
        assert await r0.readexactly(len(payload)) == payload[::-1]
        w0.close()
        w1.close()
        assert "not a live node of this relay's run" in await refused(
            stranger, request("home0", "home1", "send", signer=stranger)
        )
        assert "can be dialed" in await refused(ids["public"], request("public", "home1", "send"))
        assert "not ready for step 4" in await refused(ids["late"], request("late", "home1", "send"))
        elsewhere = replace(request("home0", "home1", "send"), relay=bytes(32))
        assert "names another relay" in await refused(ids["home0"], elsewhere)
        # a hello: the relay is a member of no step, and says so at once
        started = time.monotonic()
        with pytest.raises(HandshakeError, match="member of no step"):
            await dial_member(
                ids["home0"], relay, step=STEP, digest=digest, setup_timeout=5.0, failure_timeout=5.0
            )
        assert time.monotonic() - started < 3.0
        # a node asks for the relays when it is ready for a step: past REFRESH_S it gets the last
        # read's at once, and the next read goes on in the background (here: a DHT that stalls)
        now = [0.0]
        standby = StandbyRelays(dht, RUN, clock=lambda: now[0])
        assert await standby.current() == [relay]
        assert dht._pid is not None
        os.kill(dht._pid, signal.SIGSTOP)
        try:
            now[0] += REFRESH_S
            started = time.monotonic()
            assert await standby.current() == [relay]
            assert time.monotonic() - started < 1.0, "the read past REFRESH_S held the caller up"
        finally:
            standby.close()
            os.kill(dht._pid, signal.SIGCONT)

    with SwarmDHT.start(settings) as dht:
        asyncio.run(scenario(dht))
    listed = {"id": relay.key.hex(), "data_addr": f"{relay.host}:{relay.port}"}
    assert swarm.status()["relays"] == [listed]
    swarm.children.signal("bootstrap", signal.SIGTERM)
    assert swarm.children.wait("bootstrap", 20) == 0, swarm.log("bootstrap")
    relayed = re.search(r"standby relay: (\d+) edges, (\d+) bytes relayed", swarm.log("bootstrap"))
    assert relayed is not None and relayed.groups() == ("1", str(2 * 256 * 1024)), swarm.log("bootstrap")


@pytest.mark.procs
def test_relay_flags_that_do_not_hold_are_refused_in_one_line(tmp_path: Path) -> None:
    identity = str(tmp_path / "boot")
    assert_one_line_error(
        cli("bootstrap", "--identity", identity, "--relay", "70000", timeout=60), "--relay 70000"
    )
    parser = build_parser()
    for flags, needle in [
        (["--relay", "host:port"], "--relay host:port"),
        (["--relay", "7000", "--relay-mbps", "0"], "--relay-mbps"),
        (["--relay", "7000", "--run-authority", "ab" * 32], "needs an admission ticket"),
        (["--relay", "7000", "--run-authority", "ab" * 32, "--ticket", "p2pt1-xyz"], "--ticket"),
    ]:
        args = parser.parse_args(["bootstrap", "--identity", identity, *flags])
        authority = bytes.fromhex(args.run_authority) if args.run_authority else None
        with pytest.raises(UserError, match=re.escape(needle)):
            relay_options(args, [], authority)
    args = parser.parse_args(
        ["bootstrap", "--identity", identity, "--relay", "7000", "--announce", "/ip4/203.0.113.7/tcp/31337"]
    )
    options = relay_options(args, args.announce, None)
    assert (options.host, options.port, options.announce_host) == ("0.0.0.0", 7000, "203.0.113.7")


def test_an_election_lists_standby_relays_only_where_no_member_can_relay() -> None:
    keys = [bytes([i]) * 32 for i in range(1, 5)]
    standby = [
        Member(key=bytes([9]) * 32, host="203.0.113.9", port=7000),
        Member(key=bytes([8]) * 32, host="203.0.113.8", port=7000),
    ]

    def beat(key: bytes, reach: str) -> Heartbeat:
        addr = f"192.168.{key[0]}.2:7000"
        return Heartbeat(
            run_id=RUN,
            node_key=key,
            seq=1,
            timestamp=0.0,
            expiration=get_dht_time() + 60,
            state=NodeState.READY,
            outer_step=STEP,
            data_addr=addr,
            data_reach=reach,
        )

    homes = [beat(key, "closed") for key in keys[:3]]
    election = decide(homes, STEP, deadline_passed=True, standby=standby)
    assert election is not None and [r.key for r in election.relays] == sorted(r.key for r in standby)
    # the digest covers them: a node that knows another relay set elects another membership
    other = decide(homes, STEP, deadline_passed=True, standby=standby[:1])
    assert other is not None and other.digest != election.digest
    assert election.digest == membership_digest(STEP, election.members, election.relays)
    # every edge goes through one of them, the same for both ends
    a, b = election.members[0].key, election.members[1].key
    assert relay_for(STEP, election.members, sender=a, receiver=b, standby=election.relays) in standby
    # one member that can be dialed relays the others: no standby relay in the digest
    with_public = decide([*homes, beat(keys[3], "open")], STEP, deadline_passed=True, standby=standby)
    assert with_public is not None and with_public.relays == ()
    assert with_public.digest == membership_digest(STEP, with_public.members)
    relay = relay_for(STEP, with_public.members, sender=a, receiver=b, standby=standby)
    assert relay is not None and relay.key == keys[3]
