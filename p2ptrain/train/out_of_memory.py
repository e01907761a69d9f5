"""A rank out of memory says so: what ran out, how much there was, and which setting to lower.

The allocator's refusal (CUDA's, or the CPU allocator's) is caught in rank.py: the rank prints one
line and exits with OUT_OF_MEMORY_EXIT. The other way, the kernel's OOM killer's SIGKILL, leaves
the rank nothing to say: the agent tells it from a plain kill (node/rank_memory.py).
"""

from __future__ import annotations

import os
import re

import torch

from p2ptrain.config import Config
from p2ptrain.memory_limits import gib, out_of_memory_advice, peak_rss, ram_total

UNITS = {"bytes": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
ALLOCATOR_MESSAGES = ("can't allocate memory", "not enough memory", "out of memory")


def is_out_of_memory(error: BaseException) -> bool:
    """The allocator could not give what was asked (CUDA, or the CPU allocator, or Python)."""
    if isinstance(error, MemoryError):
        return True
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(text in str(error) for text in ALLOCATOR_MESSAGES)


def raised_out_of_memory_line(
    rank: int, error: BaseException, *, config: Config, micro_batch: int, on_gpu: bool
) -> str:
    """What a rank prints before it exits with OUT_OF_MEMORY_EXIT."""
    if on_gpu:
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        had = f"{gib(torch.cuda.max_memory_allocated())} allocated at the peak, of {gib(total)} on the GPU"
    else:
        had = f"{gib(peak_rss(os.getpid()) or 0)} resident at the peak, of {gib(ram_total())} RAM"
    asked = re.search(r"(?:tried to allocate|allocate) ([0-9.]+) ?(bytes|[KMGT]i?B)?", str(error))
    request = ""
    if asked:
        unit = asked.group(2) or "bytes"
        size = float(asked.group(1)) * UNITS.get(unit.replace("i", ""), 1)
        request = f"it asked for {gib(int(size))} more; "
    return f"rank {rank}: ran out of memory ({request}{had}): {out_of_memory_advice(config, micro_batch)}"
