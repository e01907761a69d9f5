"""The agent's watch on each rank's memory, to tell the kernel's OOM killer from a plain kill.

A SIGKILLed rank can say nothing. The agent notes, when it starts a rank, the OOM kills its memory
cgroup has seen so far, and samples the rank's peak resident memory while it runs; a SIGKILL after
which the count went up (or the peak was at the limit) was the OOM killer.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from pathlib import Path

from p2ptrain.config import Config
from p2ptrain.memory_limits import (
    cgroup_memory_folder,
    cgroup_oom_kills,
    gib,
    out_of_memory_advice,
    peak_rss,
    ram_total,
)

NEAR_LIMIT = 0.9
"""A SIGKILLed rank whose peak resident memory reached this share of the limit ran out of memory."""


@dataclass(kw_only=True)
class RankMemoryWatch:
    """What the agent knows of one rank's memory: its cgroup, the OOM kills there when it started,
    and the highest peak RSS seen (sampled while it runs: /proc is gone once it died)."""

    pid: int
    cgroup: Path | None = None
    kills_at_start: int | None = None
    peak: int = 0
    limit: int = 0

    @classmethod
    def start(cls, pid: int) -> RankMemoryWatch:
        folder = cgroup_memory_folder(pid)
        return cls(
            pid=pid, cgroup=folder, kills_at_start=cgroup_oom_kills(folder), peak=0, limit=ram_total(pid)
        )

    def sample(self) -> None:
        self.peak = max(self.peak, peak_rss(self.pid) or 0)

    def killed_for_memory(self, returncode: int | None) -> bool:
        """SIGKILLed, and the kernel's OOM record says so (or its peak was at the limit)."""
        if returncode != -signal.SIGKILL:
            return False
        kills = cgroup_oom_kills(self.cgroup)
        if kills is not None and self.kills_at_start is not None and kills > self.kills_at_start:
            return True
        return bool(self.limit) and self.peak >= NEAR_LIMIT * self.limit

    def killed_line(self, rank: int, config: Config, micro_batch: int) -> str:
        peak = f"at {gib(self.peak)} resident, " if self.peak else ""
        return (
            f"trainer rank {rank} ran out of memory: the kernel's OOM killer ended it ({peak}"
            f"{gib(self.limit)} is the memory this node may use): {out_of_memory_advice(config, micro_batch)}"
        )
