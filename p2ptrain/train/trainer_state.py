"""A trainer's checkpoints: what a rank snapshots and rank 0's writer saves, and how a rank resumes
from a folder (format: ckpt/format.py; files: checkpoint.py; the writer thread: writer.py)."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from p2ptrain.ckpt.format import CheckpointMeta
from p2ptrain.train.checkpoint import load_state
from p2ptrain.train.data import DataPosition
from p2ptrain.train.overlap import OVERLAP_DELTA, OVERLAP_START, Pending

if TYPE_CHECKING:  # trainer.py imports this module
    from p2ptrain.train.trainer import Trainer

log = logging.getLogger(__name__)


def save_trainer_checkpoint(trainer: Trainer, background: bool = True) -> None:
    """Snapshot the full state into canonical vectors (all ranks) and have rank 0's writer save it.

    Training waits only for the snapshot; the files are written by a thread (see writer.py)."""
    started = time.monotonic()
    names = ["adam_exp_avg", "adam_exp_avg_sq"]
    leader = trainer.leader
    buffers = trainer.writer.snapshot_buffers(names) if leader is not None else {}
    for key, tensors in trainer.adam_moments().items():
        trainer.layout.gather_tensors(tensors, buffers.get(f"adam_{key}"))
    if leader is None:
        return
    meta: CheckpointMeta = {
        "outer_step": trainer.outer_step,
        "inner_step": trainer.inner_step,
        "config_digest": trainer.config.digest(),
        "data_position": trainer.batches.position.to_dict(),
    }
    overlap = trainer.overlapped
    if overlap is not None and overlap.pending is not None and overlap.state is not None:
        meta["pending"] = overlap.pending.to_dict()  # this node's: a step it handed over
        buffers = {**buffers, OVERLAP_DELTA: overlap.state.delta, OVERLAP_START: overlap.state.start}
    trainer.writer.write(
        trainer.places.write_dir,
        leader.outer.params,
        leader.outer.momentum_buffer,
        buffers,
        meta,
        background,
    )
    blocking = time.monotonic() - started
    leader.metrics.write("checkpoint", trainer.outer_step, blocking_s=round(blocking, 3))
    log.info("checkpoint of outer step %d: training waited %.3f s", trainer.outer_step, blocking)


def resume_trainer(trainer: Trainer, path: Path, own_data: bool = True) -> None:
    """Continue from a checkpoint exactly where it was taken (every rank reads the files).

    A checkpoint fetched from a peer carries the peer's data position: with `own_data` False
    the node keeps reading its own shard from where it is instead."""
    flat, state, meta = load_state(path, trainer.layout)
    if meta.get("config_digest") != trainer.config.digest():
        log.warning("resuming %s, saved under other training settings", path)
    trainer.inner_step = int(meta["inner_step"])
    trainer.outer_step = int(meta["outer_step"])
    trainer.flat.copy_(flat)
    if trainer.leader is not None:
        trainer.leader.outer.load_state_dict({"params": flat, "momentum": state["momentum"]})
    overlap = trainer.overlapped
    if overlap is not None:
        overlap.reset(pending_in_checkpoint="pending" in meta)
        if own_data and "pending" in meta and OVERLAP_START in state:
            # our own checkpoint, a step handed over: the phase after it starts where it did
            overlap.restore(Pending.from_dict(meta["pending"]), state[OVERLAP_DELTA], state[OVERLAP_START])
            trainer.flat.copy_(state[OVERLAP_START])
    trainer.layout.scatter(trainer.model, trainer.flat)
    for key, tensors in trainer.adam_moments(create=True).items():
        trainer.layout.scatter_tensors(tensors, state[f"adam_{key}"])
    if own_data:
        position = DataPosition.from_dict(meta["data_position"])
        if not trainer.batches.seek(position):
            log.warning(
                "%s: %d interleaved data streams here, %d there (data.interleave, capped at the "
                "number of files): its data position is not restored",
                path,
                len(trainer.batches.streams),
                len(position.streams),
            )
