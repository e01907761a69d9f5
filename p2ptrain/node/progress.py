"""What a training node prints: a live progress bar on a terminal, else a progress line every
`node.progress_interval` seconds (a service's log would otherwise say nothing for a whole inner
phase, minutes on the bigger configs); one line per outer step either way."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from p2ptrain.channel import Progress as InnerProgress
from p2ptrain.channel import StepDone


class ProgressView:
    def __init__(
        self,
        out: TextIO,
        max_steps: int,
        *,
        inner_steps: int,
        interval: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.out = out
        self.console = Console(file=out, highlight=False)
        self.bar: Progress | None = None
        self.notes: dict[int, tuple[int, str]] = {}
        self.inner_steps = inner_steps
        self.interval = interval
        self._clock = clock
        self._last_line = -math.inf
        self._phase = (-1, 0)
        """(outer step, the global inner step before its first one): where the inner phase began."""
        if self.console.is_terminal:
            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("loss {task.fields[loss]}"),
                TextColumn("{task.fields[rate]} tok/s"),
                TimeRemainingColumn(),
                console=self.console,
            )
            # train.max_steps counts the inner steps of the whole run, as Progress.inner_step does
            self.task = self.bar.add_task("inner steps", total=max_steps, loss="-", rate="-")
            self.bar.start()

    def say(self, text: str) -> None:
        if self.bar is not None:
            self.bar.console.print(text)
        else:
            print(text, file=self.out, flush=True)

    def inner(self, progress: InnerProgress) -> None:
        if self.bar is not None:
            self.bar.update(
                self.task,
                completed=progress.inner_step,
                description=f"outer step {progress.outer_step}",
                loss=f"{progress.loss:.3f}",
                rate=f"{progress.tokens_per_s:,.0f}",
            )
            return
        if progress.outer_step != self._phase[0]:
            self._phase = (progress.outer_step, progress.inner_step - 1)
        now = self._clock()
        if now - self._last_line < self.interval:
            return
        self._last_line = now
        in_phase = progress.inner_step - self._phase[1]
        self.say(
            f"outer step {progress.outer_step}, inner step {in_phase}/{self.inner_steps}, "
            f"loss {progress.loss:.3f}, {progress.tokens_per_s:,.0f} tok/s"
        )

    def note(self, outer_step: int, members: int, note: str) -> None:
        self.notes[outer_step] = (members, note)

    def outer(self, done: StepDone) -> None:
        members, note = self.notes.pop(done.outer_step, (0, ""))
        loss = "no inner steps (catching up)" if math.isnan(done.loss) else f"loss {done.loss:.4f}"
        parts = [f"outer step {done.outer_step}: {loss}", f"{members} member(s)", note]
        self.say(", ".join([part for part in parts if part] + [f"params {done.params_hash[:12]}"]))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None
