"""The sync of one outer step for one node: ready → election → all-reduce, retried with survivors.

The trainer (and `p2ptrain join --drill`) hands over the flat fp32 pseudo-gradient of step N and its
weight; `OuterSync.sync` publishes ready(N), elects the members from the signed heartbeats, runs
the int8 all-reduce, and on failure re-elects among the live ready nodes and tries again. The
vector is averaged in place only when an all-reduce completed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass

import numpy as np

from p2ptrain.comm.dataplane import AllReduceError, DataPlaneServer, RingSettings, RingStats
from p2ptrain.comm.ring import ring_all_reduce
from p2ptrain.config import Config
from p2ptrain.faults import Faults
from p2ptrain.swarm.crash_watch import CrashWatch
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.election import (
    IN_STEPS,
    LINK_PREFIX_HEX,
    LINKS_FIELD,
    Election,
    SwarmAhead,
    elect,
    ready_for,
)
from p2ptrain.swarm.membership import HeartbeatPublisher, SwarmView, live
from p2ptrain.swarm.records import Heartbeat, NodeState

log = logging.getLogger(__name__)

MAX_PUBLISHED_LINKS = 16
"""Slow links a node keeps in its heartbeat (~30 bytes each; records stay far below 16 KiB)."""


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
        connections=comm.connections,
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
        self.view = SwarmView(dht, config.run.id, config.swarm.heartbeat_timeout)
        self.faults = Faults.from_env()
        self.links: dict[bytes, float] = {}
        """Receiver key → bytes/s of our slow links, latest measurement; published when ready."""
        self.crashes = CrashWatch()
        self._seen: dict[bytes, Heartbeat] = {}

    async def _live_heartbeats(self, step: int) -> list[Heartbeat]:
        """Live nodes of this run with this config (a node of another config is never a member),
        without those whose data port refuses connections: crashed, not worth waiting for."""
        digest, me = self.config.digest(), self.publisher.current.node_key
        beats = [beat for beat in live(await self.view.read()) if beat.config_digest in (digest, "")]
        self._seen = {beat.node_key: beat for beat in beats}
        self.crashes.watch(
            b for b in beats if b.node_key != me and b.state in IN_STEPS and b.outer_step == step
        )
        return self.crashes.alive(beats)

    def close(self) -> None:
        self.crashes.close()

    def _remember_links(self, rates: dict[bytes, float]) -> None:
        for key, rate in rates.items():
            self.links.pop(key, None)
            if math.isfinite(rate):
                self.links[key] = rate  # the newest last, so the oldest go first below
        while len(self.links) > MAX_PUBLISHED_LINKS:
            self.links.pop(next(iter(self.links)))

    def _extra_with_links(self) -> dict:
        """The record's extra fields with our slow links, which elections use to order the ring."""
        extra = {key: value for key, value in self.publisher.current.extra.items() if key != LINKS_FIELD}
        if self.links:
            extra[LINKS_FIELD] = {
                key.hex()[:LINK_PREFIX_HEX]: round(rate) for key, rate in self.links.items()
            }
        return extra

    async def _straggle(self, step: int) -> None:
        """P2PTRAIN_INJECT_LATE: be `late_seconds` later than the first other node ready for `step`."""
        me, deadline = self.publisher.current.node_key, time.monotonic() + self.config.swarm.election_timeout
        while time.monotonic() < deadline:
            beats = live(await self.view.read())
            if any(beat.node_key != me for beat in ready_for(beats, step)):
                break
            await asyncio.sleep(self.config.swarm.heartbeat_interval / 4)
        log.warning("fault injection: reporting ready(%d) %.1f s late", step, self.faults.late_seconds)
        await asyncio.sleep(self.faults.late_seconds)

    async def sync(self, step: int, vector: np.ndarray, tokens: int) -> SyncResult:
        """Average `vector` with the members of `step`; raises StepGivenUp when every attempt failed."""
        swarm = self.config.swarm
        if step == self.faults.late_step:
            await self._straggle(step)
        await self.publisher.publish(
            state=NodeState.READY, outer_step=step, tokens=tokens, extra=self._extra_with_links()
        )
        last_error: Exception | None = None
        attempt = 0
        while attempt < swarm.sync_retries:
            try:
                election = await elect(
                    lambda: self._live_heartbeats(step),
                    step,
                    swarm.straggler_deadline,
                    swarm.election_timeout,
                    poll_interval=min(0.25, swarm.heartbeat_interval),
                    me=self.publisher.current.node_key,
                    finished=self.view.finished,
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
                # a member that crashed is left out of the next election at once, and one that did not
                # answer (frozen, cut off) until its heartbeat shows it is still there
                others = [key for key in election.keys if key != self.publisher.current.node_key]
                await self._live_heartbeats(step)  # their newest records
                await self.crashes.probe_now(self._seen[key] for key in others if key in self._seen)
                if exc.unresponsive in self._seen:
                    self.crashes.suspect(self._seen[exc.unresponsive])
                continue
            self._remember_links(stats.link_rates)
            return SyncResult(election, stats, attempt)
        raise StepGivenUp(
            f"step {step}: no all-reduce completed in {swarm.sync_retries} attempts ({last_error})"
        )
