"""Per-node metrics: one JSON line per inner and outer step, and TensorBoard when asked for."""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path
from typing import Any

import torch

from p2ptrain.config import MetricsConfig

log = logging.getLogger(__name__)


class MetricsWriter:
    """Appends {"kind": "inner"|"outer", "time": …, …} lines to `path`, flushed at every line so that
    the agent, the dashboard and the tests read a node's progress while it trains; and the same
    numbers to TensorBoard or Weights & Biases where configured."""

    def __init__(
        self,
        path: Path,
        *,
        config: MetricsConfig | None = None,
        tensorboard_dir: Path | None = None,
        run_name: str = "",
    ):
        path.parent.mkdir(parents=True, exist_ok=True)
        self._file = path.open("a")
        self._lock = threading.Lock()
        self._tensorboard = None
        self._wandb = None
        if config is not None and config.wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=config.wandb_project, name=run_name or None)
            except ImportError:
                log.warning("metrics.wandb_project is set but wandb is not installed; JSONL only")
        if config is not None and config.tensorboard and tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(str(tensorboard_dir))
            except ImportError:
                log.warning("metrics.tensorboard is set but tensorboard is not installed; JSONL only")

    def write(self, kind: str, step: int, **values: Any) -> None:
        record = {"kind": kind, "step": step, "time": round(time.time(), 3), **values}
        with self._lock:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        numbers = {
            f"{kind}/{name}": value
            for name, value in values.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
        }
        if self._tensorboard is not None:
            for name, value in numbers.items():
                self._tensorboard.add_scalar(name, value, step)
        if self._wandb is not None:
            self._wandb.log(numbers)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every complete line of a metrics file (a line being written is skipped)."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "4090": 165e12,
    "A6000": 155e12,
}


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of the GPU (for MFU), from its name; None when unknown."""
    name = torch.cuda.get_device_name(device)
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)


def gpu_memory(device: torch.device) -> dict[str, float]:
    """A rank's peak GPU memory so far, allocated and reserved by the caching allocator, in GiB (the
    memory estimate is checked against them); nothing on the CPU."""
    if device.type != "cuda":
        return {}
    return {
        "gpu_peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3),
        "gpu_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 3),
    }
