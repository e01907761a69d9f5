"""Gradients of one batch in micro-batches: a small machine reaches the run's batch size.

The loss of a batch is the mean next-token cross-entropy over all its tokens. Each micro-batch adds
its summed cross-entropy divided by the whole batch's token count, so the accumulated gradient is
the one-pass gradient up to float summation order, whatever the split (the last micro-batch may be
smaller). Under FSDP2 every micro-batch's backward reduce-scatters into the sharded gradients, so
the unsharded gradients never outlive one block (memory stays that of one pass at the micro-batch).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import torch


def accumulate_gradients(
    model: torch.nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    *,
    micro_batch: int,
    autocast: Callable[[], AbstractContextManager[object]],
) -> torch.Tensor:
    """Run forward and backward over `inputs` in passes of `micro_batch` sequences, adding up the
    gradients; returns the batch's mean loss (detached, on the CPU: one device sync per batch)."""
    tokens = targets.numel()
    total = torch.zeros((), dtype=torch.float32, device=targets.device)
    for part, part_targets in zip(inputs.split(micro_batch), targets.split(micro_batch), strict=True):
        with autocast():
            loss = model(part, part_targets, reduction="sum") / tokens
        loss.backward()
        total += loss.detach().float()
    return total.cpu()
