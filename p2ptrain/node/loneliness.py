"""A node that trains alone in a networked run says so, with what to check.

A volunteer who pastes a join line without the run's config (or with another run's id, or a ticket
but no `run.authority`) joins a run of its own: nobody else's records are under its DHT key, so it
trains alone and every outer step looks fine. After `LONE_STEPS` outer steps or `LONE_SECONDS` with
no other member, and then every `REPEAT_SECONDS` while it lasts, it says so in one line.
"""

from __future__ import annotations

import time
from collections.abc import Callable

LONE_STEPS = 3
"""Outer steps in a row without another member before the first warning."""
LONE_SECONDS = 120.0
"""…or this long, whichever comes first (a run of long inner phases)."""
REPEAT_SECONDS = 600.0
"""The warning again while the node stays alone, at most this often."""


class LoneWatch:
    """Counts the outer steps a node completes without another member; returns the warning due."""

    def __init__(self, *, run_id: str, authority: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.run_id = run_id
        self.authority = authority
        self.clock = clock
        self.steps = 0
        self.since: float | None = None
        self.warned_at: float | None = None

    def step_done(self, members: int) -> str | None:
        """After an outer step with `members` members (1: alone; 0: given up, which says nothing):
        the warning to print now, if one is due."""
        if members > 1:
            self.steps = 0
            self.since = None
            self.warned_at = None
            return None
        if members == 0:
            return None
        now = self.clock()
        self.steps += 1
        if self.since is None:
            self.since = now
        alone_for = now - self.since
        if self.steps < LONE_STEPS and alone_for < LONE_SECONDS:
            return None
        if self.warned_at is not None and now - self.warned_at < REPEAT_SECONDS:
            return None
        self.warned_at = now
        run = f"run {self.run_id!r}" + (f" of authority {self.authority[:12]}" if self.authority else "")
        return (
            f"no other node of {run} for {self.steps} outer step(s) ({alone_for / 60:.0f} min): training "
            "alone. Check that the others use this run's config (--config; run.id, run.authority) "
            "and the same bootstrap peer; `p2ptrain status --peer … --config …` lists the run's nodes"
        )
