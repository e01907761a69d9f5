"""The inner optimizer: AdamW with linear warmup and cosine decay to 10 % (the Llama recipe).

`InnerAdamW` does the arithmetic of `torch.optim.AdamW`'s single-tensor path, operation for
operation (tests/test_optim.py holds it to that, bit for bit), but is not a `torch.optim.Optimizer`:
that class imports `torch._dynamo` the first time a parameter group is added and again on every
`step`, ~2 CPU-seconds in each rank process before its first inner step. The update is
elementwise, so on FSDP2 shards it works on each rank's local shard directly.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from p2ptrain.config import TrainConfig
from p2ptrain.train.layout import is_dtensor

MIN_LR_RATIO = 0.1
BETAS = (0.9, 0.95)
EPS = 1e-8


def lr_factor(step: int, warmup_steps: int, max_steps: int) -> float:
    """Multiplier of the base learning rate at inner step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


class InnerAdamW:
    """AdamW (decoupled weight decay) without weight decay on norms (1-D weights), its learning
    rate given by the inner step it is taking (`lr_at`)."""

    def __init__(self, model: nn.Module, config: TrainConfig):
        self.config = config
        params = list(model.parameters())
        self.groups: list[tuple[list[torch.Tensor], float]] = [
            ([p for p in params if p.ndim >= 2], config.weight_decay),
            ([p for p in params if p.ndim < 2], 0.0),
        ]
        self.moments: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        """exp_avg and exp_avg_sq of each parameter, shaped (and sharded) like it; made on the
        first step or by `reset_moments`."""
        self.steps_taken = 0
        """Adam's t (bias correction): the steps taken since the moments were made."""

    def lr_at(self, inner_step: int) -> float:
        config = self.config
        return config.lr * lr_factor(inner_step, config.warmup_steps, config.max_steps)

    def reset_moments(self, steps_taken: int) -> None:
        """Zero moments, as if made `steps_taken` steps ago (a checkpoint then loads into them)."""
        self.moments = {
            p: (torch.zeros_like(p), torch.zeros_like(p)) for params, _ in self.groups for p in params
        }
        self.steps_taken = steps_taken

    @torch.no_grad()
    def step(self, inner_step: int) -> None:
        """One AdamW step on every parameter that has a gradient, at inner step `inner_step`'s
        learning rate."""
        if not self.moments:
            self.reset_moments(0)
        self.steps_taken += 1
        lr, (beta1, beta2) = self.lr_at(inner_step), BETAS
        step_size = lr / (1 - beta1**self.steps_taken)
        bias_correction2_sqrt = (1 - beta2**self.steps_taken) ** 0.5
        for params, weight_decay in self.groups:
            for param in params:
                if param.grad is None:
                    continue
                exp_avg, exp_avg_sq = (_local(moment) for moment in self.moments[param])
                value, grad = _local(param), _local(param.grad)
                if weight_decay != 0:
                    value.mul_(1 - lr * weight_decay)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(EPS)
                value.addcdiv_(exp_avg, denom, value=-step_size)

    def zero_grad(self) -> None:
        for params, _ in self.groups:
            for param in params:
                param.grad = None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter, gradient or moment (a view: writes go through);
    a plain tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def adam_moments(
    model: nn.Module, optimizer: InnerAdamW, step: int, create: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's exp_avg / exp_avg_sq of every parameter by name; created (zero, `step` steps taken)
    if asked or missing, so a checkpoint can be loaded before the first step."""
    if create or not optimizer.moments:
        optimizer.reset_moments(step)
    moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for name, param in model.named_parameters():
        moments["exp_avg"][name], moments["exp_avg_sq"][name] = optimizer.moments[param]
    return moments
