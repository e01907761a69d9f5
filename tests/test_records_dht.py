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
from tests.helpers import LocalSwarm

RUN = "p2ptrain-debug"


def test_the_bootstrap_peer_refuses_bad_records(swarm: LocalSwarm, tmp_path: Path):
    peer = swarm.start_bootstrap()
    honest, other = load_or_create_identity(tmp_path / "a"), load_or_create_identity(tmp_path / "b")
    # a client without a validator of its own: whatever is refused, the bootstrap peer refused
    settings = DHTSettings(peers=[peer], listen=["/ip4/127.0.0.1/tcp/0"], client_mode=True, retries=2)

    async def scenario(dht: SwarmDHT) -> dict[str, bool]:
        key = heartbeat_key(RUN)
        expiration = get_dht_time() + 30
        good = Heartbeat(RUN, honest.public_key, 100, 1.0, expiration, NodeState.IDLE)
        version, body, signature = msgpack.unpackb(good.sign(honest))
        fields = msgpack.unpackb(body)
        fields["tokens"] = 999
        tampered = msgpack.packb([version, msgpack.packb(fields), signature])
        forged = replace(good, node_key=other.public_key).sign(other)  # b's record under a's subkey
        results = {
            "good": await dht.store(key, honest.public_key, good.sign(honest), expiration),
            "tampered": await dht.store(key, honest.public_key, tampered, expiration),
            "forged": await dht.store(key, honest.public_key, forged, expiration),
            "unsigned": await dht.store(key, honest.public_key, b"hello", expiration),
            "replayed": await dht.store(
                key,
                honest.public_key,
                replace(good, seq=99, expiration=expiration + 1).sign(honest),
                expiration + 1,
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
