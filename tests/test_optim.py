"""The inner optimizer's two implementations against their oracle, torch.optim.AdamW: `InnerAdamW`
(CPU ranks) bit for bit with its single-tensor path, `TorchAdamW` (GPU ranks: fused; here on CPU,
fused and foreach) to float rounding; and which of them a rank gets."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
from torch import nn

from p2ptrain.config import TrainConfig
from p2ptrain.train.optim import (
    BETAS,
    EPS,
    InnerAdamW,
    InnerOptimizer,
    TorchAdamW,
    adam_moments,
    inner_optimizer,
    lr_factor,
)

CONFIG = TrainConfig(lr=3e-3, weight_decay=0.1, warmup_steps=3, max_steps=12)
Compare = Callable[[torch.Tensor, torch.Tensor], None]


def bit_for_bit(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert torch.equal(ours, theirs)


def to_rounding(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)


IMPLEMENTATIONS: dict[str, tuple[Callable[[nn.Module], InnerOptimizer], Compare]] = {
    "InnerAdamW": (lambda model: InnerAdamW(model, CONFIG), bit_for_bit),
    "TorchAdamW fused": (lambda model: TorchAdamW(model, CONFIG, fused=True), to_rounding),
    "TorchAdamW foreach": (lambda model: TorchAdamW(model, CONFIG, fused=False), to_rounding),
}
"""Each implementation, and how close to the oracle it must stay."""


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


class Oracle:
    """torch.optim.AdamW's single-tensor path on its own copy of the model, with the schedule."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.optimizer, self.schedule = _reference(model)

    def step(self, step: int) -> None:
        _backward(self.model, step)
        self.optimizer.step()
        self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)


def _step_both(
    step: int, *, model: nn.Module, optimizer: InnerOptimizer, oracle: Oracle, compare: Compare
) -> None:
    """One inner step of each on the same batch; then every parameter must match the oracle's."""
    _backward(model, step)
    optimizer.step(step)
    optimizer.zero_grad()
    oracle.step(step)
    for (name, value), other in zip(model.named_parameters(), oracle.model.parameters(), strict=True):
        try:
            compare(value, other)
        except AssertionError as error:
            raise AssertionError(f"{name}, step {step}: {error}") from None


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_each_matches_torch_adamw_through_warmup_and_decay(implementation: str) -> None:
    build, compare = IMPLEMENTATIONS[implementation]
    model = _model()
    optimizer = build(model)
    oracle = Oracle(_model())
    for step in range(CONFIG.max_steps):
        assert optimizer.lr_at(step) == oracle.schedule.get_last_lr()[0]
        _step_both(step, model=model, optimizer=optimizer, oracle=oracle, compare=compare)
    assert all(p.grad is None for p in model.parameters())
    moments = adam_moments(model, optimizer, steps_taken=CONFIG.max_steps)
    for name, param in oracle.model.named_parameters():
        state = oracle.optimizer.state[param]
        compare(moments["exp_avg"][name], state["exp_avg"])
        compare(moments["exp_avg_sq"][name], state["exp_avg_sq"])


@pytest.mark.parametrize("implementation", sorted(IMPLEMENTATIONS))
def test_moments_loaded_mid_run_continue_as_torch_adamw_would(implementation: str) -> None:
    """A resume: zero moments made `step` steps ago, a checkpoint's values copied in, then steps."""
    build, compare = IMPLEMENTATIONS[implementation]
    model = _model(1)
    optimizer = build(model)
    oracle = Oracle(_model(1))
    start = 5
    moments = adam_moments(model, optimizer, steps_taken=start, create=True)
    assert isinstance(optimizer, (InnerAdamW, TorchAdamW)) and optimizer.steps_taken == start
    for name, param in oracle.model.named_parameters():
        exp_avg = torch.full_like(param, 0.01)
        exp_avg_sq = torch.full_like(param, 1e-4)
        moments["exp_avg"][name].copy_(exp_avg)
        moments["exp_avg_sq"][name].copy_(exp_avg_sq)
        oracle.optimizer.state[param] = {
            "step": torch.tensor(float(start)),
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
        }
    oracle.schedule.last_epoch = start
    for group, base in zip(oracle.optimizer.param_groups, oracle.schedule.base_lrs, strict=True):
        group["lr"] = base * lr_factor(start, CONFIG.warmup_steps, CONFIG.max_steps)
    for step in range(start, start + 3):
        _step_both(step, model=model, optimizer=optimizer, oracle=oracle, compare=compare)
    assert optimizer.steps_taken == start + 3


def test_gpu_ranks_get_torch_fused_adamw_and_cpu_ranks_the_plain_one() -> None:
    """The device choice (made on the device's type alone: no GPU is needed to check it)."""
    on_gpu = inner_optimizer(_model(), CONFIG, torch.device("cuda", 0))
    assert isinstance(on_gpu, TorchAdamW) and on_gpu.fused
    assert on_gpu.optimizer.defaults["fused"]
    assert isinstance(inner_optimizer(_model(), CONFIG, torch.device("cpu")), InnerAdamW)


@pytest.mark.procs
def test_building_and_stepping_the_cpu_path_does_not_import_torch_dynamo() -> None:
    """What it is for: torch.optim imports torch._dynamo (1.1-1.3 CPU-s per rank process)."""
    script = (
        "import sys, torch\n"
        "from p2ptrain.config import TrainConfig\n"
        "from p2ptrain.train.optim import inner_optimizer\n"
        "model = torch.nn.Linear(3, 2)\n"
        "optimizer = inner_optimizer(model, TrainConfig(), torch.device('cpu'))\n"
        "model(torch.ones(1, 3)).sum().backward()\n"
        "optimizer.step(0)\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert result.stdout.strip() == "False"
