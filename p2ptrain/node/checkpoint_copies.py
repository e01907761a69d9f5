"""The agent's copies of the checkpoints training stages in RAM: to disk, to a remote, and leftovers.

Training (rank 0) writes each checkpoint into the staging folder (ckpt/format.py CheckpointPlaces)
and goes back to training. The agent copies it to the disk folder in the background, keeps the
newest `checkpoint.keep` there and the newest `STAGED_KEEP` in RAM (the sidecar serves peers from
those), and uploads it to `checkpoint.remote` if set. A staging folder left by a killed agent is
flushed to disk when the node starts again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import time
from pathlib import Path

from p2ptrain.ckpt.format import (
    DIVERGED_FIELD,
    MANIFEST_FILE,
    META_FILE,
    STAGED_KEEP,
    CheckpointPlaces,
    checkpoint_step,
    prune,
)
from p2ptrain.ckpt.manifest import build_manifest
from p2ptrain.errors import UserError

log = logging.getLogger(__name__)


def copy_to_disk(places: CheckpointPlaces, folder: Path) -> float:
    """Copy one staged checkpoint to disk atomically; returns seconds taken."""
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
    return time.monotonic() - started


def prune_places(places: CheckpointPlaces, keep: int) -> None:
    """Keep the newest `keep` checkpoints on disk and the newest STAGED_KEEP in RAM."""
    prune(places.disk, keep)
    if places.staging is not None:
        prune(places.staging, STAGED_KEEP)


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
    files = sorted(folder.iterdir(), key=lambda path: path.name == MANIFEST_FILE)
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
            copy_to_disk(places, folder)
    prune(places.disk, keep)
    remove_staging(places)


def mark_diverged(places: CheckpointPlaces, reason: str) -> None:
    """Write `reason` into the meta of the node's newest checkpoint, in RAM and on disk (export then
    refuses it unless told otherwise), and hash the folder again."""
    latest = places.latest()
    if latest is None:
        return
    for folder in {latest, *(p / latest.name for p in (places.staging, places.disk) if p is not None)}:
        meta_path = folder / META_FILE
        if not meta_path.is_file():
            continue
        meta = json.loads(meta_path.read_text())
        meta[DIVERGED_FIELD] = reason
        meta_path.write_text(json.dumps(meta, indent=1, sort_keys=True))
        if (folder / MANIFEST_FILE).is_file():
            build_manifest(folder, checkpoint_step(folder))
    log.warning("marked %s as diverged: %s", latest.name, reason)


def remove_staging(places: CheckpointPlaces) -> None:
    """Free the RAM copies (the disk has them), and the node's /dev/shm folder once empty."""
    if places.staging is not None:
        shutil.rmtree(places.staging, ignore_errors=True)
        with contextlib.suppress(OSError):
            places.staging.parent.rmdir()
