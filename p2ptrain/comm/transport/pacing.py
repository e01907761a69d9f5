"""Pacing a member's outgoing lanes to its uplink (`comm.uplink_mbit`), so that its own flows do
not overflow the queue in front of it.

Each lane is a TCP connection with its own congestion control. Several of them leaving one host at
once (the butterfly's n − 1 reduce-scatter streams) each probe for the whole uplink: in the lab,
three BBR flows from a 50 Mbit/s host overflowed its 100 ms queue (3–12 % of its packets dropped)
and moved 3 × 8 MB in 7.5 s where the line takes 3.8 s; each capped at a third of 95 % of the
uplink, 5.9–6.3 s (docs/results/2026-12-internet.md). The kernel paces a socket at most at its
SO_MAX_PACING_RATE (BBR paces itself; other congestion controls through the fq qdisc), so the cap
is the kernel's, per socket, and costs no copy.

The split follows which lanes have bytes waiting to leave (lanes.unsent): those share 95 % of the
uplink evenly; an idle lane is capped at the share it would get if it woke up. The butterfly's
lane to the successor, which carries the all-gather after the others' reduce-scatter frames have
left, then takes the whole uplink. A thread looks every INTERVAL_S while the transfer runs (there
is no event for a send queue draining); a cap a moment out of date costs at most that moment.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Sequence

from p2ptrain.comm.transport import lanes

SO_MAX_PACING_RATE = getattr(socket, "SO_MAX_PACING_RATE", 47)
"""Linux's socket option (not in Python 3.11's socket module)."""
UNLIMITED = 0xFFFFFFFF
"""SO_MAX_PACING_RATE's "no cap" (~0U)."""
SHARE_OF_UPLINK = 0.95
"""Of the declared uplink, what the lanes share: a declared rate is a speed test's, and a queue
that is never quite full drops nothing."""
INTERVAL_S = 0.05
"""How often the split is looked at again while a transfer runs."""


def unsent(sock: socket.socket) -> int:
    """Bytes in `sock`'s send queue that have not left this host yet (0 where the kernel cannot say)."""
    try:
        return lanes.unsent(sock)
    except OSError:
        return 0


def split(uplink: float, waiting: Sequence[int], floor: float = 0.0) -> list[int]:
    """Each lane's cap in bytes/s, given the bytes each has waiting to leave: SHARE_OF_UPLINK of
    `uplink` (bytes/s) evenly among the lanes with bytes waiting; an idle lane gets the share it
    would have if it had some. At least `floor` (the rate below which the peers take a frame in
    transit for a stalled one: a declared uplink far too low must not fail the steps), and at
    least 1 byte/s (0 would stop a lane)."""
    busy = sum(1 for count in waiting if count > 0)
    budget = SHARE_OF_UPLINK * uplink
    return [max(1, int(floor), int(budget / (busy if count > 0 else busy + 1))) for count in waiting]


def cap(sock: socket.socket, bytes_per_s: int) -> bool:
    """Set `sock`'s pacing cap; False where the kernel refuses it (the lane then goes unpaced)."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE, min(bytes_per_s, UNLIMITED))
    except OSError:
        return False
    return True


class UplinkPacer:
    """Keeps the pacing caps of one transfer's outgoing lanes at their split of the uplink."""

    def __init__(
        self, *, uplink_bytes_per_s: float, floor_bytes_per_s: float = 0.0, interval: float = INTERVAL_S
    ):
        """`uplink_bytes_per_s`: the member's declared uplink; `floor_bytes_per_s`: no lane's cap
        below it (`split`); `interval`: seconds between looks."""
        self.uplink = uplink_bytes_per_s
        self.floor = floor_bytes_per_s
        self.interval = interval
        self.sockets: list[socket.socket] = []
        self.caps: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, sockets: Sequence[socket.socket]) -> None:
        """Cap `sockets` (every one busy: a transfer begins) and keep their split up to date."""
        self.sockets = list(sockets)
        self.caps = [0] * len(self.sockets)
        self.update([1] * len(self.sockets))
        self._thread = threading.Thread(target=self._run, name="p2ptrain-pacer", daemon=True)
        self._thread.start()

    def update(self, waiting: Sequence[int]) -> None:
        for index, (sock, wanted) in enumerate(
            zip(self.sockets, split(self.uplink, waiting, self.floor), strict=True)
        ):
            if wanted != self.caps[index] and cap(sock, wanted):
                self.caps[index] = wanted

    def tick(self) -> None:
        """Split the uplink again by what each lane has waiting now."""
        self.update([unsent(sock) for sock in self.sockets])

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError, ValueError):  # a socket closed under us: the transfer ends
                self.tick()

    def stop(self) -> None:
        """Stop updating (the caps stay: a lane kept for the next step gets its next split then)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
