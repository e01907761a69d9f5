"""The node agent in training mode: starts the trainer ranks, and is their link to the swarm.

`p2ptrain join --config X [--nproc N]` runs this in the agent process. It starts N rank processes
(`rank_launcher.py`), answers rank 0's messages — Ready(N) becomes ready → election → int8 all-reduce —
and keeps the heartbeat going (`swarm_link.py`). A rank that dies makes the agent send its
deathrattle and stop the other ranks; an agent that dies takes its ranks with it.

Joining a run in progress, the agent downloads the majority's checkpoint from its peers before it
starts the ranks. Finding itself behind or diverged at an outer step, it replays the missed step
from the swarm's all-reduce result or has the ranks load the majority's checkpoint in place. Either
way the next outer step skips the inner phase (weight 0), so the node catches up without delaying
anyone, and contributes from the step after. When the ranks finish, the node stays in the swarm
for nodes behind it (`_linger`), and ends on the majority's final params; a node that cannot catch
up exits saying it diverged, and marks its checkpoint so.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TextIO, TypeVar

import numpy as np

from p2ptrain.channel import (
    AgentChannel,
    Averaged,
    ChannelError,
    CheckpointWritten,
    Finished,
    Hello,
    Message,
    Progress,
    Ready,
    StepDone,
)
from p2ptrain.ckpt.format import checkpoint_places, checkpoint_step
from p2ptrain.config import Config, parameter_count
from p2ptrain.deadline import pause, within
from p2ptrain.errors import UserError
from p2ptrain.identity import NodeIdentity
from p2ptrain.memory_limits import gib
from p2ptrain.node.checkpoint_copies import (
    copy_to_disk,
    copy_to_remote,
    flush_leftovers,
    mark_diverged,
    prune_places,
    remove_staging,
)
from p2ptrain.node.failures import Diverged, TrainingFailed
from p2ptrain.node.interrupt import LEAVING_GRACE_S, Interrupted, unless
from p2ptrain.node.progress import ProgressView
from p2ptrain.node.rank_launcher import (
    RANK_STOP_TIMEOUT,
    RankGroup,
    buffer_path,
    default_nproc,
    remove_stale_buffers,
)
from p2ptrain.node.swarm_link import SoloSwarm, SwarmLink
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.records import (
    OUTER_STEPS_FIELD,
    STEP_TOKENS_FIELD,
    TOKENS_RATE_FIELD,
    TOKENS_TOTAL_FIELD,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
COPY_WAIT = 60.0
"""Seconds a stopping node waits for its background checkpoint copy before flushing RAM itself."""
DYING_RANK_S = 10.0
"""How long a closed channel waits for rank 0's exit code (its reason) before it says only that."""
MAX_RECOVERIES = 5
"""Recoveries in a row without a completed outer step in between before the node gives up."""
MAX_COPY_FAILURES = 3
"""Checkpoint copies to disk (or the remote) that fail in a row before the node stops: training on
would look fine while no checkpoint is kept anywhere (a full disk, a folder gone read-only)."""


class TrainingNode:
    def __init__(
        self,
        config: Config,
        identity: NodeIdentity,
        *,
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
        self.resume = resume
        self.started = time.monotonic()
        self.work_dir = Path(config.node.work_dir).expanduser()
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.places = checkpoint_places(config, identity.short_id)
        self.copies: asyncio.Task[None] | None = None
        self.copy_failures = 0
        self.failure: UserError | None = None
        """Why the node stopped itself (raised once it has shut down): the CLI's one line."""
        remove_stale_buffers(identity, self.work_dir)
        self.shared = buffer_path(identity, self.work_dir)
        self.ranks = RankGroup(
            config, identity, work_dir=self.work_dir, nproc=nproc or default_nproc(), shared=self.shared
        )
        self.swarm: SoloSwarm = (
            SwarmLink(config, identity, dht=dht, checkpoint_dir=self.places.write_dir)
            if dht is not None
            else SoloSwarm()
        )
        self.view = ProgressView(
            out,
            config.train.max_steps,
            inner_steps=config.train.inner_steps,
            interval=config.node.progress_interval,
        )
        self.vector: np.ndarray | None = None
        self.finished = False
        self.final_step = 0
        self.diverged = ""
        """Why the node's params are not the swarm's; written into its checkpoint's meta on exit."""
        self.params_hash = ""
        self.loaded_step: int | None = None
        """The step of the majority's checkpoint this node loaded and took no step from since."""
        self.joining = False
        self.recoveries = 0
        self.last_rate: float | None = None
        self.last_rtt_ms: float | None = None
        """The longest round trip to a member measured in the last all-reduce (status's `rtt_ms`)."""
        self.contributed = 0
        """Tokens of this node in the outer steps whose all-reduce completed since it started."""
        self.step_tokens: dict[int, int] = {}
        """Outer step → this node's tokens in its all-reduce, until the step is done (with overlap
        the next step's sync may complete first)."""
        self.last_done_at: float | None = None
        self.outer_steps = -(-config.train.max_steps // config.train.inner_steps)
        """The run's outer steps (max_steps counts inner steps), for the status page's progress."""
        """Megabits per second this node sent in its last all-reduce (for `status`)."""
        self.last_step_done = -1
        self.first_ready = True
        self.syncing: asyncio.Future[None] | None = None
        """outer.overlap: the sync of the step rank 0 handed over last, while it trains on."""

    def say(self, text: str) -> None:
        self.view.say(f"node {self.identity.short_id}: {text}")

    def _progress_fields(self, step: int) -> dict[str, Any]:
        """The run's progress as this node's record tells it after `step` (for the status page)."""
        now = time.monotonic()
        tokens = self.step_tokens.pop(step, 0)
        fields: dict[str, Any] = {
            OUTER_STEPS_FIELD: self.outer_steps,
            TOKENS_TOTAL_FIELD: self.contributed,
            STEP_TOKENS_FIELD: tokens,
        }
        if self.last_done_at is not None and now > self.last_done_at:
            fields[TOKENS_RATE_FIELD] = round(tokens / (now - self.last_done_at), 1)
        self.last_done_at = now
        return fields

    async def _guarded(self, work: Coroutine[Any, Any, T]) -> T:
        """Await `work`, unless the node is told to stop or a rank dies first (then Interrupted)."""
        running = [proc for proc in self.ranks.procs if proc.returncode is None]
        return await unless(work, self.stop.wait(), *(proc.wait() for proc in running))

    def _rank_failure(self) -> str | None:
        for rank, proc in enumerate(self.ranks.procs):
            if proc.returncode is not None and (proc.returncode != 0 or not self.finished):
                return self.ranks.describe_exit(rank)
        return None

    async def _recover(self, reason: str, step: int) -> Path:
        """Download the majority's checkpoint because the node is off track at `step`; Diverged when
        no live member can provide one (or five recoveries in a row did not help)."""
        if self.recoveries >= MAX_RECOVERIES:
            raise Diverged(step, f"{reason}, and {MAX_RECOVERIES} recoveries in a row did not help")
        self.recoveries += 1
        self.say(f"{reason}: fetching the swarm's checkpoint")
        path = await self._fetch_checkpoint(reason, wait=True)
        if path is None:  # the run may be over, every other node gone with its checkpoint
            over = await self._guarded(self.swarm.run_over())
            raise Diverged(step, f"{reason}, and {over or 'no majority of live members offers a checkpoint'}")
        return path

    async def _fetch_checkpoint(self, reason: str, wait: bool) -> Path | None:
        started = time.monotonic()
        path = await self._guarded(self.swarm.recover(self.stop, self.places.write_dir, wait))
        if path is not None:
            self.say(f"{reason}: recovered {path.name} from peers in {time.monotonic() - started:.1f} s")
            self.joining = True
            self.params_hash = ""  # the majority's params now: known again after the next step
            self.loaded_step = checkpoint_step(path)
        return path

    async def _copies_done(self, seconds: float) -> bool:
        """Whether the background copies end within `seconds` (a copy's errors are said where it
        fails; a prune's OSError here ends them as well as any)."""
        assert self.copies is not None
        with contextlib.suppress(asyncio.TimeoutError, OSError):
            await within(asyncio.shield(self.copies), seconds)
        return self.copies.done()

    def _copy_in_background(self, folder: Path) -> None:
        """Queue the disk copy of a checkpoint staged in RAM and its upload to checkpoint.remote, then
        prune both places; copies run one after another. The agent alone prunes, and only after the
        copies, so no folder vanishes under a copy that fell behind."""
        previous = self.copies

        async def copy() -> None:
            if previous is not None:
                await asyncio.shield(previous)
            keep = self.config.checkpoint.keep
            remote = self.config.checkpoint.remote
            try:
                on_disk = folder
                if self.places.staging is not None:
                    seconds = await asyncio.to_thread(copy_to_disk, self.places, folder)
                    log.info("copied %s to %s in %.2f s", folder.name, self.places.disk, seconds)
                    on_disk = self.places.disk / folder.name
                if remote:
                    seconds = await asyncio.to_thread(copy_to_remote, remote, on_disk)
                    log.info("uploaded %s to %s in %.2f s", folder.name, remote, seconds)
            # fsspec raises errors of its own too. The RAM copy is still served; a few failures in
            # a row stop the node.
            except Exception as exc:
                self.copy_failures += 1
                self.say(f"could not copy {folder.name}: {exc}")
                if self.copy_failures >= MAX_COPY_FAILURES and self.failure is None:
                    self.failure = UserError(
                        f"stopped: {self.copy_failures} checkpoint copies in a row failed ({exc}); the "
                        "checkpoints staged in RAM are freed (nowhere to keep them); fix checkpoint.dir "
                        f"{self.places.disk} (or checkpoint.remote) and --resume latest from it"
                    )
                    self.stop.set()
            else:
                self.copy_failures = 0
            await asyncio.to_thread(prune_places, self.places, keep)

        self.copies = asyncio.ensure_future(copy())

    async def _catch_up_if_off_track(self, step: int, channel: AgentChannel) -> bool:
        """If the node is off the swarm's track at `step`, fetch the majority's checkpoint and have the
        ranks load it in place (a restart would cost seconds); True when it did."""
        reason = await self._guarded(self.swarm.off_track(step, self.params_hash))
        if reason is None:
            return False
        assert self.vector is not None
        if await self._guarded(self.swarm.replay(step, self.vector)):
            self.say(f"{reason}: took outer step {step} from the swarm's all-reduce result")
            self.view.note(step, 0, "replayed")
            await channel.send(Averaged(step, 0, replayed=True))
            return True
        path = await self._recover(f"off track: {reason}", step)
        # the ranks reload it in place and are ready at once: worth waiting for (up to the deadline)
        await self.swarm.training(checkpoint_step(path))
        await channel.send(Averaged(step, 0, reload=str(path)))
        return True

    async def _answer(self, message: Ready, channel: AgentChannel) -> None:
        """Rank 0 handed step N's Δ over: catch up if off track, else sync it; one Averaged(N)."""
        assert self.vector is not None
        if self.first_ready and not self.joining:  # a run that starts: with all of wait_nodes
            await self._guarded(self.swarm.first_step(message.outer_step, self.stop))
        self.first_ready = False
        if self.swarm.behind_aim(message.outer_step):
            # we told the swarm we join at a later step: this one is taken without us, replayed below
            await self._guarded(self.swarm.wait_until_past(message.outer_step, self.stop))
        if await self._catch_up_if_off_track(message.outer_step, channel):
            return
        averaged, note = await self._guarded(
            self.swarm.average(message.outer_step, self.vector, message.tokens)
        )
        members = averaged.members
        # no all-reduce completed: if the swarm moved on meanwhile, catch up now
        if members == 0 and await self._catch_up_if_off_track(message.outer_step, channel):
            return
        if averaged.allreduce_s > 0 and averaged.bytes_sent:
            # the transfer's rate (sync_s also counts the wait for the others and the elections)
            self.last_rate = round(8 * averaged.bytes_sent / averaged.allreduce_s / 1e6, 1)
        if averaged.rtt_ms > 0:
            self.last_rtt_ms = averaged.rtt_ms
        if members > 0:
            self.contributed += message.tokens
            self.step_tokens = {s: t for s, t in self.step_tokens.items() if s >= message.outer_step - 2}
            self.step_tokens[message.outer_step] = message.tokens
        if self.joining and members > 1:
            self.joining = False
            join_s = time.monotonic() - self.started
            self.say(f"joined: contributing from outer step {message.outer_step + 1}, join_s={join_s:.1f}")
        self.view.note(message.outer_step, members, note)
        await channel.send(averaged)
        if self.config.outer.overlap.enabled and self.last_step_done < message.outer_step:
            # rank 0 trains step N + 1 already: say so now, not once it takes step N (a whole inner
            # phase later), or a node behind would still elect us for N. The hash comes with the
            # step (StepDone): a record of outer step N + 1 never shows S before step N.
            await self.swarm.training(message.outer_step + 1, params_hash="")

    async def _handle(self, message: Message, channel: AgentChannel) -> None:
        if isinstance(message, Hello):
            self.vector = np.memmap(message.buffer_path, dtype=np.float32, mode="r+", shape=(message.numel,))
            resumed = f", resumed at outer step {message.start_step}" if message.start_step else ""
            self.say(
                f"{message.parameters / 1e6:.2f}M parameters on {message.world_size} rank(s), "
                f"run {self.config.run.id!r}{resumed}"
            )
            self.ranks.micro_batch = message.micro_batch
            sequences = self.config.train.batch_size // message.world_size
            short = message.memory_estimate > message.memory_available
            self.say(
                f"memory: about {gib(message.memory_estimate)} per rank at micro-batch {message.micro_batch} "
                f"of {sequences} sequences per rank, {gib(message.memory_available)} available"
                + (": it may run out of memory" if short else "")
            )
            if not self.joining:
                # a joiner's first step has no inner phase and weight 0: it stays `joining` until it
                # is ready, so nobody waits for it (if the step is done by then, it replays it)
                await self.swarm.training(message.start_step, extra={OUTER_STEPS_FIELD: self.outer_steps})
        elif isinstance(message, Progress):
            self.view.inner(message)
            self.ranks.sample_memory()
        elif isinstance(message, Ready):
            assert self.vector is not None, "Ready before Hello"
            if self.config.outer.overlap.enabled:
                # rank 0 trains on meanwhile: keep reading its messages while the step syncs (it sends
                # the next Ready only after this step's answer, so one sync at a time)
                self.syncing = asyncio.ensure_future(self._answer(message, channel))
            else:
                await self._answer(message, channel)
        elif isinstance(message, StepDone):
            self.last_step_done = message.outer_step
            self.recoveries = 0
            self.params_hash = message.params_hash
            self.loaded_step = None
            extra = {"loss": message.loss} if message.loss == message.loss else {}
            if self.last_rate is not None:
                extra["allreduce_mbps"] = self.last_rate
            if self.last_rtt_ms is not None:
                extra["rtt_ms"] = self.last_rtt_ms
            extra.update(self._progress_fields(message.outer_step))
            await self.swarm.training(message.outer_step + 1, params_hash=message.params_hash, extra=extra)
            self.view.outer(message)
        elif isinstance(message, CheckpointWritten):
            await self.swarm.checkpoint_saved(Path(message.path), message.outer_step)
            self._copy_in_background(Path(message.path))
        elif isinstance(message, Finished):
            self.finished = True
            self.final_step = message.outer_step
            self.say(f"finished after {message.outer_step} outer steps")

    async def _next_message(self, channel: AgentChannel) -> Message:
        """Rank 0's next message; what ended an overlapped sync badly (Interrupted: a rank died or
        the node stops) is raised here as soon as it happens. Cancelled (a rank exited), it leaves
        a message read meanwhile in the channel: rank 0's last one (Finished) comes just before
        rank 1's exit."""
        while True:
            reading = channel.pending()
            waits: set[asyncio.Future[Any]] = {reading}
            if self.syncing is not None:
                waits.add(self.syncing)
            done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            syncing = self.syncing
            if syncing is not None and syncing in done:
                self.syncing = None
                syncing.result()
            if reading in done:
                return channel.take()

    async def _read_what_is_left(self, channel: AgentChannel) -> None:
        """A rank exited: where none failed, rank 0 may have sent its last messages (Finished) just
        before, and a busy event loop sees the exit first. Handle them before judging the exit."""
        if any(proc.returncode not in (None, 0) for proc in self.ranks.procs):
            return
        with contextlib.suppress(ChannelError, asyncio.TimeoutError):
            while not self.finished:
                await self._handle(await within(channel.receive(), DYING_RANK_S), channel)

    async def _run_ranks(self) -> None:
        """Run the ranks until they finish or the node is stopped; raises TrainingFailed."""
        channel = await AgentChannel.open(await self.ranks.start(self.resume, skip_first_inner=self.joining))
        failure: str | None = None
        try:
            while not self.finished:
                try:
                    await self._handle(await self._guarded(self._next_message(channel)), channel)
                except Interrupted:
                    if not self.stop.is_set():
                        await self._read_what_is_left(channel)
                    failure = None if self.stop.is_set() else self._rank_failure()
                    break
                except ChannelError:
                    # rank 0 is probably dying: give its exit code a moment to arrive (on a busy
                    # machine a rank that reports running out of memory takes seconds to exit)
                    waits = [asyncio.ensure_future(proc.wait()) for proc in self.ranks.procs]
                    await asyncio.wait(waits, timeout=DYING_RANK_S, return_when=asyncio.FIRST_COMPLETED)
                    for waiter in waits:
                        waiter.cancel()
                    failure = self._rank_failure() or "trainer rank 0 closed its channel"
                    break
            if self.finished and failure is None:
                for proc in self.ranks.procs:
                    await within(proc.wait(), RANK_STOP_TIMEOUT)
        finally:
            if self.syncing is not None:  # told to stop, it lets an all-reduce under way finish
                await asyncio.wait([self.syncing], timeout=LEAVING_GRACE_S + 1)
                self.syncing.cancel()
            channel.close()
            await self.ranks.stop()
        if failure and not self.stop.is_set():
            raise TrainingFailed(failure)

    async def _linger(self) -> None:
        """After the run: end on the swarm's final params, and stay (`swarm.finish_grace`) while
        nodes behind may still need this node's checkpoint or results to catch up."""
        step = self.final_step
        await self.swarm.finish(step, self.params_hash)
        grace = self.config.swarm.finish_grace
        deadline = time.monotonic() + grace
        announced = False
        while not self.stop.is_set():
            majority = await self._guarded(self.swarm.final_majority(step))
            if majority is not None and majority != self.params_hash:
                # a node that loaded the majority's final checkpoint (it joined as the run ended)
                # holds the majority's params, though it took no step to hash them
                if self.loaded_step != step:
                    reason = f"its final params differ from the majority's at outer step {step}"
                    path = await self._recover(reason, step)
                    await self.swarm.checkpoint_saved(path, step)
                    self._copy_in_background(path)
                self.params_hash = majority
                await self.swarm.finish(step, self.params_hash)
            behind = await self._guarded(self.swarm.behind())
            if not behind:
                return
            if time.monotonic() >= deadline:
                self.say(f"leaving after finish_grace ({grace:.0f} s); {behind} node(s) still behind")
                return
            if not announced:
                self.say(f"staying up to {grace:.0f} s for {behind} node(s) still behind")
                announced = True
            await pause(self.stop, self.config.swarm.heartbeat_interval)

    async def run(self) -> None:
        try:
            await asyncio.to_thread(flush_leftovers, self.places, self.config.checkpoint.keep)
            await self.swarm.start(self.stop, self.out)
            if self.resume is not None:  # its own checkpoint (--resume): its own error feedback too
                self.swarm.restore_feedback(self.resume, parameter_count(self.config.model))
            if self.swarm.networked and self.resume is None:
                # starting the ranks takes seconds, which nobody should wait for: the node stays
                # `joining` until it is ready for its first step
                self.resume = await self._fetch_checkpoint("joined a run in progress", wait=False)
            if not self.stop.is_set():
                await self._run_ranks()
            if self.finished and not self.stop.is_set():
                await self._linger()
        except Interrupted:
            pass
        except Diverged as exc:
            self.diverged = str(exc)
            raise
        finally:
            self.view.close()
            with contextlib.suppress(FileNotFoundError):
                self.shared.unlink()
            await self.swarm.close(self.out, self.identity.short_id)
            copying = self.copies is not None and not await self._copies_done(COPY_WAIT)
            if self.diverged:
                await asyncio.to_thread(mark_diverged, self.places, self.diverged)
            if self.failure is not None:  # the disk failed again and again: RAM is all there is
                await asyncio.to_thread(remove_staging, self.places)
            elif copying:  # a copy of the same folder is still running: the next start flushes it
                self.say(f"a checkpoint copy is still running; RAM copies kept in {self.places.staging}")
            else:
                try:
                    await asyncio.to_thread(flush_leftovers, self.places, self.config.checkpoint.keep)
                except OSError as exc:  # kept in RAM: the next start copies them (flush_leftovers)
                    self.say(f"checkpoints staged in RAM not copied to disk ({exc}); kept in RAM")
        if self.failure is not None:
            raise self.failure
