"""Forged, tampered and replayed heartbeats are refused by a real DHT peer, not only by readers."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import msgpack
from hivemind.utils import get_dht_time

from p2ptrain.identity import load_or_create_identity
from p2ptrain.swarm.dht import DHTSettings, SwarmDHT
from p2ptrain.swarm.records import Heartbeat, NodeState, heartbeat_key
from tests.support.helpers import LocalSwarm

RUN = "p2ptrain-debug"


def test_the_bootstrap_peer_refuses_bad_records(swarm: LocalSwarm, tmp_path: Path) -> None:
    peer = swarm.start_bootstrap()
    honest, other = load_or_create_identity(tmp_path / "a"), load_or_create_identity(tmp_path / "b")
    # a client without a validator of its own: whatever is refused, the bootstrap peer refused
    settings = DHTSettings(peers=[peer], listen=["/ip4/127.0.0.1/tcp/0"], client_mode=True, retries=2)

    async def scenario(dht: SwarmDHT) -> tuple[dict[str, bool], bytes]:
        key = heartbeat_key(RUN)
        expiration = get_dht_time() + 30
        good = Heartbeat(
            run_id=RUN,
            node_key=honest.public_key,
            seq=100,
            timestamp=1.0,
            expiration=expiration,
            state=NodeState.IDLE,
        )
        version, body, signature = msgpack.unpackb(good.sign(honest))
        fields = msgpack.unpackb(body)
        fields["tokens"] = 999
        tampered = msgpack.packb([version, msgpack.packb(fields), signature])
        forged = replace(good, node_key=other.public_key).sign(other)  # b's record under a's subkey
        results = {
            "good": await dht.store(key, honest.public_key, value=good.sign(honest), expiration=expiration),
            "tampered": await dht.store(key, honest.public_key, value=tampered, expiration=expiration),
            "forged": await dht.store(key, honest.public_key, value=forged, expiration=expiration),
            "unsigned": await dht.store(key, honest.public_key, value=b"hello", expiration=expiration),
            "replayed": await dht.store(
                key,
                honest.public_key,
                value=replace(good, seq=99, expiration=expiration + 1).sign(honest),
                expiration=expiration + 1,
            ),
        }
        return results, good.sign(honest)

    async def read(dht: SwarmDHT) -> bytes | None:
        stored = await dht.get(heartbeat_key(RUN))
        return stored[honest.public_key].value if stored and honest.public_key in stored else None

    with SwarmDHT.start(settings) as client:
        results, good_value = asyncio.run(scenario(client))
    # a fresh reader (no local copy of what the writer tried) sees what the bootstrap peer kept
    with SwarmDHT.start(settings) as reader:
        results["still_good"] = asyncio.run(read(reader)) == good_value
    assert results == {
        "good": True,
        "tampered": False,
        "forged": False,
        "unsigned": False,
        "replayed": False,
        "still_good": True,
    }


def test_the_bootstrap_peer_keeps_junk_and_far_expirations_out_of_a_runs_key(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    """The bootstrap peer knows no run, yet once it has seen a heartbeat at a key it takes nothing
    else there; and it refuses a validly signed record that would live for years."""
    peer = swarm.start_bootstrap()
    honest, stranger = load_or_create_identity(tmp_path / "a"), load_or_create_identity(tmp_path / "s")
    settings = DHTSettings(peers=[peer], listen=["/ip4/127.0.0.1/tcp/0"], client_mode=True, retries=2)
    run = "some-run-the-bootstrap-never-heard-of"

    async def scenario(dht: SwarmDHT) -> dict[str, bool]:
        key, now = heartbeat_key(run), get_dht_time()
        good = Heartbeat(
            run_id=run,
            node_key=honest.public_key,
            seq=100,
            timestamp=1.0,
            expiration=now + 30,
            state=NodeState.IDLE,
        )
        decade = Heartbeat(
            run_id=run,
            node_key=stranger.public_key,
            seq=100,
            timestamp=1.0,
            expiration=now + 10 * 365 * 86400,
            state=NodeState.IDLE,
        )
        return {
            "good": await dht.store(key, honest.public_key, value=good.sign(honest), expiration=now + 30),
            "junk": await dht.store(key, b"junk", value=b"\x00" * 512, expiration=now + 30),
            "decade": await dht.store(
                key, stranger.public_key, value=decade.sign(stranger), expiration=decade.expiration
            ),
            "elsewhere": await dht.store("some/other/key", b"x", value=b"\x00" * 512, expiration=now + 30),
        }

    async def read(dht: SwarmDHT) -> set[bytes]:
        return set(await dht.get(heartbeat_key(run)) or {})

    with SwarmDHT.start(settings) as client:
        results = asyncio.run(scenario(client))
    with SwarmDHT.start(settings) as reader:
        kept = asyncio.run(read(reader))
    assert results == {"good": True, "junk": False, "decade": False, "elsewhere": True}
    assert kept == {honest.public_key}
