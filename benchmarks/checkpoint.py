"""How long training waits for a checkpoint: staged in RAM vs a plain synchronous save to disk.

    python -m benchmarks.checkpoint --json [--config 150m]

Builds the model of the config on the CPU (one rank), takes one inner step so AdamW has state, then
times (median of --repeats) what training waits for when it checkpoints — the snapshot of the
state into memory, after which a thread writes the files into the RAM staging folder and the agent
copies them to disk (`blocking_s`; `staged_write_s` until the RAM files are complete, `copy_s` for
the disk copy) — against the same checkpoint saved synchronously straight to a disk folder and
fsynced (`sync_save_s`). Target: blocking_s ≤ 0.2 × sync_save_s.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import parser, report
from p2ptrain.ckpt.format import CheckpointPlaces, checkpoint_name, folder_bytes
from p2ptrain.config import load_config
from p2ptrain.node.checkpoint_copies import copy_to_disk, prune_places
from p2ptrain.train.trainer import RankContext, Trainer


def timed_save(trainer: Trainer, places: CheckpointPlaces, staged: bool) -> tuple[float, float, Path]:
    """(seconds training waited, seconds until the files were complete, folder)."""
    trainer.places = places
    started = time.perf_counter()
    trainer.save_checkpoint(background=staged)
    blocking = time.perf_counter() - started
    trainer.writer.wait()
    path = places.write_dir / checkpoint_name(trainer.outer_step)
    if not staged:  # a plain synchronous save is only done once the data is on the disk
        for file in path.iterdir():
            with file.open("rb") as handle:
                os.fsync(handle.fileno())
        blocking = time.perf_counter() - started
    return blocking, time.perf_counter() - started, path


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--config", default="150m")
    cli.add_argument("--repeats", type=int, default=3)
    cli.add_argument("--disk", default=".bench/checkpoint", help="disk folder for the synchronous saves")
    args = cli.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    shm = Path("/dev/shm")
    if not (shm.is_dir() and os.access(shm, os.W_OK)):
        report({"skipped": True, "reason": "no writable /dev/shm on this machine"}, args.json)
        return
    config = load_config(
        args.config, overrides=["train.batch_size=1", "model.seq_len=64", "train.max_steps=10"]
    )
    disk_root = Path(args.disk).resolve()
    with tempfile.TemporaryDirectory() as work, tempfile.TemporaryDirectory(dir=shm) as ram:
        trainer = Trainer(config, node_key=b"bench" * 6 + b"xx", work_dir=Path(work), ctx=RankContext())
        trainer.inner_step_once()
        staged = CheckpointPlaces(disk_root / "copies", Path(ram))
        direct = CheckpointPlaces(disk_root / "direct", None)
        blocking, write, sync, copy = [], [], [], []
        for _ in range(args.repeats):
            waited, written, path = timed_save(trainer, staged, staged=True)
            blocking.append(waited)
            write.append(written)
            copy.append(copy_to_disk(staged, path))
            prune_places(staged, keep=1)
            sync.append(timed_save(trainer, direct, staged=False)[0])
            trainer.outer_step += 1  # a new folder each round, as in training
        size = folder_bytes(path)
    shutil.rmtree(disk_root, ignore_errors=True)
    result = {
        "config": args.config,
        "checkpoint_gb": round(size / 1e9, 3),
        "blocking_s": round(statistics.median(blocking), 3),
        "sync_save_s": round(statistics.median(sync), 3),
        "staged_write_s": round(statistics.median(write), 3),
        "copy_s": round(statistics.median(copy), 3),
    }
    result["blocking_vs_sync"] = round(result["blocking_s"] / result["sync_save_s"], 3)
    report(result, args.json)


if __name__ == "__main__":
    main()
