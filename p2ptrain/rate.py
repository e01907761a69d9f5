"""A token bucket for what this node sends on others' behalf (relayed frames, checkpoint files)."""

from __future__ import annotations

import asyncio
import time


class RateCap:
    """At most `bytes_per_s` over everyone who takes from it, in bursts of 50 ms."""

    BURST_S = 0.05

    def __init__(self, bytes_per_s: float):
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0

    async def take(self, count: int) -> None:
        now = time.monotonic()
        self._free_at = max(now - self.BURST_S, self._free_at) + count / self.bytes_per_s
        if self._free_at > now:
            await asyncio.sleep(self._free_at - now)
