"""The node agent in training mode: starts the trainer ranks, and is their link to the swarm.

`p2ptrain join --config X [--nproc N]` runs this in the agent process. It starts N rank processes
torchrun-style (one per GPU, or one on a CPU-only machine), answers rank 0's messages — Ready(N)
becomes ready → election → int8 all-reduce through `OuterSync` — and keeps the heartbeat going.
A rank that dies makes the agent send its deathrattle and stop the other ranks; an agent that
dies takes its ranks with it (they hold PR_SET_PDEATHSIG). With no swarm (no --peer) every
average is the node's own pseudo-gradient: single-node DiLoCo, the baseline.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TextIO, TypeVar

import numpy as np
import torch

from p2ptrain.comm.dataplane import DataPlaneServer
from p2ptrain.config import Config
from p2ptrain.errors import UserError
from p2ptrain.identity import NodeIdentity
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.membership import HeartbeatPublisher, wait_for_nodes
from p2ptrain.swarm.records import NodeState
from p2ptrain.sync import OuterSync, StepGivenUp, data_address, ring_settings
from p2ptrain.train.channel import (
    AgentChannel,
    Averaged,
    ChannelError,
    Finished,
    Hello,
    Message,
    Progress,
    Ready,
    StepDone,
)
from p2ptrain.train.progress import ProgressView

log = logging.getLogger(__name__)
T = TypeVar("T")
RANK_STOP_TIMEOUT = 10.0


class TrainingFailed(UserError):
    """A trainer rank died or the agent lost its channel to rank 0."""

    exit_code = 1


class Interrupted(Exception):
    """The node was asked to stop, or a rank died, while the agent waited for something else."""


def default_nproc() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 1


def buffer_path(identity: NodeIdentity, work_dir: Path) -> Path:
    """The shared pseudo-gradient file: RAM-backed /dev/shm where it exists."""
    shm = Path("/dev/shm")
    folder = shm if shm.is_dir() and os.access(shm, os.W_OK) else work_dir
    return folder / f"p2ptrain-{identity.short_id}-{os.getpid()}.grad"


class RankGroup:
    """The node's trainer processes, started torchrun-style, watched and stopped by PID."""

    def __init__(
        self,
        config: Config,
        identity: NodeIdentity,
        work_dir: Path,
        nproc: int,
        shared: Path,
        resume: Path | None = None,
    ):
        self.config = config
        self.resume = resume
        self.identity = identity
        self.work_dir = work_dir
        self.nproc = nproc
        self.shared = shared
        self.procs: list[asyncio.subprocess.Process] = []
        self.log_dir = work_dir / "logs"

    async def start(self) -> socket.socket:
        """Start the ranks; returns the agent's end of rank 0's channel."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        threads = int(os.environ.get("OMP_NUM_THREADS", 0)) or max(1, (os.cpu_count() or 1) // self.nproc)
        spec = {
            "config": self.config.model_dump(),
            "node_key": self.identity.public_key.hex(),
            "work_dir": str(self.work_dir),
            "buffer_path": str(self.shared),
            "threads": threads,
            "resume": str(self.resume) if self.resume else None,
        }
        spec_path = self.work_dir / "rank-spec.json"
        spec_path.write_text(json.dumps(spec))
        agent_end, rank_end = socket.socketpair()
        port = _free_port()
        for rank in range(self.nproc):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.nproc),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                "P2PTRAIN_RANK_SPEC": str(spec_path),
                "P2PTRAIN_AGENT_PID": str(os.getpid()),
            }
            pass_fds: tuple[int, ...] = ()
            if rank == 0:
                env["P2PTRAIN_CHANNEL_FD"] = str(rank_end.fileno())
                pass_fds = (rank_end.fileno(),)
            with (self.log_dir / f"rank-{rank}.log").open("ab") as log_file:
                proc = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-m",
                    "p2ptrain.train.rank",
                    env=env,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=asyncio.subprocess.STDOUT,
                    pass_fds=pass_fds,
                    start_new_session=True,  # Ctrl+C reaches the agent only; it stops the ranks
                )
            self.procs.append(proc)
        rank_end.close()
        return agent_end

    def describe_exit(self, rank: int) -> str:
        code = self.procs[rank].returncode
        last = _last_line(self.log_dir / f"rank-{rank}.log")
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return (
            f"trainer rank {rank} {how}"
            + (f" ({last})" if last else "")
            + f"; log: {self.log_dir}/rank-{rank}.log"
        )

    async def stop(self, timeout: float = RANK_STOP_TIMEOUT) -> None:
        running = [proc for proc in self.procs if proc.returncode is None]
        for proc in running:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        for proc in running:
            try:
                await asyncio.wait_for(proc.wait(), timeout)
            except asyncio.TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                await proc.wait()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _last_line(path: Path) -> str:
    with contextlib.suppress(OSError):
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
        if lines:
            return lines[-1][:200]
    return ""


class SwarmSide:
    """The agent's view of the swarm: heartbeats and the outer sync (or nothing, when solo)."""

    def __init__(self, config: Config, identity: NodeIdentity, dht: SwarmDHT | None):
        self.config = config
        self.identity = identity
        self.dht = dht
        self.server: DataPlaneServer | None = None
        self.publisher: HeartbeatPublisher | None = None
        self.sync: OuterSync | None = None
        self._keeper: asyncio.Task[None] | None = None

    async def start(self, stop: asyncio.Event, out: TextIO) -> None:
        if self.dht is None:
            return
        self.server = DataPlaneServer(self.identity, ring_settings(self.config))
        _, port = await self.server.start(self.config.node.data_host, self.config.node.data_port)
        self.publisher = HeartbeatPublisher(
            self.dht,
            self.identity,
            self.config.run.id,
            ttl=self.config.swarm.heartbeat_timeout,
            config_digest=self.config.digest(),
            data_addr=data_address(self.config, port),
        )
        await self.publisher.publish(state=NodeState.JOINING)
        self.sync = OuterSync(self.config, self.dht, self.publisher, self.server)
        self._keeper = asyncio.create_task(self._keep_alive(stop))
        await wait_for_nodes(self.config, self.dht, stop, out, self.config.swarm.wait_nodes)

    async def _keep_alive(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.swarm.heartbeat_interval)
            if not stop.is_set() and self.publisher is not None and not await self.publisher.publish():
                log.warning("heartbeat not stored by any DHT peer; retrying")

    async def training(self, outer_step: int, **fields: Any) -> None:
        if self.publisher is not None:
            await self.publisher.publish(state=NodeState.TRAINING, outer_step=outer_step, **fields)

    async def average(self, step: int, vector: np.ndarray, tokens: int) -> tuple[int, str]:
        """(members, note) — vector averaged in place when members > 0, unchanged otherwise."""
        if self.sync is None:
            return 1, "solo"
        started = time.monotonic()
        try:
            result = await self.sync.sync(step, vector, tokens)
        except StepGivenUp as exc:
            log.warning("outer step %d given up: %s", step, exc)
            return 0, f"given up: {exc}"
        seconds = time.monotonic() - started
        megabytes = result.stats.bytes_sent / 1e6
        return len(result.election.members), f"sync {seconds:.2f} s, {megabytes:.2f} MB sent"

    async def close(self, out: TextIO, short_id: str) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
        if self.server is not None:
            await self.server.close()
        if self.publisher is not None:
            try:
                sent = await self.publisher.deathrattle()
            except Exception as exc:  # best effort: the others fall back to the heartbeat timeout
                log.warning("deathrattle not sent: %s", exc)
                sent = False
            outcome = "deathrattle sent" if sent else "deathrattle not confirmed; peers will time it out"
            print(f"node {short_id} left the swarm ({outcome})", file=out, flush=True)


class TrainingNode:
    def __init__(
        self,
        config: Config,
        identity: NodeIdentity,
        dht: SwarmDHT | None,
        stop: asyncio.Event,
        out: TextIO,
        nproc: int = 0,
        resume: Path | None = None,
    ):
        self.config = config
        self.identity = identity
        self.stop = stop
        self.out = out
        self.work_dir = Path(config.node.work_dir).expanduser()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.shared = buffer_path(identity, self.work_dir)
        self.ranks = RankGroup(config, identity, self.work_dir, nproc or default_nproc(), self.shared, resume)
        self.swarm = SwarmSide(config, identity, dht)
        self.view = ProgressView(out, config.train.max_steps)
        self.vector: np.ndarray | None = None
        self.finished = False

    def say(self, text: str) -> None:
        self.view.say(f"node {self.identity.short_id}: {text}")

    async def _guarded(self, work: Coroutine[Any, Any, T]) -> T:
        """Await `work`, unless the node is told to stop or a rank dies first (then Interrupted)."""
        task = asyncio.ensure_future(work)
        stopper = asyncio.ensure_future(self.stop.wait())
        deaths = [asyncio.ensure_future(proc.wait()) for proc in self.ranks.procs]
        try:
            await asyncio.wait([task, stopper, *deaths], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in (stopper, *deaths):
                waiter.cancel()
        if task.done():
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
        raise Interrupted

    def _rank_failure(self) -> str | None:
        for rank, proc in enumerate(self.ranks.procs):
            if proc.returncode is not None and (proc.returncode != 0 or not self.finished):
                return self.ranks.describe_exit(rank)
        return None

    async def _handle(self, message: Message, channel: AgentChannel) -> None:
        if isinstance(message, Hello):
            self.vector = np.memmap(message.buffer_path, dtype=np.float32, mode="r+", shape=(message.numel,))
            resumed = f", resumed at outer step {message.start_step}" if message.start_step else ""
            self.say(
                f"{message.parameters / 1e6:.2f}M parameters on {message.world_size} rank(s), "
                f"run {self.config.run.id!r}{resumed}"
            )
            await self.swarm.training(message.start_step)
        elif isinstance(message, Progress):
            self.view.inner(message)
        elif isinstance(message, Ready):
            assert self.vector is not None, "Ready before Hello"
            members, note = await self._guarded(
                self.swarm.average(message.outer_step, self.vector, message.tokens)
            )
            self.view.note(message.outer_step, members, note)
            await channel.send(Averaged(message.outer_step, members))
        elif isinstance(message, StepDone):
            await self.swarm.training(message.outer_step + 1, params_hash=message.params_hash)
            self.view.outer(message)
        elif isinstance(message, Finished):
            self.finished = True
            self.say(f"finished after {message.outer_step} outer steps")

    async def run(self) -> None:
        await self.swarm.start(self.stop, self.out)
        channel = await AgentChannel.open(await self.ranks.start())
        failure: str | None = None
        try:
            while not self.finished:
                try:
                    message = await self._guarded(channel.receive())
                    await self._handle(message, channel)
                except Interrupted:
                    failure = self._rank_failure()
                    break
                except ChannelError:
                    # rank 0 is probably dying: give its exit code a moment to arrive
                    waits = [asyncio.ensure_future(proc.wait()) for proc in self.ranks.procs]
                    await asyncio.wait(waits, timeout=2.0, return_when=asyncio.FIRST_COMPLETED)
                    for waiter in waits:
                        waiter.cancel()
                    failure = self._rank_failure() or "trainer rank 0 closed its channel"
                    break
            if self.finished:
                for proc in self.ranks.procs:
                    await asyncio.wait_for(proc.wait(), RANK_STOP_TIMEOUT)
        finally:
            self.view.close()
            channel.close()
            await self.ranks.stop()
            with contextlib.suppress(FileNotFoundError):
                self.shared.unlink()
            await self.swarm.close(self.out, self.identity.short_id)
        if failure and not self.stop.is_set():
            raise TrainingFailed(failure)
