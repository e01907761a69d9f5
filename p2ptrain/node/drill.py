"""`p2ptrain drill`: outer steps with synthetic pseudo-gradients instead of a model.

It exercises everything between two nodes' trainers — heartbeats, election, the int8 all-reduce,
retries — so an operator can check a swarm's plumbing and bandwidth before training, and the tests
can check that every member ends every step with the same bytes. Each step waits a random "inner
phase" (`--inner S`, uniform in [0, S]) and writes one JSON line to the node's log file.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from p2ptrain.config import Config
from p2ptrain.deadline import pause
from p2ptrain.errors import cannot_listen
from p2ptrain.identity import NodeIdentity, short_id
from p2ptrain.node.data_server import node_server
from p2ptrain.node.interrupt import Interrupted, unless
from p2ptrain.node.outer_sync import OuterSync, StepGivenUp
from p2ptrain.node.reachability import Reachability, data_address
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.membership import HeartbeatPublisher, keep_alive
from p2ptrain.swarm.records import NodeState
from p2ptrain.swarm.start_quorum import wait_for_nodes


@dataclass(frozen=True, kw_only=True)
class DrillPlan:
    """What a drill does: `steps` outer steps of `size` values, each after a random inner phase of
    up to `inner_seconds`, once `min_nodes` live nodes are in the swarm table."""

    steps: int
    size: int
    inner_seconds: float
    min_nodes: int = 1


async def run_drill(
    config: Config,
    identity: NodeIdentity,
    *,
    dht: SwarmDHT,
    stop: asyncio.Event,
    out: TextIO,
    plan: DrillPlan,
    log_path: Path,
) -> None:
    server = node_server(config, identity)
    try:
        _, port = await server.start(config.node.data_host, config.node.data_port)
    except OSError as exc:
        raise cannot_listen("node.data_port", config.node.data_host, config.node.data_port, exc) from None
    publisher = HeartbeatPublisher.for_run(dht, identity, config, data_addr=data_address(config, port))
    await publisher.publish(state=NodeState.TRAINING, outer_step=0)
    sync = OuterSync(config, dht, publisher=publisher, server=server)
    keeper = asyncio.create_task(keep_alive(publisher, config.swarm.heartbeat_interval, stop))
    rng = random.Random(identity.public_key)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(
        f"drill: {plan.steps} outer steps of {plan.size} values, data plane on port {port}",
        file=out,
        flush=True,
    )
    reachability = Reachability(
        config, server, publisher=publisher, view=sync.view, dht=dht, standby=sync.standby
    )
    rechecks: asyncio.Task[None] | None = None
    try:
        await wait_for_nodes(config, sync.view, stop=stop, out=out, count=plan.min_nodes)
        with contextlib.suppress(Interrupted):
            await unless(reachability.first_probe(), stop.wait())
        rechecks = asyncio.create_task(reachability.run(stop))
        with log_path.open("a") as log_file:
            for step in range(plan.steps):
                if stop.is_set():
                    break
                await publisher.publish(state=NodeState.TRAINING, outer_step=step)
                await pause(stop, rng.uniform(0, plan.inner_seconds))
                if stop.is_set():
                    break
                seed = int.from_bytes(
                    hashlib.sha256(identity.public_key + step.to_bytes(8, "big")).digest()[:8], "big"
                )
                # float32 straight away: a float64 draw doubles a large drill's memory (150M values)
                vector = np.random.default_rng(seed).standard_normal(plan.size, dtype=np.float32)
                started = time.monotonic()
                try:
                    result = await unless(sync.sync(step, vector, tokens=rng.randint(1, 1000)), stop.wait())
                except Interrupted:
                    break  # told to stop in the middle of the sync
                except StepGivenUp as exc:
                    print(f"drill: step {step} given up: {exc}", file=out, flush=True)
                    given_up = {"step": step, "given_up": str(exc), "time": round(time.time(), 3)}
                    log_file.write(json.dumps(given_up) + "\n")
                    log_file.flush()
                    continue
                params_hash = hashlib.sha256(vector.data).hexdigest()  # no copy of the vector
                line = {
                    "step": step,
                    "members": [member.key.hex() for member in result.election.members],
                    "digest": result.election.digest.hex(),
                    "hash": params_hash,
                    "attempts": result.attempts,
                    "sync_s": round(time.monotonic() - started, 3),
                    "node": identity.public_key.hex(),
                    "ready_time": round(result.ready_time, 3),
                    "election_s": round(result.election_s, 3),
                    "allreduce_s": round(result.stats.seconds, 3),
                    "connect_s": round(result.stats.connect_s, 3),
                    "transfer_s": round(result.stats.transfer_s, 3),
                    "barrier_s": round(result.stats.barrier_s, 3),
                    "round_trips": {key.hex(): round(s, 4) for key, s in result.stats.round_trips.items()},
                    "failure_timeout": round(result.stats.failure_timeout, 3),
                    "bytes_sent": result.stats.bytes_sent,
                    "lanes_accepted": server.lanes_accepted,
                    "lanes_rebound": server.warm.rebound,
                    "relayed_bytes": server.relay.bytes_relayed,
                    "records": [sync.pusher.sent, sync.reads.records_taken],
                    "dht": [dht.traffic.stored, dht.traffic.read, dht.traffic.calls],
                    "time": round(time.time(), 3),
                }
                log_file.write(json.dumps(line) + "\n")
                log_file.flush()
                await publisher.publish(
                    state=NodeState.TRAINING, outer_step=step + 1, params_hash=params_hash
                )
                names = ", ".join(short_id(member.key) for member in result.election.members)
                print(
                    f"drill: step {step} done with {len(result.election.members)} members ({names}), "
                    f"hash {params_hash[:12]}",
                    file=out,
                    flush=True,
                )
    finally:
        keeper.cancel()
        if rechecks is not None:
            rechecks.cancel()
        sync.close()
        await server.close()
        sent = await publisher.deathrattle()
        outcome = "deathrattle sent" if sent else "deathrattle not confirmed"
        print(f"drill: node {identity.short_id} left ({outcome})", file=out, flush=True)
