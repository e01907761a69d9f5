"""Where checkpoints live: a RAM staging folder that training writes to, and the disk folder.

Training (rank 0) writes each checkpoint into the staging folder — /dev/shm by default, so the
write runs at memory speed — and goes back to training. The node agent then copies it to the disk
folder in the background and keeps the newest `checkpoint.keep` there; the sidecar serves peers
straight from the RAM copies (the newest `STAGED_KEEP`). Without staging, training writes to disk
directly. A staging folder left by a killed agent is flushed to disk when the node starts again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from p2ptrain.config import Config
from p2ptrain.errors import UserError
from p2ptrain.train.checkpoint import META_FILE, checkpoint_step, prune

log = logging.getLogger(__name__)
STAGED_KEEP = 2
"""RAM copies kept: the newest, and the one before it for a peer still downloading it."""


@dataclass(frozen=True)
class CheckpointPlaces:
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


def copy_to_disk(places: CheckpointPlaces, folder: Path, keep: int) -> float:
    """Copy one staged checkpoint to disk atomically and prune both places; returns seconds taken."""
    if places.staging is None or folder.parent != places.staging:
        return 0.0
    started = time.monotonic()
    final = places.disk / folder.name
    partial = places.disk / f".{folder.name}.copy"
    shutil.rmtree(partial, ignore_errors=True)
    places.disk.mkdir(parents=True, exist_ok=True)
    shutil.copytree(folder, partial)
    for path in partial.iterdir():
        with path.open("rb") as handle:
            os.fsync(handle.fileno())
    shutil.rmtree(final, ignore_errors=True)
    os.replace(partial, final)
    prune(places.disk, keep)
    prune(places.staging, STAGED_KEEP)
    return time.monotonic() - started


def check_remote(url: str) -> None:
    """Fail early (one line) when `checkpoint.remote` cannot be used on this machine."""
    if not url:
        return
    try:
        import fsspec

        fsspec.core.url_to_fs(url)
    except ImportError as exc:
        raise UserError(f"checkpoint.remote {url}: needs {exc.name or 'fsspec'} (pip install it)") from None
    except (ValueError, OSError) as exc:
        raise UserError(f"checkpoint.remote {url}: unusable ({exc})") from None


def copy_to_remote(url: str, folder: Path) -> float:
    """Upload one checkpoint folder to url/step-N (files first, manifest last); returns seconds."""
    import fsspec

    started = time.monotonic()
    fs, root = fsspec.core.url_to_fs(url)
    target = f"{root.rstrip('/')}/{folder.name}"
    fs.makedirs(target, exist_ok=True)
    files = sorted(folder.iterdir(), key=lambda path: path.name == "manifest.json")
    for path in files:
        fs.put_file(str(path), f"{target}/{path.name}")
    return time.monotonic() - started


def flush_leftovers(places: CheckpointPlaces, keep: int) -> None:
    """Copy staged checkpoints newer than the disk's to disk (a killed agent's), then clear staging."""
    if places.staging is None or not places.staging.is_dir():
        return
    on_disk = {checkpoint_step(p) for p in places.disk.glob("step-*")} if places.disk.is_dir() else set()
    for folder in sorted(places.staging.glob("step-*")):
        if (folder / META_FILE).is_file() and checkpoint_step(folder) not in on_disk:
            log.info("copying %s, left in RAM by an earlier run, to %s", folder.name, places.disk)
            copy_to_disk(places, folder, keep)
    remove_staging(places)


def remove_staging(places: CheckpointPlaces) -> None:
    """Free the RAM copies (the disk has them), and the node's /dev/shm folder once empty."""
    if places.staging is not None:
        shutil.rmtree(places.staging, ignore_errors=True)
        with contextlib.suppress(OSError):
            places.staging.parent.rmdir()
