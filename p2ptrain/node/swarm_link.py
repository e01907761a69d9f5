"""The agent's side of the swarm: heartbeats, outer sync, the checkpoint sidecar and recovery.

`SwarmLink` is what a training node needs from the network; `SoloSwarm` stands in for it when the
node trains alone. Recovery happens when a node joins a run in progress, and whenever a node finds
itself off the swarm's track at an outer step: behind it (the others are past that step) or
diverged from it (the params hash a majority of the step's members published differs from its own).
A node behind by a step or two first tries to replay the steps it missed from their all-reduce
results (ckpt/replay.py), which is a quarter of one checkpoint file's bytes per step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from p2ptrain.channel import Averaged
from p2ptrain.ckpt.fetch import (
    ACTIVE,
    RecoveryError,
    fetch_checkpoint,
    majority_checkpoint,
)
from p2ptrain.ckpt.format import FEEDBACK_FILE, max_checkpoint_bytes
from p2ptrain.ckpt.manifest import build_manifest
from p2ptrain.ckpt.replay import (
    RecentResults,
    ReplayError,
    ResultCollector,
    StepResult,
    fetch_result,
    max_result_bytes,
    result_sources,
    unpack_into,
)
from p2ptrain.ckpt.sidecar import CheckpointSidecar
from p2ptrain.comm.reduce.gather import sparse_code
from p2ptrain.config import Config, parameter_count
from p2ptrain.deadline import pause
from p2ptrain.errors import cannot_listen
from p2ptrain.identity import NodeIdentity
from p2ptrain.identity import short_id as short_key
from p2ptrain.node.config_check import refuse_other_settings
from p2ptrain.node.data_server import node_server
from p2ptrain.node.interrupt import Interrupted, unless
from p2ptrain.node.loneliness import LoneWatch
from p2ptrain.node.outer_sync import OuterSync, StepGivenUp
from p2ptrain.node.reachability import Reachability, data_address
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.election import join_aim, swarm_ahead
from p2ptrain.swarm.membership import HeartbeatPublisher, SwarmView, keep_alive, live
from p2ptrain.swarm.records import Heartbeat, NodeState
from p2ptrain.swarm.start_quorum import pause_a_beat, run_over, wait_for_first_step, wait_for_nodes
from p2ptrain.web.dashboard import Dashboard, serve_dashboard

log = logging.getLogger(__name__)


UNFINISHED = (NodeState.JOINING, NodeState.TRAINING, NodeState.READY, NodeState.SYNCING)


class SoloSwarm:
    """No network: every average is the node's own pseudo-gradient."""

    networked = False

    async def start(self, stop: asyncio.Event, out: TextIO) -> None:
        pass

    async def training(self, outer_step: int, **fields: Any) -> None:
        pass

    async def first_step(self, step: int, stop: asyncio.Event) -> None:
        pass

    async def average(self, step: int, vector: np.ndarray, tokens: int) -> tuple[Averaged, str]:
        return Averaged(step, 1), "solo"

    async def checkpoint_saved(self, folder: Path, outer_step: int) -> None:
        pass

    def restore_feedback(self, folder: Path, size: int) -> None:
        pass

    async def off_track(self, step: int, params_hash: str) -> str | None:
        return None

    def behind_aim(self, step: int) -> bool:
        return False

    async def wait_until_past(self, step: int, stop: asyncio.Event) -> bool:
        return False

    async def run_over(self) -> str | None:
        return None

    async def finish(self, outer_step: int, params_hash: str) -> None:
        pass

    async def final_majority(self, outer_step: int) -> str | None:
        return None

    async def behind(self) -> int:
        return 0

    async def replay(self, step: int, vector: np.ndarray) -> bool:
        return False

    async def recover(self, stop: asyncio.Event, dest: Path, wait: bool) -> Path | None:
        return None

    async def close(self, out: TextIO, short_id: str) -> None:
        pass


class SwarmLink(SoloSwarm):
    networked = True

    def __init__(self, config: Config, identity: NodeIdentity, *, dht: SwarmDHT, checkpoint_dir: Path):
        self.config = config
        self.identity = identity
        self.dht = dht
        self.server = node_server(config, identity)
        self.results = RecentResults(config.checkpoint.replay_steps)
        self.code = sparse_code(config.comm) if config.comm.codec == "sparse" else None
        """The sparse codec's code, whose steps are kept and replayed as every member's share."""
        self.sidecar = CheckpointSidecar(
            checkpoint_dir,
            config.shared(),
            results=self.results,
            reach_proof=self.server.reach.proof_arrived,
            serve_bytes_per_s=config.node.serve_mbps * 1e6 / 8,
        )
        self.collector: ResultCollector | None = None
        """Results of the steps the swarm takes while this node downloads a checkpoint (replayed after)."""
        self.aim: int | None = None
        """The outer step this node, catching up, last told the swarm it joins at (`replay`)."""
        self.publisher: HeartbeatPublisher | None = None
        self.sync: OuterSync | None = None
        self._keeper: asyncio.Task[None] | None = None
        self._rechecks: asyncio.Task[None] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self.dashboard: Dashboard | None = None
        self.lonely = LoneWatch(run_id=config.run.id, authority=config.run.authority)

    async def start(self, stop: asyncio.Event, out: TextIO) -> None:
        node = self.config.node
        try:
            _, port = await self.server.start(node.data_host, node.data_port)
        except OSError as exc:
            raise cannot_listen("node.data_port", node.data_host, node.data_port, exc) from None
        try:
            ckpt_port = await self.sidecar.start(node.data_host, node.ckpt_port)
        except OSError as exc:
            raise cannot_listen("node.ckpt_port", node.data_host, node.ckpt_port, exc) from None
        data_addr = data_address(self.config, port)
        ckpt_addr = node.ckpt_announce or f"http://{data_addr.rpartition(':')[0]}:{ckpt_port}"
        self.publisher = HeartbeatPublisher.for_run(
            self.dht, self.identity, self.config, data_addr=data_addr, ckpt_addr=ckpt_addr
        )
        await self.publisher.publish(state=NodeState.JOINING)
        print(f"checkpoints served on port {ckpt_port} (announced as {ckpt_addr})", file=out, flush=True)
        self.sync = OuterSync(self.config, self.dht, publisher=self.publisher, server=self.server)
        self._keeper = asyncio.create_task(
            keep_alive(self.publisher, self.config.swarm.heartbeat_interval, stop)
        )
        if node.dashboard:
            self.dashboard = await serve_dashboard(
                node.dashboard,
                self.sync.view.read,
                run_id=self.config.run.id,
                out=out,
                authority=self.config.run.authority_key,
            )
        await wait_for_nodes(
            self.config, self.sync.view, stop=stop, out=out, count=self.config.swarm.wait_nodes
        )
        reachability = Reachability(
            self.config,
            self.server,
            publisher=self.publisher,
            view=self.sync.view,
            dht=self.dht,
            standby=self.sync.standby,
        )
        with contextlib.suppress(Interrupted):
            await unless(reachability.first_probe(), stop.wait())
        self._rechecks = asyncio.create_task(reachability.run(stop))
        self._watcher = asyncio.create_task(self._watch_peers(stop))
        await self._check_config()

    async def _watch_peers(self, stop: asyncio.Event) -> None:
        """Read the records every half heartbeat timeout where nothing else did (an inner phase
        reads none for minutes), so the node says who left when it happens (the view's roster)."""
        while not stop.is_set():
            await pause(stop, self.config.swarm.heartbeat_timeout / 2)
            if not stop.is_set():
                try:
                    await self._view().read(cached=True)  # no DHT round trip after a recent read
                except Exception as exc:  # only what the node logs about its peers depends on it
                    log.debug("reading the swarm's records failed: %s", exc)

    def _view(self) -> SwarmView:
        assert self.sync is not None, "start() first"
        return self.sync.view

    async def _check_config(self) -> None:
        await refuse_other_settings(self.config, self.identity.public_key, await self._view().read())

    async def _peers(self) -> list[Heartbeat]:
        """Live, active members of this run with this config, other than this node."""
        me = self.identity.public_key
        digest = self.config.digest()
        beats = live(await self._view().read())
        return [b for b in beats if b.node_key != me and b.state in ACTIVE and b.config_digest == digest]

    async def first_step(self, step: int, stop: asyncio.Event) -> None:
        """Before this node's first step in a run that starts: wait for the nodes still starting."""
        await wait_for_first_step(
            self.config, self._view(), stop=stop, step=step, me=self.identity.public_key
        )

    async def training(self, outer_step: int, **fields: Any) -> None:
        """Publish that this node trains toward `outer_step`; an `extra` it gives keeps the node's
        measured paths (the status shows them)."""
        assert self.publisher is not None
        if "extra" in fields and self.sync is not None:
            fields["extra"] = {**fields["extra"], **self.sync.extras.path_fields()}
        await self.publisher.publish(state=NodeState.TRAINING, outer_step=outer_step, **fields)

    async def average(self, step: int, vector: np.ndarray, tokens: int) -> tuple[Averaged, str]:
        """(what happened, a note to print) — the vector is averaged in place when members > 0."""
        assert self.sync is not None
        await self._check_config()
        started = time.monotonic()
        try:
            result = await self.sync.sync(step, vector, tokens)
        except StepGivenUp as exc:
            log.warning("outer step %d given up: %s", step, exc)
            return Averaged(step, 0), f"given up: {exc}"
        seconds = time.monotonic() - started
        members = len(result.election.members)
        warning = self.lonely.step_done(members)
        if warning is not None:
            log.warning("%s", warning)
        comm = self.config.comm
        self.results.add(
            step,
            StepResult(
                numel=vector.shape[0],
                block=comm.quant_block,
                chunks=result.stats.result,
                bits=comm.bits,
                code=self.code,
                shares=result.stats.shares,
                weights=result.stats.weights,
            ),
        )
        ring = [short_key(member.key) for member in result.election.members]
        averaged = Averaged(step, len(ring), ring, seconds, result.stats.bytes_sent)
        averaged.relayed_bytes = self.server.relay.bytes_relayed
        averaged.allreduce_s = result.stats.seconds
        averaged.rtt_ms = round(1000 * max(result.stats.round_trips.values(), default=0.0), 1)
        if members == 1:
            return averaged, f"alone: waited {result.election_s:.1f} s for other nodes of the run"
        return averaged, f"sync {seconds:.2f} s, {result.stats.bytes_sent / 1e6:.2f} MB sent"

    async def checkpoint_saved(self, folder: Path, outer_step: int) -> None:
        """Hash the new checkpoint, serve it, and announce its digest; then keep this node's error
        feedback beside it (after the manifest: never served)."""
        manifest = await asyncio.to_thread(build_manifest, folder, outer_step)
        self.sidecar.announce(manifest)
        assert self.publisher is not None
        await self.publisher.publish(ckpt_digest=manifest.digest)
        if self.sync is not None and self.sync.feedback is not None:
            # as it is now: with a sync under way, one step ahead of the checkpoint (a heuristic's
            # state, not S: a step off costs nothing a restart from zeros would not)
            await asyncio.to_thread(self.sync.feedback.save, folder / FEEDBACK_FILE)

    def restore_feedback(self, folder: Path, size: int) -> None:
        """The error feedback this node kept beside the checkpoint it resumes from, if any."""
        path = folder / FEEDBACK_FILE
        if self.sync is None or self.sync.feedback is None or not path.exists():
            return
        problem = self.sync.feedback.load(path, size)
        if problem is None:
            log.info("error feedback restored from %s", path)
        else:
            log.warning("error feedback in %s not taken (%s): starting from zeros", path, problem)

    async def off_track(self, step: int, params_hash: str) -> str | None:
        """Why this node, about to sync `step`, is off the swarm's track (None when it is on it)."""
        peers = await self._peers()
        if swarm_ahead(peers, step, me=self.identity.public_key, finished=self._view().finished):
            return f"the swarm is past outer step {step}"
        self._stop_collecting()  # in time for this step: nothing left to replay
        at_step = [b for b in peers if b.outer_step == step]
        hashes = Counter(b.params_hash for b in at_step if b.params_hash)
        if params_hash and hashes:
            majority, count = hashes.most_common(1)[0]
            if majority != params_hash and 2 * count > len(at_step):
                return f"its params differ from the majority's at outer step {step}"
        return None

    def behind_aim(self, step: int) -> bool:
        """Whether this node told the swarm it joins at a step after `step` (`replay`): the swarm
        takes `step` without it, and the node replays it."""
        return self.aim is not None and step < self.aim

    async def wait_until_past(self, step: int, stop: asyncio.Event) -> bool:
        """Wait (at most swarm.election_timeout) until the swarm is past `step`; False if it is not,
        or as soon as no other node is at `step` or past it (nobody is taking it)."""
        deadline = time.monotonic() + self.config.swarm.election_timeout
        me = self.identity.public_key
        while not stop.is_set() and time.monotonic() < deadline:
            peers = await self._peers()
            if swarm_ahead(peers, step, me=me, finished=self._view().finished):
                return True
            if not any(b.outer_step >= step for b in peers):
                return False
            await pause_a_beat(self.config, stop)
        return False

    async def replay(self, step: int, vector: np.ndarray) -> bool:
        """If the swarm is past `step`, decode the result of its all-reduce of `step`, fetched from a
        member that did it, into `vector`; False (vector unchanged) when the swarm is not ahead or
        no member still keeps that result."""
        peers = await self._peers()
        if not swarm_ahead(peers, step, me=self.identity.public_key, finished=self._view().finished):
            return False
        # announce the step we aim for at once, so the others, soon ready for it, wait for us
        self.aim = join_aim(peers, step, me=self.identity.public_key)
        await self.training(self.aim, params_hash="")  # S is not at that step yet: no hash
        collected = self.collector.take(step) if self.collector is not None else None
        if collected is not None and await self._decode(collected, step, vector):
            return True
        limit = self._result_limit(vector.shape[0])
        packed = await fetch_result(
            result_sources(peers, step), step, limit=limit, timeout=self.config.checkpoint.fetch_timeout
        )
        return packed is not None and await self._decode(packed, step, vector)

    async def _decode(self, packed: bytes, step: int, vector: np.ndarray) -> bool:
        """Step `step`'s packed result into `vector`; False (vector unchanged) if it does not decode."""
        comm = self.config.comm
        try:
            unpack = functools.partial(
                unpack_into, buffer=vector, block=comm.quant_block, bits=comm.bits, code=self.code
            )
            await asyncio.to_thread(unpack, packed, step)
        except ReplayError as exc:
            log.warning("result of step %d refused: %s", step, exc)
            return False
        return True

    def _result_limit(self, numel: int) -> int:
        comm = self.config.comm
        return max_result_bytes(
            numel, comm.quant_block, chunk_values=comm.chunk_bytes // 4, bits=comm.bits, code=self.code
        )

    def _collect_results(self, holders: list[Heartbeat]) -> None:
        """While the checkpoint downloads, collect the results of the steps the swarm takes meanwhile,
        from the step before the holders' (the checkpoint's own step at the latest) on; at most the
        size of the fp32 vector twice in RAM (8 results at int8). `holders`: not empty."""
        if self.collector is None:
            numel = parameter_count(self.config.model)
            self.collector = ResultCollector(
                self._peers,
                self._result_limit(numel),
                max_bytes=8 * numel,
                timeout=self.config.checkpoint.fetch_timeout,
                interval=self.config.swarm.heartbeat_interval,
            )
        # the median: a stranger announcing the same digest at step 0 cannot send it back to the start
        self.collector.start(statistics.median_low(b.outer_step for b in holders) - 1)

    def _stop_collecting(self) -> None:
        if self.collector is not None:
            self.collector.stop()
            self.collector = None

    async def recover(self, stop: asyncio.Event, dest: Path, wait: bool) -> Path | None:
        """Download the majority's checkpoint; None when no live member has one (a fresh run).

        With `wait`, keep re-reading the heartbeats (bounded by election_timeout) until a majority
        agrees — a node that is off track needs a checkpoint, whatever the moment. A download that
        fails (the holders moved on to a newer checkpoint meanwhile, or went away) starts over from
        a fresh read, within the same bound.
        """
        path = None
        try:
            path = await self._download_majority(stop, dest, wait)
            return path
        finally:
            if path is None:
                self._stop_collecting()  # nothing downloaded: nothing to replay onto

    async def _download_majority(self, stop: asyncio.Event, dest: Path, wait: bool) -> Path | None:
        deadline = time.monotonic() + self.config.swarm.election_timeout
        while not stop.is_set():
            beats = await self._peers()
            if not beats:
                return None  # nobody to download from, however long we wait
            found = majority_checkpoint(beats, self.identity.public_key, self.config.digest())
            if found is not None:
                digest, holders = found
                self._collect_results([b for b in beats if b.ckpt_digest == digest])
                try:
                    bound = max_checkpoint_bytes(parameter_count(self.config.model))
                    timeout = self.config.checkpoint.fetch_timeout
                    return await fetch_checkpoint(
                        digest, holders, dest_dir=dest, timeout=timeout, max_bytes=bound
                    )
                except RecoveryError as exc:
                    if time.monotonic() > deadline:
                        raise
                    log.warning("recovery failed, reading the swarm again: %s", exc)
                    await asyncio.sleep(self.config.swarm.heartbeat_interval / 2)
                    continue
            if (not wait and not any(b.ckpt_digest for b in beats)) or time.monotonic() > deadline:
                return None
            await pause_a_beat(self.config, stop)
        return None

    async def run_over(self) -> str | None:
        """Why there is nothing left to catch up to, when nodes finished the run and no other live
        node of it is left; None otherwise (`start_quorum.run_over`)."""
        finished = self._view().finished
        if not finished or await self._peers():
            return None
        return run_over(self.config.run.id, finished)

    async def finish(self, outer_step: int, params_hash: str) -> None:
        """Say that this node finished the run at `outer_step` with θ of `params_hash`."""
        assert self.publisher is not None
        await self.publisher.publish(state=NodeState.FINISHED, outer_step=outer_step, params_hash=params_hash)

    async def final_majority(self, outer_step: int) -> str | None:
        """The params hash that a strict majority of the run's other live nodes finished
        `outer_step` with (so one finished record alone, a stranger's, decides nothing)."""
        peers = await self._peers()
        done = [b for b in peers if b.state is NodeState.FINISHED and b.outer_step == outer_step]
        hashes = Counter(b.params_hash for b in done if b.params_hash)
        if not hashes:
            return None
        majority, count = hashes.most_common(1)[0]
        return majority if 2 * count > len(peers) else None

    async def behind(self) -> int:
        """Live nodes of this run that have not finished it yet (a finished node waits for them);
        one whose data port refuses connections has crashed and is not waited for."""
        assert self.sync is not None
        me = self.identity.public_key
        digest = self.config.digest()
        pending = [
            b
            for b in live(await self._view().read())
            if b.node_key != me and b.config_digest == digest and b.state in UNFINISHED
        ]
        self.sync.crashes.watch(pending)
        return len(self.sync.crashes.alive(pending))

    async def close(self, out: TextIO, short_id: str) -> None:
        self._stop_collecting()
        for task in (self._keeper, self._rechecks, self._watcher):
            if task is not None:
                task.cancel()
        if self.sync is not None:
            self.sync.close()
        await self.server.close()
        await self.sidecar.close()
        if self.dashboard is not None:
            await self.dashboard.close()
        if self.publisher is not None:
            try:
                sent = await self.publisher.deathrattle()
            except Exception as exc:  # best effort: the others fall back to the heartbeat timeout
                log.warning("deathrattle not sent: %s", exc)
                sent = False
            outcome = "deathrattle sent" if sent else "deathrattle not confirmed; peers will time it out"
            print(f"node {short_id} left the swarm ({outcome})", file=out, flush=True)
