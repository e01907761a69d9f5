"""The lanes a node keeps between steps (transport/resume.py), and the rebinds that come on them.

After a step whose all-reduce succeeded, each of its lanes is kept here under (peer, handshake lane,
dialed). The end that dialed a lane re-binds it when a later step needs that lane (`take`); the
other end watches it: the peer's rebind goes to the server, which answers it as a handshake
(server.py), and the last step's trailing frames are read and dropped. A lane whose peer closes
it, or sends anything else, is closed. A dialed lane the next step did not take is closed when
that step's lanes are kept (`prune`), so the lanes kept follow the schedule and stay bounded: at
most one per (peer, lane, end). TCP keepalives hold a kept lane's NAT mappings open between steps
and end a lane whose peer vanished without a word.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Awaitable, Callable

from p2ptrain.comm.transport import lanes
from p2ptrain.comm.transport.resume import WarmLane
from p2ptrain.comm.transport.wire import WireError
from p2ptrain.identity import short_id
from p2ptrain.untrusted import ThrottledLog

log = logging.getLogger(__name__)

LaneId = tuple[bytes, int, bool]
"""(peer key, handshake lane, this end dialed it)."""
Rebinder = Callable[[WarmLane, dict], Awaitable[None]]
"""Answers a rebind (its header) that came on a lane this end did not dial; owns the lane then."""
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3
"""TCP keepalives on a kept lane: a probe after 30 s without traffic, then every 10 s; 3 unanswered
end the lane (home routers drop idle mappings after minutes)."""
LISTENED_STEPS = 2
"""Steps a lane the peer dialed is kept without a rebind (its dialer closes it sooner)."""


class WarmLanes:
    """A node's kept lanes (see the module docstring); used on its event loop only."""

    def __init__(self, *, rebind: Rebinder, read_timeout: float):
        """`rebind`: the server's answer to a rebind; `read_timeout`: how long the rest of a frame
        may take once its first bytes arrived (comm.failure_timeout)."""
        self._rebind = rebind
        self._read_timeout = read_timeout
        self._lanes: dict[LaneId, WarmLane] = {}
        self._reading: dict[LaneId, asyncio.Task[None]] = {}
        self._drops = ThrottledLog(log, level=logging.INFO)
        self.rebound = 0
        """Lanes re-bound to a later step so far, either end (connect.py and the server count
        them; benchmarks read them)."""

    def __len__(self) -> int:
        return len(self._lanes)

    def keep(self, lane: WarmLane) -> None:
        """Keep `lane` (its step succeeded); one kept before under the same id is closed."""
        key = lane.key
        self._drop(key)
        try:
            sock = lane.sock
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in (
                (socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S),
                (socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S),
                (socket.TCP_KEEPCNT, KEEPALIVE_PROBES),
            ):
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
            self._lanes[key] = lane
            asyncio.get_running_loop().add_reader(sock.fileno(), self._readable, key)
        except (OSError, ValueError) as exc:  # the peer reset it meanwhile: nothing to keep
            self._lanes.pop(key, None)
            log.debug("lane to %s not kept: %s", short_id(key[0]), exc)
            lane.close()

    def take(self, peer: bytes, lane: int) -> WarmLane | None:
        """The lane to `peer` numbered `lane` that this end dialed, no longer watched, for a rebind;
        None if there is none (or its last frames are being read just now)."""
        key = (peer, lane, True)
        if key not in self._lanes or key in self._reading:
            return None
        warm = self._lanes.pop(key)
        asyncio.get_running_loop().remove_reader(warm.sock.fileno())
        return warm

    def prune(self, step: int) -> None:
        """Close the dialed lanes that step `step` did not take, and the lanes peers dialed that no
        rebind came on for LISTENED_STEPS steps (their step is over, and so is their schedule)."""
        for key, lane in list(self._lanes.items()):
            dialed, kept_at = key[2], lane.session.step
            if (dialed and kept_at < step) or kept_at < step - LISTENED_STEPS:
                self._drop(key)

    def close(self) -> None:
        """Close every kept lane (the node stops)."""
        for key in list(self._lanes):
            self._drop(key)
        for task in list(self._reading.values()):
            task.cancel()

    def _drop(self, key: LaneId) -> None:
        lane = self._lanes.pop(key, None)
        if lane is None:
            return
        with contextlib.suppress(ValueError, OSError):  # a closed socket has no descriptor
            asyncio.get_running_loop().remove_reader(lane.sock.fileno())
        lane.close()

    def _readable(self, key: LaneId) -> None:
        lane = self._lanes.get(key)
        if lane is None or key in self._reading:
            return
        asyncio.get_running_loop().remove_reader(lane.sock.fileno())
        task = asyncio.get_running_loop().create_task(self._read(key, lane))
        self._reading[key] = task
        task.add_done_callback(lambda _: self._reading.pop(key, None))

    async def _read(self, key: LaneId, lane: WarmLane) -> None:
        """A frame came on a kept lane: a trailing frame of its last step (dropped, and the lane
        watched again), a rebind from the end that dialed it (to the server), or the end of it."""
        try:
            receive = functools.partial(lane.receive, self._read_timeout)
            header = await lanes.on_own_thread(receive, "p2ptrain-kept-lane")
        except (WireError, OSError) as exc:
            if self._lanes.get(key) is lane:
                self._drops.warning("kept lane to %s ended: %s", short_id(key[0]), exc)
                self._drop(key)
            return
        if self._lanes.get(key) is not lane:  # dropped meanwhile (closed, or replaced)
            return
        if header is None:
            asyncio.get_running_loop().add_reader(lane.sock.fileno(), self._readable, key)
            return
        del self._lanes[key]
        if key[2]:
            self._drops.warning(
                "kept lane to %s ended: it sent %r unasked", short_id(key[0]), header.get("kind")
            )
            lane.close()
            return
        await self._rebind(lane, header)
