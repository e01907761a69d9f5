"""The inner optimizer: AdamW with linear warmup and cosine decay to 10 % (the Llama recipe), without
weight decay on norms (1-D weights), its learning rate given by the inner step it is taking.

Two implementations of the same update; `inner_optimizer` is the one place that picks, by the
rank's device:

    CUDA ranks   `TorchAdamW(fused=True)`: torch.optim.AdamW's fused kernel, one launch per step
                 for all parameters where a loop would launch several per parameter
    CPU ranks    `InnerAdamW`: the arithmetic of torch.optim.AdamW's single-tensor path, written
                 out operation for operation (tests/test_optim.py holds it to that, bit for bit)

Why not torch's on CPU too: `torch.optim.Optimizer` imports `torch._dynamo` when its parameter
groups are added, measured at 1.1-1.3 CPU-seconds in a fresh process (torch 2.13, x86-64, the debug
model), where `InnerAdamW` takes 0.005 s. Every rank process pays it once before its first inner
step, and the test suite starts dozens of CPU rank processes on two cores. A step of the debug model
costs 3 ms on either path on CPU (fused: 1 ms); on a GPU the import is noise beside CUDA's start.

Both keep exp_avg and exp_avg_sq per parameter, shaped (and FSDP2-sharded) like it, and Adam's t,
the steps taken since the moments were made; `adam_moments` hands them to the checkpoint by
parameter name, which saves and restores them whichever optimizer wrote them (a GPU node's
checkpoint loads on a CPU node). The two agree to float rounding, not bit for bit: that leaves
the shared state S alone, which never depends on the inner optimizer, only a node's own working
weights do.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Protocol

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


def lr_at(config: TrainConfig, inner_step: int) -> float:
    """The learning rate of inner step `inner_step`."""
    return config.lr * lr_factor(inner_step, config.warmup_steps, config.max_steps)


def parameter_groups(model: nn.Module, config: TrainConfig) -> list[tuple[list[torch.Tensor], float]]:
    """(parameters, weight decay): matrices decay, norms (1-D weights) do not."""
    params = list(model.parameters())
    return [
        ([p for p in params if p.ndim >= 2], config.weight_decay),
        ([p for p in params if p.ndim < 2], 0.0),
    ]


class InnerOptimizer(Protocol):
    """What the trainer and its checkpoint need of either implementation."""

    def lr_at(self, inner_step: int) -> float: ...

    def step(self, inner_step: int) -> None:
        """One AdamW step on every parameter that has a gradient, at `inner_step`'s learning rate."""
        ...

    def zero_grad(self) -> None: ...

    @property
    def moments(self) -> Mapping[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """exp_avg and exp_avg_sq by parameter; empty before the first step or `reset_moments`."""
        ...

    def reset_moments(self, steps_taken: int) -> None:
        """Zero moments, as if made `steps_taken` steps ago (a checkpoint then loads into them)."""
        ...


def inner_optimizer(model: nn.Module, config: TrainConfig, device: torch.device) -> InnerOptimizer:
    """The inner optimizer of a rank on `device`: the choice of implementation, made here only."""
    if device.type == "cuda":
        return TorchAdamW(model, config, fused=True)
    return InnerAdamW(model, config)


class InnerAdamW:
    """AdamW per parameter in plain tensor operations, so that a CPU rank never imports what
    `torch.optim` does (see the module docstring). The update is elementwise, so on FSDP2 shards it
    works on each rank's local shard directly."""

    def __init__(self, model: nn.Module, config: TrainConfig):
        self.config = config
        self.groups = parameter_groups(model, config)
        self.moments: dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]] = {}
        """exp_avg and exp_avg_sq of each parameter, shaped (and sharded) like it; made on the
        first step or by `reset_moments`."""
        self.steps_taken = 0
        """Adam's t (bias correction): the steps taken since the moments were made."""

    def lr_at(self, inner_step: int) -> float:
        return lr_at(self.config, inner_step)

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
        lr = self.lr_at(inner_step)
        beta1, beta2 = BETAS
        step_size = lr / (1 - beta1**self.steps_taken)
        bias_correction2_sqrt = (1 - beta2**self.steps_taken) ** 0.5
        for params, weight_decay in self.groups:
            for param in params:
                if param.grad is None:
                    continue
                exp_avg, exp_avg_sq = (_local(moment) for moment in self.moments[param])
                value = _local(param)
                grad = _local(param.grad)
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


class TorchAdamW:
    """torch.optim.AdamW behind `InnerOptimizer`, for the GPU's fused kernel (`fused=True`; False:
    the foreach path). It runs on CPU too, where the tests hold it against `InnerAdamW`.

    Its moments are made for every parameter before the first step (as `InnerAdamW` makes them), not
    lazily by torch, so that a checkpoint finds them all and can load into them."""

    def __init__(self, model: nn.Module, config: TrainConfig, *, fused: bool):
        self.config = config
        self.fused = fused
        groups = [
            {"params": params, "weight_decay": decay} for params, decay in parameter_groups(model, config)
        ]
        # foreach=None with fused: torch refuses both set; foreach=True otherwise (its default on
        # CPU would be the single-tensor loop)
        self.optimizer = torch.optim.AdamW(
            groups,
            lr=config.lr,
            betas=BETAS,
            eps=EPS,
            fused=fused,
            foreach=None if fused else True,
        )

    def lr_at(self, inner_step: int) -> float:
        return lr_at(self.config, inner_step)

    @property
    def moments(self) -> dict[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        return {
            param: (state["exp_avg"], state["exp_avg_sq"]) for param, state in self.optimizer.state.items()
        }

    @property
    def steps_taken(self) -> int:
        """Adam's t (each parameter keeps its own; they are all equal here)."""
        states = iter(self.optimizer.state.values())
        first = next(states, None)
        return int(first["step"]) if first is not None else 0

    def reset_moments(self, steps_taken: int) -> None:
        """Zero moments, as if made `steps_taken` steps ago, in the form torch's own first step
        would make them: the step count a float32 scalar tensor, on the parameter's device for the
        fused kernel (which reads it there) and on the CPU for the foreach path."""
        for group in self.optimizer.param_groups:
            for param in group["params"]:
                device = param.device if self.fused else torch.device("cpu")
                self.optimizer.state[param] = {
                    "step": torch.tensor(float(steps_taken), dtype=torch.float32, device=device),
                    "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                }

    def step(self, inner_step: int) -> None:
        if not self.optimizer.state:
            self.reset_moments(0)
        lr = self.lr_at(inner_step)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of an FSDP2 parameter, gradient or moment (a view: writes go through);
    a plain tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def adam_moments(
    model: nn.Module, optimizer: InnerOptimizer, *, steps_taken: int, create: bool = False
) -> dict[str, dict[str, torch.Tensor]]:
    """AdamW's exp_avg / exp_avg_sq of every parameter by name, for the checkpoint to gather (save)
    or scatter into (resume); made anew (zero, `steps_taken` steps taken) if asked, or if missing so
    that a checkpoint can be saved or loaded before the first step."""
    if create or not optimizer.moments:
        optimizer.reset_moments(steps_taken)
    found = optimizer.moments
    moments: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}}
    for name, param in model.named_parameters():
        moments["exp_avg"][name], moments["exp_avg_sq"][name] = found[param]
    return moments
