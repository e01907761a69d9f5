"""The checkpoint format: what a checkpoint folder holds, and where a node keeps its folders.

A checkpoint is a folder `step-N` (N: the outer step it continues at, eight digits):

    params.safetensors   θ_outer by canonical parameter name (what `p2ptrain export` reads)
    outer.safetensors    the outer momentum, a flat canonical vector
    inner.safetensors    this node's AdamW exp_avg and exp_avg_sq, flat canonical vectors
    meta.json            `CheckpointMeta`: steps, data position, config and layout digests, shape
    manifest.json        size and sha256 of every file (written by the agent, ckpt/manifest.py)
    feedback.npy         under the sparse codec, this node's error-feedback accumulator (written by
                         the agent after the manifest: never served, a joiner starts from zeros)

The first two (`SHARED_FILES`) are the same bytes on every member of a step — the swarm's shared
state, covered by the manifest's digest; the others are the node's own. Folders are written under
a temporary name and renamed into place, so a reader never sees half of one.

This module has no torch in it: the agent, the sidecar and the fetcher use it as they are, and the
rank's reader and writer (train/checkpoint.py) build on it.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from p2ptrain.config import Config
from p2ptrain.errors import UserError

PARAMS_FILE = "params.safetensors"
OUTER_FILE = "outer.safetensors"
INNER_FILE = "inner.safetensors"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
FEEDBACK_FILE = "feedback.npy"
SHARED_FILES = (PARAMS_FILE, OUTER_FILE)
"""Byte-identical on every member of an outer step."""
STAGED_KEEP = 2
"""RAM copies kept: the newest, and the one before it for a peer still downloading it."""


def max_checkpoint_bytes(parameters: int) -> int:
    """More than any checkpoint of a model of `parameters` holds: θ, the momentum, the AdamW
    moments and the overlap's two vectors are six fp32 vectors; eight, and 16 MiB of headers."""
    return 8 * 4 * parameters + (16 << 20)


class CheckpointMeta(TypedDict, total=False):
    """meta.json. Written by rank 0; `model` and `layout_digest` are added by the writer."""

    outer_step: int
    """The outer step this checkpoint continues at (the folder is step-N)."""
    inner_step: int
    config_digest: str
    data_position: dict[str, Any]
    """Where this node's data streams continue (train/data.py DataPosition)."""
    model: dict[str, Any]
    layout_digest: str
    """Digest of the canonical parameter layout: a checkpoint loads only into the same model."""
    diverged: str
    """Set by the agent when the node ended off the swarm's track: why (export refuses it)."""
    pending: dict[str, Any]
    """outer.overlap: the step this node had handed over and not yet taken ({step, tokens,
    finite}); its Δ and the next phase's start are in the inner state file (train/overlap.py)."""


DIVERGED_FIELD = "diverged"


class CheckpointError(UserError):
    """A checkpoint that is missing, incomplete or of another model."""


def checkpoint_name(outer_step: int) -> str:
    return f"step-{outer_step:08d}"


def checkpoint_step(path: Path) -> int:
    """The outer step a checkpoint folder (step-N) continues at."""
    return int(path.name.rpartition("-")[2])


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted(path for path in directory.glob("step-*") if (path / META_FILE).exists())
    return found[-1] if found else None


def prune(directory: Path, keep: int) -> None:
    """Remove all but the newest `keep` checkpoints."""
    found = sorted(path for path in directory.glob("step-*") if path.is_dir())
    for old in found[: max(0, len(found) - keep)]:
        shutil.rmtree(old, ignore_errors=True)


def folder_bytes(path: Path) -> int:
    """Bytes of all files of a checkpoint folder."""
    return sum(file.stat().st_size for file in path.iterdir() if file.is_file())


@dataclass(frozen=True)
class CheckpointPlaces:
    """A node's two checkpoint folders: RAM staging (training writes there) and the disk copy.

    Training (rank 0) writes each checkpoint into the staging folder — /dev/shm by default, so the
    write runs at memory speed; the agent copies it to disk in the background and serves peers from
    the RAM copies (node/checkpoint_copies.py). Without staging, training writes to disk directly.
    """

    disk: Path
    staging: Path | None

    @property
    def write_dir(self) -> Path:
        """Where training writes, the sidecar serves from and recovered checkpoints land."""
        return self.staging or self.disk

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints in both places, oldest first (a step in both: the disk copy)."""
        found: dict[int, Path] = {}
        for folder in [p for p in (self.staging, self.disk) if p is not None and p.is_dir()]:
            for path in folder.glob("step-*"):
                if (path / META_FILE).is_file():
                    found[checkpoint_step(path)] = path
        return [found[step] for step in sorted(found)]

    def latest(self) -> Path | None:
        found = self.checkpoints()
        return found[-1] if found else None


def checkpoint_places(config: Config, node_id: str, work_dir: Path | None = None) -> CheckpointPlaces:
    """The places of the node `node_id` (its short id) whose work directory is `work_dir`."""
    work_dir = work_dir or Path(config.node.work_dir).expanduser()
    disk = Path(config.checkpoint.dir).expanduser() if config.checkpoint.dir else work_dir / "checkpoints"
    setting = config.checkpoint.staging
    staging: Path | None = None
    if setting == "auto":
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK):
            staging = shm / f"p2ptrain-{node_id}" / "checkpoints"
    elif setting:
        staging = Path(setting).expanduser()
    return CheckpointPlaces(disk, staging)
