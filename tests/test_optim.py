"""The inner AdamW against its oracle, torch.optim.AdamW (single-tensor path): bit for bit."""

from __future__ import annotations

import subprocess
import sys

import torch
from torch import nn

from p2ptrain.config import TrainConfig
from p2ptrain.train.optim import BETAS, EPS, InnerAdamW, adam_moments, lr_factor

CONFIG = TrainConfig(lr=3e-3, weight_decay=0.1, warmup_steps=3, max_steps=12)


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3, bias=False))


def _reference(model: nn.Module) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": CONFIG.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=CONFIG.lr,
        betas=BETAS,
        eps=EPS,
        foreach=False,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, CONFIG.warmup_steps, CONFIG.max_steps)
    )
    return optimizer, schedule


def _backward(model: nn.Module, step: int) -> None:
    generator = torch.Generator().manual_seed(100 + step)
    inputs = torch.randn(4, 6, generator=generator)
    model(inputs).square().mean().backward()


def _step_both(
    step: int,
    mine: tuple[nn.Module, InnerAdamW],
    oracle: tuple[nn.Module, torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR],
) -> None:
    """One inner step of each on the same batch; then every parameter must be equal, bit for bit."""
    (ours, optimizer), (theirs, reference, schedule) = mine, oracle
    _backward(ours, step)
    _backward(theirs, step)
    optimizer.step(step)
    reference.step()
    schedule.step()
    optimizer.zero_grad()
    reference.zero_grad(set_to_none=True)
    for (name, value), other in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        assert torch.equal(value, other), name


def test_inner_adamw_matches_torch_adamw_bit_for_bit_through_warmup_and_decay() -> None:
    ours, theirs = _model(), _model()
    optimizer = InnerAdamW(ours, CONFIG)
    reference, schedule = _reference(theirs)
    for step in range(CONFIG.max_steps):
        assert optimizer.lr_at(step) == schedule.get_last_lr()[0]
        _step_both(step, (ours, optimizer), (theirs, reference, schedule))
    assert all(p.grad is None for p in ours.parameters())
    moments = adam_moments(ours, optimizer, CONFIG.max_steps)
    for name, param in theirs.named_parameters():
        state = reference.state[param]
        assert torch.equal(moments["exp_avg"][name], state["exp_avg"]), name
        assert torch.equal(moments["exp_avg_sq"][name], state["exp_avg_sq"]), name


def test_moments_loaded_mid_run_continue_as_torch_adamw_would() -> None:
    """A resume: zero moments made `step` steps ago, a checkpoint's values copied in, then steps."""
    ours, theirs = _model(1), _model(1)
    optimizer = InnerAdamW(ours, CONFIG)
    reference, schedule = _reference(theirs)
    start = 5
    moments = adam_moments(ours, optimizer, start, create=True)
    assert optimizer.steps_taken == start
    for name, param in theirs.named_parameters():
        exp_avg = torch.full_like(param, 0.01)
        exp_avg_sq = torch.full_like(param, 1e-4)
        moments["exp_avg"][name].copy_(exp_avg)
        moments["exp_avg_sq"][name].copy_(exp_avg_sq)
        reference.state[param] = {
            "step": torch.tensor(float(start)),
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
        }
    schedule.last_epoch = start
    for group, base in zip(reference.param_groups, schedule.base_lrs, strict=True):
        group["lr"] = base * lr_factor(start, CONFIG.warmup_steps, CONFIG.max_steps)
    for step in range(start, start + 3):
        _step_both(step, (ours, optimizer), (theirs, reference, schedule))


def test_building_and_stepping_it_does_not_import_torch_dynamo() -> None:
    """What it is for: torch.optim imports torch._dynamo (~2 CPU-s per rank process)."""
    script = (
        "import sys, torch\n"
        "from p2ptrain.config import TrainConfig\n"
        "from p2ptrain.train.optim import InnerAdamW\n"
        "model = torch.nn.Linear(3, 2)\n"
        "optimizer = InnerAdamW(model, TrainConfig())\n"
        "model(torch.ones(1, 3)).sum().backward()\n"
        "optimizer.step(0)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False"
