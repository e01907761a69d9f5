"""What rank 0 needs from its node agent, and the two ways to have it: the channel, or no agent.

Rank 0 hands every pseudo-gradient to the agent and waits for its answer (p2ptrain/channel.py is
the protocol); `SoloLink` stands in where there is no agent (single-node baselines, benchmarks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from p2ptrain.channel import (
    Averaged,
    CheckpointWritten,
    Finished,
    Hello,
    Progress,
    RankChannel,
    Ready,
    StepDone,
)


class AgentLink(Protocol):
    """What rank 0 needs from the node agent (a channel to the agent process, or an in-process stub)."""

    agent_prunes: bool
    """The agent removes old checkpoints, after copying them to disk; else the rank's writer does."""

    def buffer(self, numel: int) -> torch.Tensor: ...
    def started(self, hello: Hello) -> None: ...
    def progress(self, progress: Progress) -> None: ...
    def average(self, ready: Ready, buffer: torch.Tensor) -> Averaged: ...
    def submit(self, ready: Ready) -> None: ...
    def arrived(self, outer_step: int) -> bool: ...
    def collect(self, outer_step: int) -> Averaged: ...
    def step_done(self, done: StepDone) -> None: ...
    def checkpoint_written(self, written: CheckpointWritten) -> None: ...
    def finished(self, outer_step: int) -> None: ...


def shared_instruction(averaged: Averaged | None, group: dist.ProcessGroup | None) -> tuple[str, bool]:
    """What every local rank must act on in rank 0's answer (`averaged`, None on the others): a
    checkpoint to reload instead (its path, or ""), and whether the step was replayed from the
    swarm's result. A collective over the node's ranks (`group`; None with one rank)."""
    box = [averaged.reload, averaged.replayed] if averaged else ["", False]
    if group is not None:
        dist.broadcast_object_list(box, src=0, group=group)
    return str(box[0]), bool(box[1])


class SoloLink:
    """No swarm: the average of one pseudo-gradient is itself (the single-node DiLoCo baseline)."""

    agent_prunes = False

    def buffer(self, numel: int) -> torch.Tensor:
        return torch.empty(numel, dtype=torch.float32)

    def started(self, hello: Hello) -> None:
        pass

    def progress(self, progress: Progress) -> None:
        pass

    def average(self, ready: Ready, buffer: torch.Tensor) -> Averaged:
        return Averaged(ready.outer_step, 1)

    def submit(self, ready: Ready) -> None:
        pass

    def arrived(self, outer_step: int) -> bool:
        return True

    def collect(self, outer_step: int) -> Averaged:
        return Averaged(outer_step, 1)

    def step_done(self, done: StepDone) -> None:
        pass

    def checkpoint_written(self, written: CheckpointWritten) -> None:
        pass

    def finished(self, outer_step: int) -> None:
        pass


class ChannelLink:
    """Rank 0's AgentLink to the node agent: messages on the socket, the vector in a shared file."""

    agent_prunes = True

    def __init__(self, channel: RankChannel, buffer_path: Path):
        self.channel = channel
        self.buffer_path = buffer_path
        self._arrived: Averaged | None = None
        """An answer `arrived` read, for `collect`."""

    def buffer(self, numel: int) -> torch.Tensor:
        with self.buffer_path.open("wb") as handle:
            handle.truncate(numel * 4)
        return torch.from_file(str(self.buffer_path), shared=True, size=numel, dtype=torch.float32)

    def started(self, hello: Hello) -> None:
        hello.buffer_path = str(self.buffer_path)
        self.channel.send(hello)

    def progress(self, progress: Progress) -> None:
        self.channel.send(progress)

    def average(self, ready: Ready, buffer: torch.Tensor) -> Averaged:
        self.submit(ready)
        return self.collect(ready.outer_step)

    def submit(self, ready: Ready) -> None:
        """Hand the buffer to the agent; it is the agent's until `collect` returns (outer.overlap:
        an inner phase runs meanwhile)."""
        self.channel.send(ready)

    def arrived(self, outer_step: int) -> bool:
        """Whether the answer for `outer_step` is here, without waiting for it."""
        while self._arrived is None and self.channel.has_message():
            self._arrived = self._answer(outer_step, self.channel.receive())
        return self._arrived is not None and self._arrived.outer_step == outer_step

    def collect(self, outer_step: int) -> Averaged:
        reply = (
            self._arrived if self._arrived is not None and self._arrived.outer_step == outer_step else None
        )
        self._arrived = None
        while reply is None:
            reply = self._answer(outer_step, self.channel.receive())
        return reply

    @staticmethod
    def _answer(outer_step: int, reply: object) -> Averaged | None:
        """`reply` if it answers `outer_step` (nothing else comes to rank 0 while it waits)."""
        return reply if isinstance(reply, Averaged) and reply.outer_step == outer_step else None

    def step_done(self, done: StepDone) -> None:
        self.channel.send(done)

    def checkpoint_written(self, written: CheckpointWritten) -> None:
        self.channel.send(written)

    def finished(self, outer_step: int) -> None:
        self.channel.send(Finished(outer_step))
