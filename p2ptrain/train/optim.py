"""The inner optimizer: AdamW with linear warmup and cosine decay to 10 % (the Llama recipe)."""

from __future__ import annotations

import math

import torch
from torch import nn

from p2ptrain.config import TrainConfig

MIN_LR_RATIO = 0.1


def lr_factor(step: int, warmup_steps: int, max_steps: int) -> float:
    """Multiplier of the base learning rate at inner step `step` (0-based)."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    return MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress))


def build_inner_optimizer(
    model: nn.Module, config: TrainConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW without weight decay on norms (1-D weights), and its schedule."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=config.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, config.warmup_steps, config.max_steps)
    )
    return optimizer, schedule


def set_schedule_position(
    optimizer: torch.optim.Optimizer, schedule: torch.optim.lr_scheduler.LambdaLR, step: int
) -> None:
    """Put the schedule at inner step `step`, as if it had stepped that many times (resume, catch-up)."""
    schedule.last_epoch = step
    for group, base in zip(optimizer.param_groups, schedule.base_lrs, strict=True):
        group["lr"] = base * schedule.lr_lambdas[0](step)


def adam_moments(
    model: nn.Module, optimizer: torch.optim.Optimizer, step: int, create: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's exp_avg / exp_avg_sq of every parameter by name; created (zero, at `step`) if asked
    or missing, so a checkpoint can be loaded before the first step."""
    moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for name, param in model.named_parameters():
        state = optimizer.state[param]
        if create or "exp_avg" not in state:
            state["step"] = torch.tensor(float(step))
            state["exp_avg"] = torch.zeros_like(param)
            state["exp_avg_sq"] = torch.zeros_like(param)
        for key in moments:
            moments[key][name] = state[key]
    return moments
