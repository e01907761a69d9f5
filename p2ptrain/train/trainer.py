"""One local rank's training loop: H inner AdamW steps under FSDP2, then the DiLoCo outer step.

Every rank of a node runs a Trainer; rank 0 also holds the outer parameters and momentum (host
memory, canonical layout) and talks to the node agent through an `AgentLink` (agent_link.py):

    inner phase   H steps (or `time_box` seconds) of AdamW on the node's own data shard
    outer step    gather θ (all ranks) → rank 0: Δ = θ_outer − θ → agent averages Δ with the swarm
                  → rank 0: Nesterov step on θ_outer → broadcast → every rank loads its shards

AdamW's state is kept across outer steps (as in DiLoCo). All nodes start from the same θ: the
model is initialised on the CPU from `train.seed` before it is sharded or moved.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from p2ptrain.channel import Averaged, CheckpointWritten, Hello, Progress, Ready, StepDone
from p2ptrain.ckpt.format import STAGED_KEEP, checkpoint_places
from p2ptrain.config import Config, parameter_count
from p2ptrain.faults import Faults
from p2ptrain.identity import short_id
from p2ptrain.train.accumulate import accumulate_gradients
from p2ptrain.train.agent_link import AgentLink, SoloLink
from p2ptrain.train.data import node_batches
from p2ptrain.train.layout import CanonicalLayout, broadcast_flat, rank0_decides
from p2ptrain.train.memory import loss_chunk_tokens, resolve_micro_batch
from p2ptrain.train.metrics import MetricsWriter, gpu_memory, peak_flops
from p2ptrain.train.model import Transformer
from p2ptrain.train.optim import InnerAdamW, adam_moments
from p2ptrain.train.outer import OuterNesterov, all_finite
from p2ptrain.train.overlap import OverlappedOuter
from p2ptrain.train.trainer_state import resume_trainer, save_trainer_checkpoint
from p2ptrain.train.writer import CheckpointWriter

log = logging.getLogger(__name__)


@dataclass
class RankContext:
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    cpu_group: dist.ProcessGroup | None = None
    """A gloo group over the local ranks for host-memory broadcasts (None with one rank)."""


def build_model(config: Config, ctx: RankContext) -> Transformer:
    """The same initial weights on every node and rank, then sharded over the local ranks."""
    torch.manual_seed(config.train.seed)
    model = Transformer(
        config.model,
        activation_checkpointing=config.train.activation_checkpointing,
        loss_chunk=loss_chunk_tokens(config),
    )
    model.to(ctx.device)
    if ctx.world_size > 1:  # imported here: FSDP's import costs a one-rank node ~1 s of CPU at start
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh(ctx.device.type, (ctx.world_size,))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    if config.train.compile:
        for layer in model.layers:
            layer.compile()
    return model


@dataclass
class LeaderState:
    """What rank 0 alone holds: θ_outer and the outer momentum (host memory), the vector it shares
    with the agent, and the metrics file."""

    outer: OuterNesterov
    buffer: torch.Tensor
    metrics: MetricsWriter


class Trainer:
    def __init__(
        self,
        config: Config,
        node_key: bytes,
        work_dir: Path,
        ctx: RankContext,
        link: AgentLink | None = None,
        resume: Path | None = None,
        own_data: bool = True,
    ):
        self.config = config
        self.ctx = ctx
        self.work_dir = work_dir
        self.link = link or SoloLink()
        self.micro_batch, self.memory, self.memory_available = resolve_micro_batch(
            config, ctx.world_size, ctx.device.type
        )
        self.model = build_model(config, ctx)
        self.layout = CanonicalLayout.of(self.model)
        self.flat = self.layout.new_flat()
        self.layout.gather(self.model, self.flat if ctx.rank == 0 else None)
        self.leader: LeaderState | None = None
        if ctx.rank == 0:
            self.leader = LeaderState(
                OuterNesterov(self.flat, config.outer.lr, config.outer.momentum, config.outer.nesterov),
                self.link.buffer(self.layout.numel),
                MetricsWriter(
                    work_dir / "metrics.jsonl", config.metrics, work_dir / "tensorboard", short_id(node_key)
                ),
            )
        self.optimizer = InnerAdamW(self.model, config.train)
        self.batches = node_batches(
            config.data,
            config.model.vocab_size,
            node_key,
            config.train.batch_size,
            config.model.seq_len,
            ctx.rank,
            ctx.world_size,
        )
        self.inner_step = 0
        self.outer_step = 0
        self.skip_next_inner = False
        self.faults = Faults.from_env()  # tests and drills: a NaN in Δ
        self.last_loss = math.nan
        self.places = checkpoint_places(config, short_id(node_key), work_dir)
        keep: int | None = STAGED_KEEP if self.places.staging else config.checkpoint.keep
        if self.link.agent_prunes:
            keep = None  # the agent prunes, after its copies to disk
        self.writer = CheckpointWriter(self.layout, config.model, keep, self._checkpoint_written)
        self.tokens_per_step = config.train.batch_size * config.model.seq_len
        self.overlapped = OverlappedOuter(self) if config.outer.overlap.enabled else None
        """The outer step overlapped with the next inner phase (outer.overlap), else None."""
        if resume is not None:
            self.resume(resume, own_data)
        self.flops_per_token = (
            6 * parameter_count(config.model)
            + 12 * config.model.n_layers * config.model.dim * config.model.seq_len
        )

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that talks to the agent and holds the outer state."""
        return self.leader is not None

    @property
    def phase(self) -> int:
        """The outer step the inner phase under way belongs to (with overlap, S is one behind)."""
        return self.overlapped.phase if self.overlapped is not None else self.outer_step

    @property
    def outer(self) -> OuterNesterov:
        """θ_outer and the outer momentum, which rank 0 alone holds."""
        if self.leader is None:
            raise RuntimeError(f"rank {self.ctx.rank} holds no outer state (rank 0 does)")
        return self.leader.outer

    # -- inner phase -------------------------------------------------------------------------

    def _autocast(self) -> torch.autocast:
        enabled = self.ctx.device.type == "cuda" and self.config.train.precision == "bf16"
        return torch.autocast(self.ctx.device.type, dtype=torch.bfloat16, enabled=enabled)

    def inner_step_once(self) -> float:
        inputs, targets = self.batches.next()
        inputs, targets = inputs.to(self.ctx.device), targets.to(self.ctx.device)
        loss = accumulate_gradients(self.model, inputs, targets, self.micro_batch, self._autocast)
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.config.train.grad_clip)
        self.optimizer.step(self.inner_step)
        self.optimizer.zero_grad()
        value = loss.reshape(1)
        if self.ctx.cpu_group is not None:
            dist.all_reduce(value, group=self.ctx.cpu_group)
            value /= self.ctx.world_size
        self.inner_step += 1
        return float(value)

    def _time_is_up(self, started: float) -> bool:
        """Rank 0's clock decides for all local ranks, so they leave the phase at the same step."""
        box = self.config.train.time_box
        if box <= 0:
            return False
        return rank0_decides(time.monotonic() - started >= box, self.ctx.cpu_group)

    def inner_phase(self) -> tuple[int, float]:
        """Up to H inner steps; returns (tokens processed, mean loss)."""
        started = time.monotonic()
        losses: list[float] = []
        while len(losses) < self.config.train.inner_steps and self.inner_step < self.config.train.max_steps:
            if losses and self._time_is_up(started):
                break
            step_started = time.monotonic()
            loss = self.inner_step_once()
            losses.append(loss)
            elapsed = time.monotonic() - step_started
            tokens_per_s = self.tokens_per_step / max(elapsed, 1e-9)
            if self.leader is not None:
                mfu = self._mfu(tokens_per_s)
                self.leader.metrics.write(
                    "inner",
                    self.inner_step,
                    outer_step=self.phase,
                    loss=round(loss, 5),
                    lr=self.optimizer.lr_at(self.inner_step),
                    tokens_per_s=round(tokens_per_s, 1),
                    **({"mfu": round(mfu, 4)} if mfu is not None else {}),
                    **gpu_memory(self.ctx.device),
                )
                self.link.progress(
                    Progress(
                        self.phase,
                        self.inner_step,
                        loss,
                        self.inner_step * self.tokens_per_step,
                        tokens_per_s,
                    )
                )
            overlapped = self.overlapped
            if (
                overlapped is not None
                and overlapped.merge_due(len(losses))
                and not overlapped.merge(len(losses))
            ):
                break  # reloaded a checkpoint: the phase is void (end_of_phase says so)
        self.last_loss = sum(losses) / len(losses) if losses else math.nan
        return len(losses) * self.tokens_per_step, self.last_loss

    def _mfu(self, tokens_per_s: float) -> float | None:
        if self.ctx.device.type != "cuda":
            return None
        peak = peak_flops(self.ctx.device)
        return tokens_per_s * self.flops_per_token / (peak * self.ctx.world_size) if peak else None

    # -- outer step --------------------------------------------------------------------------

    def prepare_outer(self, tokens: int) -> Ready | None:
        """Gather θ and, on rank 0, write Δ = θ_outer − θ into the buffer; returns rank 0's Ready."""
        leader = self.leader
        self.layout.gather(self.model, self.flat if leader is not None else None)
        if leader is None:
            return None
        leader.outer.pseudo_gradient(self.flat, out=leader.buffer)
        return self.checked_ready(self.outer_step, tokens, leader.buffer)

    def checked_ready(self, step: int, tokens: int, delta: torch.Tensor) -> Ready:
        """Rank 0's Ready for `delta`: never send NaN/Inf; contribute nothing (weight 0) instead."""
        if step == self.faults.nan_step:
            delta[0] = math.nan  # fault injection: P2PTRAIN_INJECT_NAN_STEP
        finite = all_finite(delta)
        if not finite:
            log.error("outer step %d: pseudo-gradient holds NaN/Inf; contributing zero", step)
            delta.zero_()
        return Ready(step, tokens if finite else 0, finite)

    def apply_outer(self, ready: Ready | None, averaged: Averaged | None, seconds: float = 0.0) -> str:
        """Nesterov step with the (averaged) buffer on rank 0, then every rank loads θ_outer."""
        params_hash = ""
        leader = self.leader
        if leader is not None:
            self.writer.wait()  # it may still be reading θ_outer and the momentum
            leader.outer.step(leader.buffer)
            self.flat.copy_(leader.outer.params)
            params_hash = leader.outer.params_hash()
            self.record_outer(averaged, ready.finite if ready else True, params_hash, seconds)
        self.load_flat()
        self.outer_step += 1
        return params_hash

    def record_outer(
        self,
        averaged: Averaged | None,
        finite: bool,
        params_hash: str,
        seconds: float = 0.0,
        loss: float | None = None,
        **overlap: int,
    ) -> None:
        """Rank 0's metrics line for the outer step just taken (`loss`: its phase's, if not the last;
        `overlap`: where in the next phase an overlapped step was taken)."""
        assert self.leader is not None
        self.leader.metrics.write(
            "outer",
            self.outer_step,
            loss=round(self.last_loss if loss is None else loss, 5),
            members=averaged.members if averaged else 0,
            ring=averaged.ring if averaged else [],
            sync_s=round(averaged.sync_s, 3) if averaged else 0.0,
            replayed=averaged.replayed if averaged else False,
            bytes_sent=averaged.bytes_sent if averaged else 0,
            relayed_bytes=averaged.relayed_bytes if averaged else 0,
            finite=finite,
            params_hash=params_hash,
            seconds=round(seconds, 3),
            **overlap,
        )

    def load_flat(self) -> None:
        """Every rank loads rank 0's `flat` into its shards."""
        broadcast_flat(self.flat, self.ctx.cpu_group)
        self.layout.scatter(self.model, self.flat)

    def outer_step_once(self, tokens: int) -> str | None:
        """Average Δ with the swarm, take the Nesterov step, load it into every rank; returns θ's hash.

        None when the agent found the node off track and answered with a checkpoint to reload
        instead: every rank then loads it and the next outer step skips its inner phase."""
        started = time.monotonic()
        ready = self.prepare_outer(tokens)
        averaged = None
        if ready is not None and self.leader is not None:
            averaged = self.link.average(ready, self.leader.buffer)
        reload, replayed = self.shared_instruction(averaged)
        if reload:
            self.resume(Path(reload), own_data=False)
            self.skip_next_inner = True
            return None
        self.skip_next_inner = replayed
        return self.apply_outer(ready, averaged, time.monotonic() - started)

    def shared_instruction(self, averaged: Averaged | None) -> tuple[str, bool]:
        """Rank 0's catch-up instruction (a checkpoint to reload; a replayed step), made known to
        every local rank."""
        box = [averaged.reload, averaged.replayed] if averaged else ["", False]
        if self.ctx.cpu_group is not None:
            dist.broadcast_object_list(box, src=0, group=self.ctx.cpu_group)
        return str(box[0]), bool(box[1])

    def adam_moments(self, create: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        return adam_moments(self.model, self.optimizer, self.inner_step, create)

    def save_checkpoint(self, background: bool = True) -> None:
        """Snapshot the full state into canonical vectors (all ranks) and have rank 0's writer save it.

        Training waits only for the snapshot; the files are written by a thread (see writer.py)."""
        save_trainer_checkpoint(self, background)

    def _checkpoint_written(self, path: Path, outer_step: int, seconds: float) -> None:
        self.link.checkpoint_written(CheckpointWritten(outer_step, str(path), seconds))

    def _skip_inner_steps(self, count: int) -> None:
        """Count the inner steps the others did in the step this node catches up in, so the step
        counters and the LR schedule (which follows `inner_step`) stay in line with theirs."""
        self.inner_step = min(self.config.train.max_steps, self.inner_step + count)

    def resume(self, path: Path, own_data: bool = True) -> None:
        """Continue from a checkpoint exactly where it was taken (every rank reads the files).

        A checkpoint fetched from a peer carries the peer's data position: with `own_data` False
        the node keeps reading its own shard from where it is instead."""
        resume_trainer(self, path, own_data)

    def _checkpoint_if_due(self) -> None:
        """After an outer step: checkpoint every `checkpoint.interval` steps, and at the end."""
        interval = self.config.checkpoint.interval
        pending = self.overlapped is not None and self.overlapped.pending is not None
        done = self.inner_step >= self.config.train.max_steps and not pending
        if done or (interval and self.outer_step % interval == 0):
            self.save_checkpoint()

    def run(self, skip_first_inner: bool = False) -> None:
        """Train to max_steps. `skip_first_inner`: a node that just caught up takes part in its first
        outer step with a zero pseudo-gradient and weight 0, so the others need not wait for it."""
        if self.is_leader:
            self.link.started(
                Hello(
                    self.layout.numel,
                    self.layout.digest(),
                    "",
                    self.ctx.world_size,
                    parameter_count(self.config.model),
                    self.outer_step,
                    self.micro_batch,
                    self.memory.device,
                    self.memory_available,
                )
            )
        self.skip_next_inner = skip_first_inner
        if self.overlapped is not None:
            self.overlapped.resubmit()
        while True:
            if self.inner_step >= self.config.train.max_steps:
                overlap = self.overlapped
                if overlap is None or overlap.pending is None:
                    break
                if overlap.drain():
                    self._checkpoint_if_due()
                    break
                continue  # drained into a checkpoint to reload: training goes on from there
            before = self.outer_step
            if self.skip_next_inner:
                self.skip_next_inner = False
                counted = self.overlapped is not None and self.overlapped.take_counted_phase()
                self._skip_inner_steps(0 if counted else self.config.train.inner_steps)
                tokens, loss = 0, math.nan
            else:
                tokens, loss = self.inner_phase()
            if self.overlapped is not None:  # S took a step at the merge or takes it now
                if self.overlapped.end_of_phase(tokens, loss) and self.outer_step > before:
                    self._checkpoint_if_due()
                continue
            params_hash = self.outer_step_once(tokens)
            if params_hash is None:
                continue  # reloaded the swarm's checkpoint: catch up in the next outer step
            if self.is_leader:
                self.link.step_done(StepDone(self.outer_step - 1, params_hash, loss))
            self._checkpoint_if_due()
        if self.leader is not None:
            self.writer.wait()
            self.link.finished(self.outer_step)
            self.leader.metrics.close()
