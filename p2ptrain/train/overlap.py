"""One-step overlap (`outer.overlap`): the sync of outer step N runs while the inner phase of N + 1
does, and its result is applied at the end of that phase, or in it (τ, on arrival: below) (Kale,
Douillard, Donchev 2025, "Eager updates for overlapped communication and computation in DiLoCo").

What is shared, and bit-identical on every member of every step, is the outer state
S = (θ_outer, momentum, step): it changes only by `OuterNesterov.step` with the swarm's average R_N,
in step order, exactly as without overlap. What is local is where each inner phase starts (the
working weights w) and the estimate that gives it:

    end of phase N   Δ_N = w_N − y_N              (this phase's own progress, from its start)
                     wait for R_{N−1}, if not there yet (never two steps stale)
                     S ← step(S, R_{N−1})         (StepDone N − 1: its hash is S's)
                     Δ_N ← Δ_N − c·(y_N − θ_S)    (`outer.overlap.start_correction` c, below)
                     hand Δ_N to the agent         (Ready N: synced during phase N + 1)
                     w_{N+1} = lookahead(S, R̂_N)  (the step R̂_N would take, S unchanged)

    eager:   R̂_N = Δ_N                           (the node's own fresh pseudo-gradient stands in
                                                  for the pending average; default)
    delayed: R̂_N = R_{N−1}                        (the last average; `outer.overlap.eager = false`)

Kale et al.'s eager estimate mixes the node's fresh Δ_N (its share s) with the others' shares of
R_{N−1}; here, with S taking only true averages, that mix diverged in a scalar model at DiLoCo's
outer lr 0.7 and momentum 0.9 once an inner phase moves far (Δ ≈ 0.8 of the distance to its
optimum) and cost 11 % of held-out loss on the debug model, where the node's own Δ_N converged
like blocking DiLoCo in the same model. One node alone has R = Δ, so its eager overlap is blocking
DiLoCo up to float rounding.

The start correction. Phase N starts off S by y_N − θ_S (its estimate's error, known once S has
taken step N − 1). Δ_N − c·(y_N − θ_S), a blend of Δ measured from y_N and from θ_S, is handed over
and is the next estimate. The offsets sum to zero over the members, so the average S takes is
unchanged to first order; what changes is where each node's phases start. Measured on the debug
model with the result at the phase's end, c = ½ took the cost from 4.2 % of held-out loss to
0.24 % (10 % to 1.0 % with mixed batches, 5.1 % to 2.3 % at twice the batch); c = 1 diverged. Why
is not settled: the linear model it came from (inner steps undo a share of the offset, which comes
back amplified) predicts smaller offsets, and they came out larger (docs/architecture.md).

With `outer.overlap.steps = τ` > 0 the result is taken τ inner steps into phase N + 1 instead (the
sync has those steps to hide in; Streaming DiLoCo's overlap, Douillard et al. 2025): S takes its step
there, and the working weights move by what the estimate missed, less the start correction scaled
to the steps run, w ← w + (1 − c·τ/H)(θ_S − w_{N+1}), keeping the τ steps' progress; the rest of
the phase runs from there, its Δ measured from S's params.
τ = 0 (the end of the phase) is the one-step overlap above; the smaller τ, the closer to blocking.
With `outer.overlap.take_on_arrival` the result is taken after the first inner step at whose end it is
here (τ at the earliest): τ is then as many steps as the sync took, no more. It is taken there the
same way, so S is the same whichever step each node takes it at; the working weights are local.

Where no average is known (the first step, a step given up, a checkpoint reloaded) R̂_N = Δ_N. A
step given up applies nothing to S (the agent has already tried to replay it from the swarm's
result); the agent's answer to a node off track (reload a checkpoint) drops the pipeline.

Rank 0 holds S (2 vectors), the shared buffer, and here Δ of the pending step and w (and, delayed,
the last average): 2 (3) vectors more than without overlap, all in host memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from p2ptrain.channel import Averaged, Ready, StepDone
from p2ptrain.train.layout import rank0_decides
from p2ptrain.train.outer import OuterNesterov

if TYPE_CHECKING:  # trainer.py imports this module
    from p2ptrain.train.trainer import Trainer

OVERLAP_DELTA, OVERLAP_START = "overlap_delta", "overlap_start"
"""Names of the pending step's Δ and of the working start in a checkpoint's inner state file."""


@dataclass(frozen=True)
class Pending:
    """The step whose Δ the agent is syncing now."""

    step: int
    tokens: int
    finite: bool = True
    loss: float = math.nan
    """The mean loss of its inner phase (for its metrics line and StepDone)."""

    def to_dict(self) -> dict:
        loss = self.loss if math.isfinite(self.loss) else None
        return {"step": self.step, "tokens": self.tokens, "finite": self.finite, "loss": loss}

    @classmethod
    def from_dict(cls, data: dict) -> Pending:
        loss = data.get("loss")
        return cls(
            int(data["step"]),
            int(data["tokens"]),
            bool(data.get("finite", True)),
            float(loss) if isinstance(loss, (int, float)) else math.nan,
        )


class OverlapState:
    """Rank 0's local part of the overlapped outer step (S itself stays in OuterNesterov)."""

    def __init__(self, numel: int, eager: bool):
        self.delta = torch.zeros(numel)
        """Δ of the pending step (its copy in the shared buffer becomes the average)."""
        self.start = torch.zeros(numel)
        """w: where the current inner phase started."""
        self.last_average = None if eager else torch.zeros(numel)
        """Delayed (not eager): the last average S took, the estimate of the pending one."""
        self.known = False
        """Whether `last_average` holds one (not after the first step, a step given up, a reload)."""

    def forget_average(self) -> None:
        """No average to build on (first step, a step given up, a reloaded checkpoint): R̂ = Δ."""
        self.known = False

    def absorb(self, outer: OuterNesterov, buffer: torch.Tensor, averaged: Averaged) -> bool:
        """Take the pending step's answer: with an average (the swarm's, or replayed from it) S takes
        its step; True when S moved."""
        if averaged.members <= 0 and not averaged.replayed:
            self.forget_average()  # given up: nothing is applied (the swarm's result, if any, is
            return False  # replayed or reloaded by the agent at the next step)
        outer.step(buffer)
        if self.last_average is not None:
            self.last_average.copy_(buffer)
            self.known = True
        return True

    def add_offset(
        self, outer: OuterNesterov, into: torch.Tensor, share: float, scratch: torch.Tensor
    ) -> None:
        """into += share·(θ_S − start): a share of the way from where the phase started onto S's
        params, computed in `scratch` (the shared buffer: S has taken its average from it)."""
        torch.sub(outer.params, self.start, out=scratch)
        into.add_(scratch, alpha=share)

    def next_start(self, outer: OuterNesterov, delta: torch.Tensor) -> torch.Tensor:
        """w of the next phase into `start`: the step the estimate R̂ would take from S."""
        estimate = self.last_average if self.last_average is not None and self.known else delta
        return outer.lookahead(estimate, out=self.start)


class OverlappedOuter:
    """The trainer's outer step with overlap, on every local rank (the vectors on rank 0 only)."""

    def __init__(self, trainer: Trainer):
        self.trainer = trainer
        self.pending: Pending | None = None
        """The step being synced now (every rank knows it: they all count the same steps)."""
        self.phase_counted = False
        self.merge_after = trainer.config.outer.overlap.steps
        """τ: inner steps into a phase after which the pending step is taken (0: at its end)."""
        self.on_arrival = trainer.config.outer.overlap.take_on_arrival
        """Take it after the first step, from τ on, at whose end it has arrived."""
        self._reloaded = False
        """A merge mid-phase reloaded a checkpoint: the phase under way is void."""
        leader = trainer.leader
        self.state = (
            OverlapState(trainer.layout.numel, trainer.config.outer.overlap.eager) if leader else None
        )
        if self.state is not None:
            self.state.start.copy_(trainer.outer.params)

    @property
    def phase(self) -> int:
        """The outer step of the inner phase under way (S has taken the steps before the pending one)."""
        return self.trainer.outer_step + (self.pending is not None)

    def merge_due(self, steps_done: int) -> bool:
        """Whether the pending step is to be taken now, `steps_done` inner steps into the phase
        (the same answer on every local rank: rank 0's, whose link the answer comes by)."""
        trainer = self.trainer
        if self.pending is None:
            return False
        if not self.on_arrival:
            return 0 < self.merge_after == steps_done
        if not max(1, self.merge_after) <= steps_done < trainer.config.train.inner_steps:
            return False  # the phase's last step: end_of_phase takes it
        here = trainer.leader is not None and trainer.link.arrived(self.pending.step)
        return rank0_decides(here, trainer.ctx.cpu_group)

    def merge(self, steps_done: int) -> bool:
        """Take the pending step τ steps into the phase: S takes its step, and the working weights
        move by the difference between S's params and the estimate the phase started from, less
        the share of it the τ steps are taken to have undone (c·τ/H; a step given up moves S by
        nothing, the weights towards it). False when the agent answered with a checkpoint to
        reload instead: the phase under way is void."""
        trainer, leader, state = self.trainer, self.trainer.leader, self.state
        if not self._take(self._collect(), steps_done):
            self._reloaded = True
            return False
        trainer.layout.gather(trainer.model, trainer.flat if leader is not None else None)
        if leader is not None and state is not None:  # w + (1 − c·τ/H)·(θ_S − y)
            undone = (
                trainer.config.outer.overlap.start_correction * steps_done / trainer.config.train.inner_steps
            )
            state.add_offset(leader.outer, trainer.flat, 1 - undone, scratch=leader.buffer)
            state.start.copy_(leader.outer.params)
        trainer.load_flat()
        return True

    def end_of_phase(self, tokens: int, loss: float) -> bool:
        """Hand this phase's Δ over and start the next phase from the estimate; first apply the
        pending step's result to S (StepDone), unless a merge took it already. False when the agent
        answered with a checkpoint to reload instead, now or at the merge (the pipeline starts
        over, the next phase without inner steps)."""
        if self._reloaded:
            self._reloaded = False
            return False
        trainer, leader, state = self.trainer, self.trainer.leader, self.state
        phase = self.phase
        trainer.layout.gather(trainer.model, trainer.flat if leader is not None else None)
        ready, averaged = None, None
        if leader is not None and state is not None:
            torch.sub(state.start, trainer.flat, out=trainer.flat)  # Δ = w − y: this phase's progress
            ready = trainer.checked_ready(phase, tokens, trainer.flat)
            averaged = self._collect()
        if not self._take(averaged, tokens // trainer.tokens_per_step):
            return False
        if leader is not None and state is not None and ready is not None:
            trainer.writer.wait()  # a checkpoint's thread may still read the pending Δ and w
            correction = trainer.config.outer.overlap.start_correction
            if correction and ready.finite:  # Δ − c·(y − θ_S)
                state.add_offset(leader.outer, trainer.flat, correction, scratch=leader.buffer)
            state.delta.copy_(trainer.flat)
            leader.buffer.copy_(trainer.flat)
            trainer.link.submit(ready)
            trainer.flat.copy_(state.next_start(leader.outer, state.delta))
        self.pending = Pending(phase, tokens, ready.finite if ready is not None else True, loss)
        trainer.load_flat()
        return True

    def drain(self) -> bool:
        """The last phase is over: wait for the pending step and take it, then every rank holds S's
        params. False when a checkpoint was reloaded instead (training goes on from it)."""
        trainer, leader = self.trainer, self.trainer.leader
        if not self._take(self._collect()):
            return False
        if leader is not None:
            trainer.flat.copy_(leader.outer.params)
        trainer.load_flat()
        return True

    def _collect(self) -> Averaged | None:
        """Wait for the pending step's answer: on rank 0, where the agent link is (None elsewhere,
        and with nothing pending)."""
        if self.trainer.leader is None or self.pending is None:
            return None
        return self.trainer.link.collect(self.pending.step)

    def _take(self, averaged: Averaged | None, steps_in: int | None = None) -> bool:
        """Apply the pending step's answer (on rank 0 `averaged`): S's step and StepDone, or a reload;
        `steps_in`: inner steps of the next phase the step is taken after (its metrics line says)."""
        trainer, leader, state = self.trainer, self.trainer.leader, self.state
        reload, replayed = trainer.shared_instruction(averaged)
        if reload:
            trainer.resume(Path(reload), own_data=False)
            trainer.skip_next_inner = True
            return False
        if self.pending is None:
            return True
        # replayed: the node was a step behind the swarm; the phase after the one just ended goes
        # without inner steps, so its next step is handed over in time to be a member of it
        trainer.skip_next_inner = replayed
        if leader is not None and state is not None and averaged is not None:
            trainer.writer.wait()  # it may still be reading S or the pipeline's vectors
            state.absorb(leader.outer, leader.buffer, averaged)
            params_hash = leader.outer.params_hash()
            pending = self.pending
            taken = {} if steps_in is None else {"taken_after_steps": steps_in}
            trainer.record_outer(averaged, pending.finite, params_hash, loss=pending.loss, **taken)
            trainer.link.step_done(StepDone(pending.step, params_hash, pending.loss))
        trainer.outer_step += 1
        self.pending = None
        return True

    def take_counted_phase(self) -> bool:
        """Whether the phase about to be skipped has its inner steps counted already: a peer's
        checkpoint taken with its step pending counts the steps of that step's phase, which the
        node loading it then takes without inner steps (weight 0). Once."""
        counted, self.phase_counted = self.phase_counted, False
        return counted

    def reset(self, pending_in_checkpoint: bool = False) -> None:
        """A checkpoint of S alone was loaded (`pending_in_checkpoint`: its holder's step N was in
        flight, so the phase of N is over and counted): nothing pending, nothing known but S."""
        self.phase_counted = pending_in_checkpoint
        self.pending = None
        if self.state is not None and self.trainer.leader is not None:
            self.state.forget_average()
            self.state.start.copy_(self.trainer.leader.outer.params)

    def restore(self, pending: Pending, delta: torch.Tensor, start: torch.Tensor) -> None:
        """Resume this node's own checkpoint taken with a step pending: its Δ is handed over again
        (the agent syncs it, or replays the swarm's result), and the phase after it starts again from
        the same w."""
        self.pending, self.phase_counted = pending, False
        if self.state is not None:
            self.state.delta.copy_(delta)
            self.state.start.copy_(start)

    def resubmit(self) -> None:
        """After `restore`: hand the pending Δ to the agent (rank 0)."""
        leader, state, pending = self.trainer.leader, self.state, self.pending
        if leader is None or state is None or pending is None:
            return
        leader.buffer.copy_(state.delta)
        self.trainer.link.submit(Ready(pending.step, pending.tokens if pending.finite else 0, pending.finite))
