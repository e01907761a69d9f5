"""Reading and writing checkpoint folders on a rank: tensors in, tensors out (format: ckpt/format.py).

Taken at an outer-step boundary, where every rank's parameters equal θ_outer, so the inner model
needs no file of its own.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from p2ptrain.ckpt.format import (
    INNER_FILE,
    META_FILE,
    OUTER_FILE,
    PARAMS_FILE,
    CheckpointError,
    CheckpointMeta,
    checkpoint_name,
)
from p2ptrain.config import ModelConfig
from p2ptrain.train.layout import CanonicalLayout


def save_checkpoint(
    directory: Path,
    *,
    layout: CanonicalLayout,
    flat: torch.Tensor,
    model: ModelConfig,
    meta: CheckpointMeta,
    momentum: torch.Tensor | None = None,
    inner: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write θ_outer, the momentum and the inner state as directory/step-N, atomically."""
    final = directory / checkpoint_name(int(meta["outer_step"]))
    staging = directory / f".{final.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tensors = {name: view.clone() for name, view in layout.views(flat).items()}
    save_file(tensors, str(staging / PARAMS_FILE))
    if momentum is not None:
        save_file({"momentum": momentum.contiguous()}, str(staging / OUTER_FILE))
    if inner:
        save_file({name: value.contiguous() for name, value in inner.items()}, str(staging / INNER_FILE))
    record: CheckpointMeta = {**meta, "model": model.model_dump(), "layout_digest": layout.digest()}
    (staging / META_FILE).write_text(json.dumps(record, indent=1, sort_keys=True))
    shutil.rmtree(final, ignore_errors=True)
    os.replace(staging, final)
    return final


def load_params(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(tensors by canonical name, meta) of a checkpoint directory; CheckpointError when unusable."""
    if not (path / META_FILE).is_file() or not (path / PARAMS_FILE).is_file():
        raise CheckpointError(f"{path}: not a p2ptrain checkpoint (no {META_FILE} and {PARAMS_FILE})")
    try:
        meta = json.loads((path / META_FILE).read_text())
        tensors = load_file(str(path / PARAMS_FILE))
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable checkpoint ({exc})") from None
    if not isinstance(meta, dict) or "model" not in meta:
        raise CheckpointError(f"{path}/{META_FILE}: no model section")
    return tensors, meta


def load_state(
    path: Path, layout: CanonicalLayout
) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, Any]]:
    """(θ_outer as a flat vector, the state vectors, meta) for resuming a node of `layout`'s model."""
    tensors, meta = load_params(path)
    if meta.get("layout_digest") != layout.digest():
        raise CheckpointError(f"{path}: holds another model (layout differs from this config's)")
    for name in (OUTER_FILE, INNER_FILE):
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: no {name}; it can be exported but not resumed")
    flat = layout.new_flat()
    for name, view in layout.views(flat).items():
        view.copy_(tensors[name])
    try:
        state = {**load_file(str(path / OUTER_FILE)), **load_file(str(path / INNER_FILE))}
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable state file ({exc})") from None
    required = {"momentum", "adam_exp_avg", "adam_exp_avg_sq"}
    optional = {"overlap_delta", "overlap_start"}  # a node's own pipeline (train/overlap.py)
    if not required <= set(state) <= required | optional or any(
        value.shape != (layout.numel,) for value in state.values()
    ):
        raise CheckpointError(f"{path}: state vectors missing or of the wrong size")
    return flat, state, meta
