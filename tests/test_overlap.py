"""outer.overlap.steps: the pending step is taken τ inner steps into the next phase, on a real
trainer (one node, its own link): S takes its step there, and the working weights move by what the
estimate they started from missed. outer.overlap.take_on_arrival: taken after the first step at whose end
the answer is here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from p2ptrain.channel import Averaged
from p2ptrain.config import load_config
from p2ptrain.train.agent_link import SoloLink
from p2ptrain.train.metrics import read_metrics
from p2ptrain.train.overlap import Outcome, OverlappedOuter
from p2ptrain.train.trainer import RankContext, Trainer


class RecordingLink(SoloLink):
    """One node's link that notes when each step's result was asked for, and gives up `given_up`."""

    def __init__(self, given_up: int | None = None):
        self.given_up = given_up
        self.trainer: Trainer | None = None
        self.collected: list[tuple[int, int]] = []
        """(outer step, the trainer's inner step when its result was asked for)."""

    def collect(self, outer_step: int) -> Averaged:
        assert self.trainer is not None
        self.collected.append((outer_step, self.trainer.inner_step))
        return Averaged(outer_step, 0 if outer_step == self.given_up else 1)


@pytest.mark.parametrize("given_up", [None, 1])
def test_the_pending_step_is_taken_tau_steps_into_the_next_phase(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given_up: int | None
) -> None:
    """Delayed estimate (it differs from S's next params), H = 4, τ = 2: step N's result is asked
    for two steps into phase N + 1 (the last one once the run is over); there w moves by S − w_start,
    keeping its two steps' progress less the share c·τ/H of the shift they are taken to have
    undone, and the phase goes on from S. A step given up leaves S as it was and moves w towards it."""
    torch.set_num_threads(1)
    overrides = ["train.max_steps=12", "train.inner_steps=4", 'checkpoint.staging=""']
    overrides += [
        "checkpoint.interval=0",
        "outer.overlap.enabled=true",
        "outer.overlap.steps=2",
        "outer.overlap.eager=false",
    ]
    config = load_config("debug", overrides=overrides)
    link = RecordingLink(given_up)
    trainer = Trainer(config, node_key=b"m" * 32, work_dir=tmp_path / "node", ctx=RankContext(), link=link)
    link.trainer = trainer
    merge = OverlappedOuter.merge
    shifts: list[tuple[torch.Tensor, ...]] = []

    def watched(overlapped: OverlappedOuter, steps_done: int) -> Outcome:
        state = overlapped.state
        assert state is not None
        before = torch.empty_like(trainer.flat)
        start = state.start.clone()
        params = trainer.outer.params.clone()
        trainer.layout.gather(trainer.model, before)
        outcome = merge(overlapped, steps_done)
        assert outcome.goes_on and outcome.stepped
        after = torch.empty_like(trainer.flat)
        trainer.layout.gather(trainer.model, after)
        shifts.append((before, start, params, trainer.outer.params.clone(), after, state.start.clone()))
        return outcome

    monkeypatch.setattr(OverlappedOuter, "merge", watched)
    trainer.run()
    assert link.collected == [(0, 6), (1, 10), (2, 12)]
    assert len(shifts) == 2
    for step, (before, start, params, taken, after, new_start) in enumerate(shifts):
        undone = config.outer.overlap.start_correction * 2 / 4  # c·τ/H
        assert torch.equal(after, before.clone().add_(torch.sub(taken, start), alpha=1 - undone))
        assert torch.equal(new_start, taken)
        assert not torch.equal(start, taken)  # the estimate missed: the shift is real
        assert torch.equal(taken, params) == (step == given_up)  # S moved unless given up
    assert trainer.outer_step == 3


class LateLink(RecordingLink):
    """Step N's answer arrives `late` inner steps into phase N + 1 (H = 4)."""

    def __init__(self, late: int):
        super().__init__()
        self.late = late

    def arrived(self, outer_step: int) -> bool:
        assert self.trainer is not None
        return self.trainer.inner_step - 4 * (outer_step + 1) >= self.late


@pytest.mark.parametrize(("late", "tau", "taken_after"), [(1, 0, 1), (3, 0, 3), (1, 2, 2), (6, 0, 4)])
def test_on_arrival_the_pending_step_is_taken_after_the_first_step_that_ends_with_it_here(
    tmp_path: Path, late: int, tau: int, taken_after: int
) -> None:
    """H = 4: the answer arrives `late` steps into the next phase; it is taken right after that step,
    not before τ, and at the end of the phase (4) when it is later than the phase's last step (the
    step of a run's last phase only once the run is over: 12). The outer metrics line says where."""
    torch.set_num_threads(1)
    overrides = ["train.max_steps=12", "train.inner_steps=4", 'checkpoint.staging=""']
    overrides += ["checkpoint.interval=0", "outer.overlap.enabled=true", "outer.overlap.take_on_arrival=true"]
    config = load_config("debug", overrides=[*overrides, f"outer.overlap.steps={tau}"])
    link = LateLink(late)
    trainer = Trainer(config, node_key=b"m" * 32, work_dir=tmp_path / "node", ctx=RankContext(), link=link)
    link.trainer = trainer
    trainer.run()
    assert link.collected == [(0, 4 + taken_after), (1, 8 + taken_after), (2, 12)]
    lines = [line for line in read_metrics(tmp_path / "node" / "metrics.jsonl") if line["kind"] == "outer"]
    assert [line.get("taken_after_steps") for line in lines] == [taken_after, taken_after, None]
    assert trainer.outer_step == 3


class HalvingLink(RecordingLink):
    """As if a second member had sent zeros: the average is half the node's own Δ, so the phase
    started off S by the half its estimate missed."""

    def collect(self, outer_step: int) -> Averaged:
        assert self.trainer is not None and self.trainer.leader is not None
        self.trainer.leader.buffer.mul_(0.5)
        return super().collect(outer_step)


@pytest.mark.parametrize("correction", [0.0, 0.5])
def test_the_handed_over_delta_is_corrected_by_a_share_of_where_the_phase_started_off_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, correction: float
) -> None:
    """Result at the phase's end (τ = 0): once S has taken step N, phase N + 1's Δ = y − w is handed
    over (and is the next estimate) less c·(y − θ_S), the share of the start's error its inner steps
    are taken to have undone; with c = 0, Δ as measured."""
    torch.set_num_threads(1)
    overrides = ["train.max_steps=12", "train.inner_steps=4", 'checkpoint.staging=""']
    overrides += [
        "checkpoint.interval=0",
        "outer.overlap.enabled=true",
        "outer.overlap.take_on_arrival=false",
    ]
    overrides += [f"outer.overlap.start_correction={correction}"]
    config = load_config("debug", overrides=overrides)
    link = HalvingLink()
    trainer = Trainer(config, node_key=b"m" * 32, work_dir=tmp_path / "node", ctx=RankContext(), link=link)
    link.trainer = trainer
    end_of_phase = OverlappedOuter.end_of_phase
    handed: list[tuple[torch.Tensor, torch.Tensor]] = []

    def watched(overlapped: OverlappedOuter, *, phase: int, tokens: int, loss: float) -> Outcome:
        state = overlapped.state
        assert state is not None
        start = state.start.clone()
        weights = torch.empty_like(trainer.flat)
        trainer.layout.gather(trainer.model, weights)
        outcome = end_of_phase(overlapped, phase=phase, tokens=tokens, loss=loss)
        assert outcome.goes_on
        expected = torch.sub(start, weights)
        if correction:
            expected.add_(torch.sub(trainer.outer.params, start), alpha=correction)
        handed.append((expected, state.delta.clone()))
        if len(handed) > 1:
            assert not torch.equal(start, trainer.outer.params)  # the phase started off S
        return outcome

    monkeypatch.setattr(OverlappedOuter, "end_of_phase", watched)
    trainer.run()
    assert len(handed) == 3 and trainer.outer_step == 3
    for expected, delta in handed:
        assert torch.equal(delta, expected)
