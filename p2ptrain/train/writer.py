"""Rank 0's checkpoint writer: training waits for a snapshot in memory, not for the files.

`snapshot_buffers` are flat vectors allocated once, into which the ranks gather AdamW's moments
(they change at every inner step, so they are copied); θ_outer and the outer momentum change only
at the next outer step, and the trainer waits for the writer before taking it. A thread then
serialises everything into the staging folder (RAM by default), atomically, prunes old copies
where no agent does, and reports the finished checkpoint (to the agent, which hashes, serves and
copies it to disk, then prunes).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch

from p2ptrain.ckpt.format import CheckpointMeta, prune
from p2ptrain.config import ModelConfig
from p2ptrain.train.checkpoint import save_checkpoint
from p2ptrain.train.layout import CanonicalLayout

log = logging.getLogger(__name__)
Written = Callable[[Path, int, float], None]
"""Called with (folder, outer step, seconds the write took) once a checkpoint is complete."""


class CheckpointWriter:
    """Rank 0's writer thread and the snapshot vectors it reads (see the module docstring).

    Caveat: `write` keeps references to the tensors it is given, not copies. Whoever changes one of
    them (θ_outer, the momentum, overlap's vectors) must `wait` first."""

    def __init__(self, layout: CanonicalLayout, *, model: ModelConfig, keep: int | None, on_written: Written):
        """`keep`: checkpoints left in the folder after each write; None: the node agent prunes."""
        self.layout = layout
        self.model = model
        self.keep = keep
        self.on_written = on_written
        self._buffers: dict[str, torch.Tensor] = {}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def snapshot_buffers(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Reusable flat vectors to gather into (the previous write must be finished: `wait`)."""
        self.wait()
        for name in names:
            if name not in self._buffers:
                self._buffers[name] = self.layout.new_flat()
        return {name: self._buffers[name] for name in names}

    def write(
        self,
        folder: Path,
        *,
        params: torch.Tensor,
        momentum: torch.Tensor,
        inner: dict[str, torch.Tensor],
        meta: CheckpointMeta,
        background: bool = True,
    ) -> None:
        """Write folder/step-N from these tensors, in a thread unless `background` is False."""
        self.wait()

        def run() -> None:
            started = time.monotonic()
            try:
                path = save_checkpoint(
                    folder,
                    layout=self.layout,
                    flat=params,
                    model=self.model,
                    meta=meta,
                    momentum=momentum,
                    inner=inner,
                )
                if self.keep is not None:
                    prune(folder, self.keep)
            except BaseException as exc:  # reported by the next wait(), on the training thread
                self._error = exc
                return
            self.on_written(path, int(meta["outer_step"]), time.monotonic() - started)

        if not background:
            run()
            self._raise()
            return
        self._thread = threading.Thread(target=run, name="checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Block until the write in progress is done; re-raise its error here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._raise()

    def _raise(self) -> None:
        if self._error is not None:
            error = self._error
            self._error = None
            raise error
