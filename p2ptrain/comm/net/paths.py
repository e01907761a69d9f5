"""What this node has measured of its paths to the peers it sends to, and the deadline an attempt of
a step derives from them.

A deadline is a function of the path, not a constant: a frame over a 700 ms path that lost a
segment waits TCP's retransmission timeout (more than a round trip), then a round trip more for
the copy, twice that under backoff. `comm.failure_timeout` is what the fastest paths need (and
what an unmeasured one gets); an attempt whose members include a longer path waits
PATH_ROUND_TRIPS of that path's round trips instead, up to a cap its caller sets (the all-reduce:
reduce/barrier.BEATS_PER_TIMEOUT times the configured value, since the keepalives' spacing follows
the deadline, and a successor that measured a short path still waits only twice its own for them).

Never shorter than the configured value: a crashed member's connections end at once whatever the
deadline (its kernel closes them; the dialer's probe finds its port refusing), and what a shorter
deadline would catch sooner, a frozen one, costs a false failure on a busy machine where a
descheduled process is late, not gone.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping

PATH_ROUND_TRIPS = 8
"""Round trips of the slowest measured member path that one frame (or answer) may take."""
MAX_PATHS = 1024
"""Peers remembered; the longest unmeasured go first (a peer is a key: strangers can make many)."""


class PathBook:
    """Per peer: the smoothed round trip (s) and throughput (bytes/s) of our lanes to it, as the
    kernel and our sends measured them in the all-reduces it was a member of.

    A round trip that grows is taken at once; one that shrinks halves the distance per measurement
    (a path whose queue drained may fill again in the next step)."""

    def __init__(self) -> None:
        self.round_trips: dict[bytes, float] = {}
        self.rates: dict[bytes, float] = {}
        """Bytes/s over the sends that waited for the link; a peer whose link kept up has none."""

    def measured(
        self, *, round_trips: Mapping[bytes, float] | None = None, rates: Mapping[bytes, float] | None = None
    ) -> None:
        """Take one all-reduce's measurements (ReduceStats.round_trips, .link_rates: inf where the
        link kept up, which forgets its rate)."""
        for key, seconds in (round_trips or {}).items():
            if not (math.isfinite(seconds) and seconds >= 0):
                continue
            old = self.round_trips.pop(key, None)
            self.round_trips[key] = seconds if old is None or seconds >= old else (old + seconds) / 2
        for key, rate in (rates or {}).items():
            self.rates.pop(key, None)
            if math.isfinite(rate) and rate > 0:
                self.rates[key] = rate
        for book in (self.round_trips, self.rates):
            while len(book) > MAX_PATHS:
                book.pop(next(iter(book)))

    def failure_timeout(self, keys: Collection[bytes], *, configured: float, cap: float) -> float:
        """The deadline of an attempt with members `keys`: PATH_ROUND_TRIPS round trips of the
        slowest path to one of them we measured, within [configured, cap]."""
        slowest = max((self.round_trips.get(key, 0.0) for key in keys), default=0.0)
        return min(max(configured, PATH_ROUND_TRIPS * slowest), max(configured, cap))
