"""One local rank's training loop: H inner AdamW steps under FSDP2, then the DiLoCo outer step.

Every rank of a node runs a Trainer; rank 0 also holds the outer parameters and momentum (host
memory, canonical layout) and talks to the node agent through an `AgentLink` (both in its `Leader`,
leader.py):

    inner phase   H steps (or `time_box` seconds) of AdamW on the node's own data shard
    outer step    gather θ (all ranks) → rank 0: Δ = θ_outer − θ → agent averages Δ with the swarm
                  → rank 0: Nesterov step on θ_outer → broadcast → every rank loads its shards

With `outer.overlap` the outer step is overlap.py's instead, which runs the sync of step N during
phase N + 1 and hands back what the trainer does about each step taken (`_follow`).

AdamW's state is kept across outer steps (as in DiLoCo). All nodes start from the same θ: the
model is initialised on the CPU from `train.seed` before it is sharded or moved.

Checkpoints (format: ckpt/format.py; files: checkpoint.py; the writer thread: writer.py) are taken
at an outer-step boundary: every rank gathers AdamW's moments into canonical vectors, and rank 0's
writer saves them with S in a thread, so training waits for the snapshot only.
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
from p2ptrain.ckpt.format import STAGED_KEEP, CheckpointMeta, checkpoint_places
from p2ptrain.config import Config, parameter_count
from p2ptrain.faults import Faults
from p2ptrain.identity import short_id
from p2ptrain.train.accumulate import accumulate_gradients
from p2ptrain.train.agent_link import AgentLink, SoloLink, shared_instruction
from p2ptrain.train.checkpoint import load_state
from p2ptrain.train.data import DataPosition, node_batches
from p2ptrain.train.layout import CanonicalLayout, LocalWeights, rank0_decides
from p2ptrain.train.leader import Leader
from p2ptrain.train.memory import loss_chunk_tokens, resolve_micro_batch
from p2ptrain.train.metrics import MetricsWriter, gpu_memory, peak_flops
from p2ptrain.train.model import Transformer
from p2ptrain.train.optim import adam_moments, inner_optimizer
from p2ptrain.train.outer import OuterNesterov
from p2ptrain.train.overlap import Outcome, OverlappedOuter
from p2ptrain.train.writer import CheckpointWriter

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class RankContext:
    """Where this rank runs: its place among the node's local ranks, its device, their CPU group."""

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


class Trainer:
    """One rank's whole training run: the inner phases, the outer steps (blocking, or overlap.py's),
    checkpoints and resuming (see the module docstring)."""

    def __init__(
        self,
        config: Config,
        *,
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
        self.weights = LocalWeights(self.model, group=ctx.cpu_group, rank0=ctx.rank == 0)
        self.layout: CanonicalLayout = self.weights.layout
        self.weights.gather()
        self.faults = Faults.from_env()  # tests and drills: a NaN in Δ
        self.leader: Leader | None = None
        """Rank 0's part of the outer step (S, the shared buffer, the agent link); None elsewhere."""
        if ctx.rank == 0:
            metrics = MetricsWriter(
                work_dir / "metrics.jsonl",
                config=config.metrics,
                tensorboard_dir=work_dir / "tensorboard",
                run_name=short_id(node_key),
            )
            self.leader = Leader(
                outer=OuterNesterov(
                    self.flat,
                    lr=config.outer.lr,
                    momentum=config.outer.momentum,
                    nesterov=config.outer.nesterov,
                ),
                buffer=self.link.buffer(self.layout.numel),
                link=self.link,
                metrics=metrics,
                nan_step=self.faults.nan_step,
            )
        self.optimizer = inner_optimizer(self.model, config.train, ctx.device)
        self.batches = node_batches(
            config.data,
            vocab_size=config.model.vocab_size,
            node_key=node_key,
            batch_size=config.train.batch_size,
            seq_len=config.model.seq_len,
            rank=ctx.rank,
            world_size=ctx.world_size,
        )
        self.inner_step = 0
        self.outer_step = 0
        """The outer steps S has taken (with overlap, the phase under way may be one further)."""
        self.skip_next_inner = False
        self.last_loss = math.nan
        self.places = checkpoint_places(config, short_id(node_key), work_dir)
        keep: int | None = STAGED_KEEP if self.places.staging else config.checkpoint.keep
        if self.link.agent_prunes:
            keep = None  # the agent prunes, after its copies to disk
        self.writer = CheckpointWriter(
            self.layout, model=config.model, keep=keep, on_written=self._checkpoint_written
        )
        self.tokens_per_step = config.train.batch_size * config.model.seq_len
        self.overlapped: OverlappedOuter | None = None
        """The outer step overlapped with the next inner phase (outer.overlap), else None."""
        if config.outer.overlap.enabled:
            self.overlapped = OverlappedOuter(
                settings=config.outer.overlap,
                inner_steps=config.train.inner_steps,
                tokens_per_step=self.tokens_per_step,
                weights=self.weights,
                leader=self.leader,
                writer=self.writer,
            )
        if resume is not None:
            self.resume(resume, own_data=own_data)
        self.flops_per_token = (
            6 * parameter_count(config.model)
            + 12 * config.model.n_layers * config.model.dim * config.model.seq_len
        )

    @property
    def flat(self) -> torch.Tensor:
        """Rank 0's canonical vector of the weights (`LocalWeights.flat`)."""
        return self.weights.flat

    @property
    def is_leader(self) -> bool:
        """Rank 0: the one that talks to the agent and holds the outer state."""
        return self.leader is not None

    @property
    def phase(self) -> int:
        """The outer step the inner phase under way belongs to: with overlap, one past S's while a
        step is pending (S has taken the steps before the pending one)."""
        pending = self.overlapped is not None and self.overlapped.pending is not None
        return self.outer_step + pending

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
        inputs = inputs.to(self.ctx.device)
        targets = targets.to(self.ctx.device)
        loss = accumulate_gradients(
            self.model, inputs, targets, micro_batch=self.micro_batch, autocast=self._autocast
        )
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
                self._report_inner(loss, tokens_per_s)
            overlapped = self.overlapped
            if (
                overlapped is not None
                and overlapped.merge_due(len(losses))
                and not self._follow(overlapped.merge(len(losses)))
            ):
                break  # reloaded a checkpoint: the phase is void (end_of_phase says so)
        self.last_loss = sum(losses) / len(losses) if losses else math.nan
        return len(losses) * self.tokens_per_step, self.last_loss

    def _report_inner(self, loss: float, tokens_per_s: float) -> None:
        """Rank 0: the inner step's metrics line and progress message to the agent."""
        assert self.leader is not None
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
                outer_step=self.phase,
                inner_step=self.inner_step,
                loss=loss,
                tokens=self.inner_step * self.tokens_per_step,
                tokens_per_s=tokens_per_s,
            )
        )

    def _mfu(self, tokens_per_s: float) -> float | None:
        if self.ctx.device.type != "cuda":
            return None
        peak = peak_flops(self.ctx.device)
        return tokens_per_s * self.flops_per_token / (peak * self.ctx.world_size) if peak else None

    # -- outer step --------------------------------------------------------------------------

    def prepare_outer(self, tokens: int) -> Ready | None:
        """Gather θ and, on rank 0, write Δ = θ_outer − θ into the buffer; returns rank 0's Ready."""
        leader = self.leader
        self.weights.gather()
        if leader is None:
            return None
        leader.outer.pseudo_gradient(self.flat, out=leader.buffer)
        return leader.checked_ready(self.outer_step, tokens, leader.buffer)

    def apply_outer(self, ready: Ready | None, averaged: Averaged | None, seconds: float = 0.0) -> str:
        """Nesterov step with the (averaged) buffer on rank 0, then every rank loads θ_outer."""
        params_hash = ""
        leader = self.leader
        if leader is not None:
            self.writer.wait()  # it may still be reading θ_outer and the momentum
            leader.outer.step(leader.buffer)
            self.flat.copy_(leader.outer.params)
            params_hash = leader.outer.params_hash()
            leader.record_outer(
                self.outer_step,
                averaged,
                loss=self.last_loss,
                finite=ready.finite if ready else True,
                params_hash=params_hash,
                seconds=seconds,
            )
        self.weights.load()
        self.outer_step += 1
        return params_hash

    def outer_step_once(self, tokens: int) -> str | None:
        """Average Δ with the swarm, take the Nesterov step, load it into every rank; returns θ's hash.

        None when the agent found the node off track and answered with a checkpoint to reload
        instead: every rank then loads it and the next outer step skips its inner phase."""
        started = time.monotonic()
        ready = self.prepare_outer(tokens)
        averaged = None
        if ready is not None and self.leader is not None:
            averaged = self.link.average(ready, self.leader.buffer)
        reload, replayed = shared_instruction(averaged, self.ctx.cpu_group)
        if reload:
            self._reload(Path(reload))
            return None
        self.skip_next_inner = replayed
        return self.apply_outer(ready, averaged, time.monotonic() - started)

    def outer_step_overlapped(self, tokens: int, loss: float) -> bool:
        """outer.overlap, at the end of an inner phase (`tokens`, mean `loss`): hand its Δ over and
        take the pending step if no merge took it. False when the pipeline starts over from a
        checkpoint (loaded now or at a merge in the phase, which is then void)."""
        assert self.overlapped is not None
        return self._follow(self.overlapped.end_of_phase(phase=self.phase, tokens=tokens, loss=loss))

    def drain_overlapped(self) -> bool:
        """outer.overlap, after the last phase: take the pending step; False when answered with a
        checkpoint instead (training goes on from it)."""
        assert self.overlapped is not None
        return self._follow(self.overlapped.drain())

    def _follow(self, outcome: Outcome) -> bool:
        """Do what an answer to an outer step asks of the trainer: count a step S took, skip the next
        inner steps after a replay, or load the checkpoint the agent answered with (every rank; the
        next phase then goes without inner steps). False when the step did not go on."""
        if outcome.reload:
            self._reload(Path(outcome.reload))
            return False
        if outcome.stepped:
            self.outer_step += 1
            self.skip_next_inner = outcome.replayed
        return outcome.goes_on

    def _reload(self, path: Path) -> None:
        """The agent found the node off track: every rank loads the swarm's checkpoint at `path`
        (keeping its own data position), and the next outer step goes without inner steps."""
        self.resume(path, own_data=False)
        self.skip_next_inner = True

    # -- checkpoints -------------------------------------------------------------------------

    def adam_moments(self, create: bool = False) -> dict[str, dict[str, torch.Tensor]]:
        return adam_moments(self.model, self.optimizer, steps_taken=self.inner_step, create=create)

    def save_checkpoint(self, background: bool = True) -> None:
        """Snapshot the full state into canonical vectors (all ranks) and have rank 0's writer save it.

        Training waits only for the snapshot; the files are written by a thread (see writer.py)."""
        started = time.monotonic()
        leader = self.leader
        names = ["adam_exp_avg", "adam_exp_avg_sq"]
        buffers = self.writer.snapshot_buffers(names) if leader is not None else {}
        for key, tensors in self.adam_moments().items():
            self.layout.gather_tensors(tensors, buffers.get(f"adam_{key}"))
        if leader is None:
            return
        meta: CheckpointMeta = {
            "outer_step": self.outer_step,
            "inner_step": self.inner_step,
            "config_digest": self.config.digest(),
            "data_position": self.batches.position.to_dict(),
        }
        inner = dict(buffers)
        if self.overlapped is not None:
            self.overlapped.add_to_checkpoint(meta, inner)
        self.writer.write(
            self.places.write_dir,
            params=leader.outer.params,
            momentum=leader.outer.momentum_buffer,
            inner=inner,
            meta=meta,
            background=background,
        )
        blocking = time.monotonic() - started
        leader.metrics.write("checkpoint", self.outer_step, blocking_s=round(blocking, 3))
        log.info("checkpoint of outer step %d: training waited %.3f s", self.outer_step, blocking)

    def _checkpoint_written(self, path: Path, outer_step: int, seconds: float) -> None:
        self.link.checkpoint_written(CheckpointWritten(outer_step, str(path), seconds))

    def resume(self, path: Path, own_data: bool = True) -> None:
        """Continue from a checkpoint exactly where it was taken (every rank reads the files).

        A checkpoint fetched from a peer carries the peer's data position: with `own_data` False
        the node keeps reading its own shard from where it is instead (and a step its holder had
        pending is not resumed: that pipeline was the peer's)."""
        flat, state, meta = load_state(path, self.layout)
        if meta.get("config_digest") != self.config.digest():
            log.warning("resuming %s, saved under other training settings", path)
        self.inner_step = int(meta["inner_step"])
        self.outer_step = int(meta["outer_step"])
        self.flat.copy_(flat)
        if self.leader is not None:
            self.leader.outer.load_state_dict({"params": flat, "momentum": state["momentum"]})
        if self.overlapped is not None:
            start = self.overlapped.load_checkpoint(meta, state, own=own_data)
            if start is not None:
                # our own checkpoint, taken with a step handed over: the phase after it starts
                # where it did
                self.flat.copy_(start)
        self.layout.scatter(self.model, self.flat)
        for key, tensors in self.adam_moments(create=True).items():
            self.layout.scatter_tensors(tensors, state[f"adam_{key}"])
        if own_data:
            self._seek_data(path, DataPosition.from_dict(meta["data_position"]))

    def _seek_data(self, path: Path, position: DataPosition) -> None:
        """Continue the node's data streams from a checkpoint's `position`, where they match."""
        if not self.batches.seek(position):
            log.warning(
                "%s: %d interleaved data streams here, %d there (data.interleave, capped at the "
                "number of files): its data position is not restored",
                path,
                len(self.batches.streams),
                len(position.streams),
            )

    def _checkpoint_if_due(self) -> None:
        """After an outer step: checkpoint every `checkpoint.interval` steps, and at the end."""
        interval = self.config.checkpoint.interval
        pending = self.overlapped is not None and self.overlapped.pending is not None
        done = self.inner_step >= self.config.train.max_steps and not pending
        if done or (interval and self.outer_step % interval == 0):
            self.save_checkpoint()

    # -- the run -----------------------------------------------------------------------------

    def _skip_inner_steps(self, count: int) -> None:
        """Count the inner steps the others did in the step this node catches up in, so the step
        counters and the LR schedule (which follows `inner_step`) stay in line with theirs."""
        self.inner_step = min(self.config.train.max_steps, self.inner_step + count)

    def run(self, skip_first_inner: bool = False) -> None:
        """Train to max_steps. `skip_first_inner`: a node that just caught up takes part in its first
        outer step with a zero pseudo-gradient and weight 0, so the others need not wait for it."""
        if self.is_leader:
            self.link.started(
                Hello(
                    numel=self.layout.numel,
                    layout_digest=self.layout.digest(),
                    buffer_path="",
                    world_size=self.ctx.world_size,
                    parameters=parameter_count(self.config.model),
                    start_step=self.outer_step,
                    micro_batch=self.micro_batch,
                    memory_estimate=self.memory.device,
                    memory_available=self.memory_available,
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
                if self.drain_overlapped():
                    self._checkpoint_if_due()
                    break
                continue  # drained into a checkpoint to reload: training goes on from there
            before = self.outer_step
            if self.skip_next_inner:
                self.skip_next_inner = False
                counted = self.overlapped is not None and self.overlapped.take_counted_phase()
                self._skip_inner_steps(0 if counted else self.config.train.inner_steps)
                tokens = 0
                loss = math.nan
            else:
                tokens, loss = self.inner_phase()
            if self.overlapped is not None:  # S took a step at the merge or takes it now
                if self.outer_step_overlapped(tokens, loss) and self.outer_step > before:
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
