"""The sync of one outer step for one node: ready → election → all-reduce, retried with survivors.

The trainer (and `p2ptrain join --drill`) hands over the flat fp32 pseudo-gradient of step N and its
weight; `OuterSync.sync` publishes ready(N), elects the members from the signed heartbeats, runs
the int8 all-reduce, and on failure re-elects among the live ready nodes and tries again. The
vector is averaged in place only when an all-reduce completed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np

from p2ptrain.comm.dataplane import AllReduceError, DataPlaneServer, RingSettings, RingStats
from p2ptrain.comm.ring import ring_all_reduce
from p2ptrain.config import Config
from p2ptrain.faults import Faults
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.election import Election, SwarmAhead, elect
from p2ptrain.swarm.membership import HeartbeatPublisher, live, read_heartbeats
from p2ptrain.swarm.records import NodeState

log = logging.getLogger(__name__)


class StepGivenUp(RuntimeError):
    """No all-reduce of this step completed within the retries; the vector is unchanged."""


@dataclass
class SyncResult:
    election: Election
    stats: RingStats
    attempts: int


def ring_settings(config: Config) -> RingSettings:
    comm = config.comm
    return RingSettings(
        block=comm.quant_block,
        chunk_bytes=comm.chunk_bytes,
        failure_timeout=comm.failure_timeout,
        zstd=comm.zstd,
        topology=comm.topology,
        setup_timeout=max(comm.failure_timeout, config.swarm.heartbeat_timeout),
    )


def data_address(config: Config, port: int) -> str:
    if config.node.data_announce:
        return config.node.data_announce
    host = "127.0.0.1" if config.node.data_host in ("0.0.0.0", "") else config.node.data_host
    return f"{host}:{port}"


class OuterSync:
    def __init__(
        self,
        config: Config,
        dht: SwarmDHT,
        publisher: HeartbeatPublisher,
        server: DataPlaneServer,
    ):
        self.config = config
        self.dht = dht
        self.publisher = publisher
        self.server = server
        self.faults = Faults.from_env()

    async def _live_heartbeats(self) -> list:
        """Live nodes of this run with this config: a node of another config is never a member."""
        digest = self.config.digest()
        beats = live(await read_heartbeats(self.dht, self.config.run.id))
        return [beat for beat in beats if beat.config_digest in (digest, "")]

    async def sync(self, step: int, vector: np.ndarray, tokens: int) -> SyncResult:
        """Average `vector` with the members of `step`; raises StepGivenUp when every attempt failed."""
        swarm = self.config.swarm
        await self.publisher.publish(state=NodeState.READY, outer_step=step, tokens=tokens)
        last_error: Exception | None = None
        attempt = 0
        while attempt < swarm.sync_retries:
            try:
                election = await elect(
                    self._live_heartbeats,
                    step,
                    swarm.straggler_deadline,
                    swarm.election_timeout,
                    poll_interval=min(0.25, swarm.heartbeat_interval),
                    me=self.publisher.current.node_key,
                )
            except (TimeoutError, SwarmAhead) as exc:
                raise StepGivenUp(str(exc)) from None
            if self.publisher.current.node_key not in election.keys:
                # our ready record has not reached the others' view yet: read again shortly
                await asyncio.sleep(swarm.heartbeat_interval / 2)
                continue
            attempt += 1
            await self.publisher.publish(state=NodeState.SYNCING)
            try:
                stats = await ring_all_reduce(
                    self.server, step, election.members, vector, lambda *_: self.faults.die_mid_reduce(step)
                )
            except AllReduceError as exc:
                last_error = exc
                log.warning("step %d attempt %d failed (%s); electing the survivors", step, attempt, exc)
                await self.publisher.publish(state=NodeState.READY)
                continue
            return SyncResult(election, stats, attempt)
        raise StepGivenUp(
            f"step {step}: no all-reduce completed in {swarm.sync_retries} attempts ({last_error})"
        )
