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
back amplified) predicts smaller offsets, and they came out larger (docs/01-architecture.md).

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

A checkpoint of S taken with step N pending also holds N (meta.json's `pending`) and its Δ and w
(the inner state file), and counts phase N's inner steps. A node resuming its own checkpoint
restores the pipeline from them and hands Δ over again; a node loading a peer's takes S alone, and
its first phase, which goes without inner steps, does not count them again.

In code: `OverlappedOuter` runs on every local rank and owns the pipeline; it is given what it works
on (the node's weights and their collectives, rank 0's S, shared buffer and agent link, the
checkpoint writer) and hands back to the trainer, as an `Outcome`, what the trainer does about a
step taken: count it, skip the next inner steps, or load the checkpoint the agent answered with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from p2ptrain.channel import Averaged, Ready, StepDone
from p2ptrain.ckpt.format import CheckpointMeta
from p2ptrain.config import OverlapConfig
from p2ptrain.train.agent_link import shared_instruction
from p2ptrain.train.layout import LocalWeights, rank0_decides
from p2ptrain.train.leader import Leader
from p2ptrain.train.writer import CheckpointWriter

OVERLAP_DELTA = "overlap_delta"
"""The pending step's Δ in a checkpoint's inner state file."""
OVERLAP_START = "overlap_start"
"""The working start w of the phase after it, in the same file."""


@dataclass(frozen=True, kw_only=True)
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
    def from_dict(cls, data: Mapping[str, Any]) -> Pending:
        loss = data.get("loss")
        return cls(
            step=int(data["step"]),
            tokens=int(data["tokens"]),
            finite=bool(data.get("finite", True)),
            loss=float(loss) if isinstance(loss, (int, float)) else math.nan,
        )


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What came of an answer to the pending step, for the trainer to act on: the overlap neither
    counts the trainer's steps nor loads checkpoints itself."""

    stepped: bool = False
    """S took the pending step: the node's count of outer steps moves on by one."""
    replayed: bool = False
    """With `stepped`: the node was a step behind the swarm, which replayed the step from its
    result; the next phase goes without inner steps, so its Δ is handed over in time to be a member
    of the next step."""
    reload: str = ""
    """The agent answered with a checkpoint to reload instead (every rank loads it; the next phase
    goes without inner steps). Nothing else was done: the pipeline starts over from it."""
    void: bool = False
    """The phase just ended is void: a merge in it was answered with a checkpoint, loaded by then."""

    @property
    def goes_on(self) -> bool:
        """The pipeline goes on (neither a reload now nor a phase voided by an earlier one)."""
        return not self.reload and not self.void


class OverlapState:
    """Rank 0's part of the overlap: the pipeline's vectors beside S, which stays in `leader`."""

    def __init__(self, leader: Leader, *, eager: bool):
        self.leader = leader
        numel = leader.outer.params.numel()
        self.delta = torch.zeros(numel)
        """Δ of the pending step (its copy in the shared buffer becomes the average)."""
        self.start = leader.outer.params.clone()
        """w: where the current inner phase started."""
        self.last_average = None if eager else torch.zeros(numel)
        """Delayed (not eager): the last average S took, the estimate of the pending one."""
        self.known = False
        """Whether `last_average` holds one (not after the first step, a step given up, a reload)."""

    def forget_average(self) -> None:
        """No average to build on (first step, a step given up, a reloaded checkpoint): R̂ = Δ."""
        self.known = False

    def start_at_s(self) -> None:
        """Nothing known but S (a checkpoint of S alone was loaded): the next phase starts at S."""
        self.forget_average()
        self.start.copy_(self.leader.outer.params)

    def absorb(self, averaged: Averaged) -> bool:
        """Take the pending step's answer, in the shared buffer: with an average (the swarm's, or
        replayed from it) S takes its step; True when S moved."""
        if averaged.members <= 0 and not averaged.replayed:
            # given up: nothing is applied (the swarm's result, if any, is replayed or reloaded by
            # the agent at the next step)
            self.forget_average()
            return False
        self.leader.outer.step(self.leader.buffer)
        if self.last_average is not None:
            self.last_average.copy_(self.leader.buffer)
            self.known = True
        return True

    def add_offset(self, into: torch.Tensor, *, share: float) -> None:
        """into += share·(θ_S − start): a share of the way from where the phase started onto S's
        params."""
        # The shared buffer serves as scratch: only once S has taken its average from it and before
        # the next Δ is copied in (the agent does not touch it between `collect` and `submit`).
        scratch = self.leader.buffer
        torch.sub(self.leader.outer.params, self.start, out=scratch)
        into.add_(scratch, alpha=share)

    def hand_over(self, delta: torch.Tensor, ready: Ready) -> None:
        """Keep `delta` as the pending Δ and hand it to the agent (the buffer is the agent's until
        the answer is collected)."""
        self.delta.copy_(delta)
        self.leader.buffer.copy_(delta)
        self.leader.link.submit(ready)

    def next_start(self) -> torch.Tensor:
        """w of the next phase into `start`: the step the estimate R̂ would take from S."""
        estimate = self.last_average if self.last_average is not None and self.known else self.delta
        return self.leader.outer.lookahead(estimate, out=self.start)


class OverlappedOuter:
    """The outer step with overlap, on every local rank; the vectors on rank 0 only (`state`).

    Given what it works on, not the trainer: `weights`, the node's weights and the collectives over
    its local ranks; `leader`, rank 0's S, shared buffer, agent link and metrics (None on the other
    ranks); `writer`, the checkpoint writer, whose thread may read S and the pipeline's vectors
    until it is waited for. Every local rank calls the same methods in the same order (they all
    count the same steps); what the trainer must do after each comes back as an `Outcome`."""

    def __init__(
        self,
        *,
        settings: OverlapConfig,
        inner_steps: int,
        tokens_per_step: int,
        weights: LocalWeights,
        leader: Leader | None,
        writer: CheckpointWriter,
    ):
        self.settings = settings
        """outer.overlap: τ (`steps`), on arrival, the start correction c, eager or delayed."""
        self.inner_steps = inner_steps
        """H, for the share c·τ/H of a merge."""
        self.tokens_per_step = tokens_per_step
        self.weights = weights
        self.writer = writer
        self.state = OverlapState(leader, eager=settings.eager) if leader is not None else None
        self.pending: Pending | None = None
        """The step being synced now (every rank knows it: they all count the same steps)."""
        self.phase_counted = False
        """The phase about to be skipped has its inner steps counted already (`take_counted_phase`)."""
        self._reloaded = False
        """A merge mid-phase was answered with a checkpoint: the phase under way is void."""

    def merge_due(self, steps_done: int) -> bool:
        """Whether the pending step is to be taken now, `steps_done` inner steps into the phase
        (the same answer on every local rank: rank 0's, whose link the answer comes by)."""
        if self.pending is None:
            return False
        merge_after = self.settings.steps
        if not self.settings.take_on_arrival:
            return 0 < merge_after == steps_done
        if not max(1, merge_after) <= steps_done < self.inner_steps:
            return False  # the phase's last step: end_of_phase takes it
        here = self.state is not None and self.state.leader.link.arrived(self.pending.step)
        return rank0_decides(here, self.weights.group)

    def merge(self, steps_done: int) -> Outcome:
        """Take the pending step τ steps into the phase: S takes its step, and the working weights
        move by the difference between S's params and the estimate the phase started from, less
        the share of it the τ steps are taken to have undone (c·τ/H; a step given up moves S by
        nothing, the weights towards it). Answered with a checkpoint instead, the phase under way
        is void (`end_of_phase` says so)."""
        outcome = self._take(self._collect(), steps_in=steps_done)
        if outcome.reload:
            self._reloaded = True
            return outcome
        weights, state = self.weights, self.state
        weights.gather()
        if state is not None:  # w + (1 − c·τ/H)·(θ_S − y)
            undone = self.settings.start_correction * steps_done / self.inner_steps
            state.add_offset(weights.flat, share=1 - undone)
            state.start.copy_(state.leader.outer.params)
        weights.load()
        return outcome

    def end_of_phase(self, *, phase: int, tokens: int, loss: float) -> Outcome:
        """Hand the Δ of inner phase `phase` (just ended: `tokens`, mean `loss`) over and start the
        next phase from the estimate; first apply the pending step's result to S (StepDone), unless
        a merge took it already. Answered with a checkpoint instead, now or at the merge, the
        pipeline starts over (the next phase without inner steps)."""
        if self._reloaded:
            self._reloaded = False
            return Outcome(void=True)
        weights, state = self.weights, self.state
        weights.gather()
        ready: Ready | None = None
        averaged: Averaged | None = None
        if state is not None:
            torch.sub(state.start, weights.flat, out=weights.flat)  # Δ = w − y: this phase's progress
            ready = state.leader.checked_ready(phase, tokens, weights.flat)
            averaged = self._collect()
        outcome = self._take(averaged, steps_in=tokens // self.tokens_per_step)
        if outcome.reload:
            return outcome
        if state is not None and ready is not None:
            self.writer.wait()  # a checkpoint's thread may still read the pending Δ and w
            correction = self.settings.start_correction
            if correction and ready.finite:  # Δ − c·(y − θ_S)
                state.add_offset(weights.flat, share=correction)
            state.hand_over(weights.flat, ready)
            weights.flat.copy_(state.next_start())
        finite = ready.finite if ready is not None else True
        self.pending = Pending(step=phase, tokens=tokens, finite=finite, loss=loss)
        weights.load()
        return outcome

    def drain(self) -> Outcome:
        """The last phase is over: wait for the pending step and take it, then every rank holds S's
        params (unless answered with a checkpoint: training goes on from it)."""
        outcome = self._take(self._collect())
        if outcome.reload:
            return outcome
        if self.state is not None:
            self.weights.flat.copy_(self.state.leader.outer.params)
        self.weights.load()
        return outcome

    def _collect(self) -> Averaged | None:
        """Wait for the pending step's answer: on rank 0, where the agent link is (None elsewhere,
        and with nothing pending)."""
        if self.state is None or self.pending is None:
            return None
        return self.state.leader.link.collect(self.pending.step)

    def _take(self, averaged: Averaged | None, *, steps_in: int | None = None) -> Outcome:
        """Apply the pending step's answer (on rank 0 `averaged`): S's step and StepDone, unless it
        is a checkpoint to reload; `steps_in`: inner steps of the next phase the step is taken
        after (its metrics line says)."""
        reload, replayed = shared_instruction(averaged, self.weights.group)
        if reload:
            return Outcome(reload=reload)
        pending = self.pending
        if pending is None:
            return Outcome()
        state = self.state
        if state is not None and averaged is not None:
            self.writer.wait()  # it may still be reading S or the pipeline's vectors
            state.absorb(averaged)
            leader = state.leader
            params_hash = leader.outer.params_hash()
            taken = {} if steps_in is None else {"taken_after_steps": steps_in}
            leader.record_outer(
                pending.step,
                averaged,
                loss=pending.loss,
                finite=pending.finite,
                params_hash=params_hash,
                **taken,
            )
            leader.link.step_done(StepDone(pending.step, params_hash, pending.loss))
        self.pending = None
        return Outcome(stepped=True, replayed=replayed)

    def take_counted_phase(self) -> bool:
        """Whether the phase about to be skipped has its inner steps counted already: a peer's
        checkpoint taken with its step pending counts the steps of that step's phase, which the
        node loading it then takes without inner steps (weight 0). Once."""
        counted = self.phase_counted
        self.phase_counted = False
        return counted

    def add_to_checkpoint(self, meta: CheckpointMeta, vectors: dict[str, torch.Tensor]) -> None:
        """Rank 0, saving a checkpoint of S: with a step pending, that step goes into `meta` and its
        Δ and the next phase's start w into `vectors` (the inner state file). They are the live
        vectors, not copies: the writer's thread reads them until it is waited for."""
        if self.pending is None or self.state is None:
            return
        meta["pending"] = self.pending.to_dict()  # this node's: a step it handed over
        vectors[OVERLAP_DELTA] = self.state.delta
        vectors[OVERLAP_START] = self.state.start

    def load_checkpoint(
        self, meta: Mapping[str, Any], vectors: Mapping[str, torch.Tensor], *, own: bool
    ) -> torch.Tensor | None:
        """A checkpoint of S was loaded (S itself already in the leader's OuterNesterov): nothing is
        pending, nothing known but S, the next phase starts at S; a pending step in it means its
        holder's phase of that step is over and counted. With `own` (the node's own checkpoint,
        `add_to_checkpoint`'s) its pending step is restored: its Δ is handed over again
        (`resubmit`: the agent syncs it, or replays the swarm's result) and the phase after it
        starts again from the same w, which is returned (None: the weights start at S)."""
        self.phase_counted = "pending" in meta
        self.pending = None
        if self.state is not None:
            self.state.start_at_s()
        if not own or "pending" not in meta or OVERLAP_START not in vectors:
            return None
        self.pending = Pending.from_dict(meta["pending"])
        self.phase_counted = False
        if self.state is not None:
            self.state.delta.copy_(vectors[OVERLAP_DELTA])
            self.state.start.copy_(vectors[OVERLAP_START])
        return vectors[OVERLAP_START]

    def resubmit(self) -> None:
        """After an own checkpoint was loaded with its step pending: hand the pending Δ to the agent
        again (rank 0)."""
        state = self.state
        pending = self.pending
        if state is None or pending is None:
            return
        state.leader.buffer.copy_(state.delta)
        tokens = pending.tokens if pending.finite else 0
        state.leader.link.submit(Ready(pending.step, tokens, pending.finite))
