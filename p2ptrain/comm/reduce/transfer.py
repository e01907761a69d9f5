"""The threads that move one all-reduce's frames, and how the event loop waits for them.

ring.py decides what goes where (the plan); this module runs it: one thread per connection and
direction over the sockets detached from asyncio (lanes.py), a hand-over of payloads from the
threads that produce them to the threads that send them on, first-error-wins failure, and the
event loop's watch over the connections we only send on.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from p2ptrain.comm.codec.quant import Buffer
from p2ptrain.comm.net.attempt import Connection
from p2ptrain.comm.transport import lanes
from p2ptrain.comm.transport.handshake import Session
from p2ptrain.comm.transport.pacing import UplinkPacer
from p2ptrain.comm.transport.resume import WarmLane
from p2ptrain.comm.transport.seal import FrameSeal
from p2ptrain.comm.transport.wire import PeerClosed
from p2ptrain.config import CommConfig

SlotKey = tuple[str, int, int]
"""(phase, round, chunk) of a frame whose payload another thread produces."""


class Plan(Protocol):
    """What the transfer needs from one member's schedule (ring._AllReduce)."""

    sockets: list[socket.socket]
    failure: BaseException | None
    comm: CommConfig

    def send_lane(self, peer: int, lane: int, channel: lanes.Channel) -> None: ...

    def receive_lane(self, peer: int, lane: int, channel: lanes.Channel) -> None: ...

    def hung_up(self, peer: int, state: str) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


class Aborted(Exception):
    """Another thread of this all-reduce failed first; this one stops quietly."""


class Slots:
    """Payloads handed from the thread that produced them to the one thread that sends them on,
    each with the spare buffer it lies in (None when it lies in the result), to give back once sent."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._items: dict[SlotKey, tuple[Buffer, bytearray | None]] = {}
        self._aborted = False

    def put(self, key: SlotKey, payload: Buffer, spare: bytearray | None = None) -> None:
        with self._changed:
            self._items[key] = (payload, spare)
            self._changed.notify_all()

    def take(self, key: SlotKey, timeout: float | None = None) -> tuple[Buffer, bytearray | None] | None:
        """Wait for `key`'s payload; None after `timeout` seconds without it. Every failure calls
        `abort`, so the wait always ends: the payload comes from a receive that has its own deadline."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while key not in self._items:
                if self._aborted:
                    raise Aborted
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._changed.wait(left)
            return self._items.pop(key)

    def abort(self) -> None:
        with self._changed:
            self._aborted = True
            self._changed.notify_all()


class Transfer:
    """The threads that move one all-reduce's frames, and how the event loop waits for them."""

    def __init__(self, plan: Plan, loop: asyncio.AbstractEventLoop):
        self.plan = plan
        self.loop = loop
        self.finished: asyncio.Future[None] = loop.create_future()
        self.threads: list[threading.Thread] = []
        self.watched: dict[int, socket.socket] = {}
        """fd → each socket we only send on, watched by the event loop."""
        self.running = 0
        self.adopted: list[tuple[lanes.Channel, Session, bool]] = []
        """Every lane's channel, its session, and whether we send on it."""
        uplink, floor = plan.comm.uplink_mbit * 1e6 / 8, plan.comm.slowest_link_mbit * 1e6 / 8
        self.pacer = UplinkPacer(uplink_bytes_per_s=uplink, floor_bytes_per_s=floor) if uplink > 0 else None
        """Our outgoing lanes' split of the uplink we declared (pacing.py); None: unpaced."""

    def adopt(self, connection: Connection, sending: bool) -> lanes.Channel:
        """Take a connection's socket out of asyncio (a kept lane's is out already), with the seal
        of the direction we use it in; `stop` closes it unless `keep` took it first."""
        if isinstance(connection, WarmLane):
            sock, session = connection.sock, connection.session
            seal = connection.sending if sending else connection.receiving
        else:
            _, writer, session = connection
            if session.keys is None:
                raise PeerClosed("the connection has no keys: its handshake did not complete")
            sock = lanes.detach(writer)
            seal = FrameSeal(session.keys.sending if sending else session.keys.receiving)
        self.plan.sockets.append(sock)
        channel = lanes.Channel(sock, seal)
        self.adopted.append((channel, session, sending))
        return channel

    def keep(
        self, wanted: Callable[[lanes.Channel, Session], bool], trailing: frozenset[str]
    ) -> list[WarmLane]:
        """Once the all-reduce succeeded: the lanes `wanted` says to keep for the next step
        (transport/resume.py), out of `stop`'s hands, with the seals whose counters go on.
        `trailing`: the kinds of frames of this step that may still come on them."""
        kept = []
        for channel, session, sending in self.adopted:
            if session.keys is None or not wanted(channel, session):
                continue
            unused = FrameSeal(session.keys.receiving if sending else session.keys.sending)
            outgoing, incoming = (channel.seal, unused) if sending else (unused, channel.seal)
            fd = channel.sock.fileno()
            if self.watched.pop(fd, None) is not None:
                self.loop.remove_reader(fd)
            self.plan.sockets.remove(channel.sock)
            kept.append(
                WarmLane(
                    sock=channel.sock,
                    session=session,
                    sending=outgoing,
                    receiving=incoming,
                    trailing=trailing,
                )
            )
        return kept

    def start(
        self, outgoing: dict[tuple[int, int], lanes.Channel], incoming: dict[tuple[int, int], lanes.Channel]
    ) -> None:
        plan = self.plan
        if self.pacer is not None:
            self.pacer.start([channel.sock for channel in outgoing.values()])
        for (peer, lane), channel in outgoing.items():
            self._spawn(f"send-{peer}.{lane}", plan.send_lane, peer, lane, channel)
            sock = channel.sock
            self.watched[sock.fileno()] = sock
            self.loop.add_reader(sock.fileno(), self._readable, peer, sock)
        for (peer, lane), channel in incoming.items():
            self._spawn(f"recv-{peer}.{lane}", plan.receive_lane, peer, lane, channel)

    def _spawn(self, name: str, work: Callable[[int, int, lanes.Channel], None], *args: object) -> None:
        thread = threading.Thread(
            target=self._run, args=(work, *args), name=f"p2ptrain-ring-{name}", daemon=True
        )
        self.threads.append(thread)
        self.running += 1
        thread.start()

    def _run(self, work: Callable[..., None], *args: object) -> None:
        try:
            work(*args)
        except Aborted:
            pass
        except BaseException as exc:  # handed to the waiting coroutine
            self.plan.fail(exc)
        finally:
            with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
                self.loop.call_soon_threadsafe(self._thread_done)

    def _thread_done(self) -> None:
        self.running -= 1
        self._settle()

    def _settle(self) -> None:
        """Wake the coroutine once every thread is done, or at the first failure."""
        if (self.running == 0 or self.plan.failure is not None) and not self.finished.done():
            self.finished.set_result(None)

    def _readable(self, peer: int, sock: socket.socket) -> None:
        state = lanes.readable_state(sock)
        if state == "idle":
            return
        self.loop.remove_reader(sock.fileno())
        del self.watched[sock.fileno()]
        self.plan.hung_up(peer, state)
        self._settle()

    def stop(self) -> None:
        """Stop watching, wake every thread still blocked (they exit at once) and close the sockets."""
        if self.pacer is not None:  # before the sockets close
            self.pacer.stop()
        for fd in self.watched:
            self.loop.remove_reader(fd)
        self.watched.clear()
        self.plan.fail(Aborted())  # a no-op after success or after an earlier failure
        for sock in self.plan.sockets:
            sock.close()

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
