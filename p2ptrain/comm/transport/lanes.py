"""Blocking frame I/O on the raw sockets of one all-reduce, for the ring's worker threads.

Connections are dialed, accepted and authenticated on the event loop (dataplane.py, handshake.py);
then `detach` takes each socket out of asyncio and the bulk transfer runs on plain threads with
blocking calls. asyncio's streams copy every byte three times while holding the GIL; here a whole
payload moves with one `recv_into(…, MSG_WAITALL)` or one `sendmsg`, straight between the kernel
and our buffers, and the GIL is released for the whole wait. Deadlines are kernel socket timeouts
(SO_RCVTIMEO, SO_SNDTIMEO): Python's own socket timeouts would make the socket non-blocking and
wake the thread for every segment that arrives (measured: twice the CPU time of the ring on 2 cores).

The frame format is wire.py's, with the same checks: every length is validated before anything is
allocated, and every frame must arrive within its deadline. Every frame is sealed (seal.py): the
payload travels encrypted with its tag, and is decrypted straight into the buffer it belongs in.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal, TypeVar

from p2ptrain.comm.transport.seal import TAG_BYTES, FrameSeal
from p2ptrain.comm.transport.wire import (
    PREFIX,
    Frame,
    FrameError,
    PeerClosed,
    PeerTimeout,
    decode_header,
    encode_head,
    parse_prefix,
    stream_transport,
)

T = TypeVar("T")


class Channel:
    """One direction of one detached connection: its socket, the seal of that direction, and the
    buffer sealed payloads pass through (one thread uses a channel)."""

    def __init__(self, sock: socket.socket, seal: FrameSeal):
        self.sock = sock
        self.seal = seal
        self._buffer = bytearray()

    def buffer(self, size: int) -> memoryview:
        if len(self._buffer) < size:
            self._buffer = bytearray(size)
        return memoryview(self._buffer)[:size]


def detach(writer: asyncio.StreamWriter) -> socket.socket:
    """The connection's socket as a blocking socket of our own; the asyncio transport is dropped.

    The handshake pauses reading before its last message, so no frame of the data phase sits in
    asyncio's buffers. Closing the transport closes only its descriptor (ours is a duplicate), and
    asyncio never shuts a socket down on close, so the connection itself stays open.
    """
    transport = stream_transport(writer)
    transport.pause_reading()
    if transport.get_write_buffer_size():
        raise PeerClosed("handshake bytes still unsent when the data phase began")
    raw = transport.get_extra_info("socket")
    sock = socket.socket(raw.family, raw.type, raw.proto, fileno=os.dup(raw.fileno()))
    transport.abort()
    sock.setblocking(True)
    return sock


class Deadline:
    """How long one frame may take: `timeout` seconds, plus the time its bytes in transit need at
    `min_rate` bytes/s. A frame that keeps arriving (or leaving) at least that fast is never cut off
    by its size: on a slow or shared uplink a large frame takes longer than any fixed timeout
    (measured: 1 MB frames over a 50 Mbit/s uplink shared by 12 connections missed 5 s and failed
    every attempt). A peer that sends nothing, or trickles below `min_rate`, still fails within
    `timeout` plus what it sent at that rate."""

    def __init__(
        self, timeout: float, min_rate: float = 0.0, *, after: Callable[[], float | None] | None = None
    ):
        """`after`: when the clock starts (a monotonic time), None while it has not: a frame that
        follows another on a parallel lane is due only `timeout` after that one arrived."""
        self.timeout = timeout
        self.per_byte = 1 / min_rate if min_rate > 0 else 0.0
        self.credit = 0.0
        self.created = time.monotonic()
        self.after = after
        self.start: float | None = None if after is not None else self.created

    def _at(self) -> float | None:
        if self.start is None:
            assert self.after is not None
            began = self.after()
            if began is None:
                return None
            self.start = max(began, self.created)
        return self.start + self.timeout + self.credit

    def moved(self, count: int) -> None:
        self.credit += count * self.per_byte

    def expired(self) -> bool:
        at = self._at()
        return at is not None and time.monotonic() >= at

    def bound(self, sock: socket.socket, option: int, *, what: str) -> None:
        """Bound the next blocking call on `sock` by the deadline (a partial transfer returns then);
        before the clock starts, by a short slice, to look again."""
        at = self._at()
        left = UNSTARTED_SLICE_S if at is None else at - time.monotonic()
        if left <= 0:
            raise PeerTimeout(f"{what} within the deadline")
        seconds = int(left)
        micros = max(1, int((left - seconds) * 1e6)) if seconds == 0 else int((left - seconds) * 1e6)
        sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("@ll", seconds, micros))


UNSTARTED_SLICE_S = 0.25
"""How often a lane whose frame's clock has not started looks whether it has."""


def _recv_exactly(sock: socket.socket, view: memoryview, deadline: Deadline) -> None:
    got = 0
    while got < len(view):
        pending = f"no complete frame ({len(view) - got} bytes pending)"
        deadline.bound(sock, socket.SO_RCVTIMEO, what=pending)
        try:
            count = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        except BlockingIOError:  # the kernel timeout passed with nothing received
            if deadline.expired():
                raise PeerTimeout(f"{pending} within the deadline") from None
            continue
        except OSError as exc:
            raise PeerClosed(f"connection lost: {exc}") from None
        if count == 0:
            raise PeerClosed(f"connection closed after {got} of {len(view)} bytes")
        got += count
        deadline.moved(count)


Placement = Callable[[dict[str, Any], int], "memoryview | None"]
"""Where a frame's payload should land, given its header and payload length: a view of exactly that
many bytes, or None for a fresh buffer."""


def recv_frame(
    channel: Channel,
    timeout: float,
    *,
    max_payload: int,
    place: Placement | None = None,
    min_rate: float = 0.0,
    after: Callable[[], float | None] | None = None,
) -> Frame:
    """Read one whole sealed frame within `timeout` seconds (plus its bytes at `min_rate` bytes/s,
    counted from `after`: `Deadline`) and open it. The payload is decrypted straight into the
    buffer `place` picks for it; its length was checked against `max_payload` first. Raises
    FrameError when the frame fails authentication."""
    sock = channel.sock
    deadline = Deadline(timeout, min_rate, after=after)
    prefix = bytearray(PREFIX.size)
    _recv_exactly(sock, memoryview(prefix), deadline)
    header_len, sealed_len = parse_prefix(bytes(prefix), max_payload + TAG_BYTES)
    if sealed_len < TAG_BYTES:
        raise FrameError(f"sealed payload of {sealed_len} bytes is shorter than its tag")
    head = bytearray(header_len)
    _recv_exactly(sock, memoryview(head), deadline)
    sealed = channel.buffer(sealed_len)
    _recv_exactly(sock, sealed, deadline)
    header = decode_header(bytes(head))  # authenticated below, before anyone acts on it
    payload_len = sealed_len - TAG_BYTES
    target = place(header, payload_len) if place is not None else None
    payload = memoryview(bytearray(payload_len)) if target is None else target
    if len(payload) != payload_len:
        raise ValueError(f"placement of {len(payload)} bytes for a {payload_len}-byte payload")
    channel.seal.open_into(bytes(prefix) + bytes(head), sealed, payload)
    return Frame(header, payload)


def send_frame(
    channel: Channel, header: Mapping[str, Any], *, payload: Any, timeout: float, min_rate: float = 0.0
) -> None:
    """Seal one frame and hand it to the kernel within `timeout` seconds (plus its bytes at
    `min_rate` bytes/s: `Deadline`)."""
    sock = channel.sock
    deadline = Deadline(timeout, min_rate)
    body = memoryview(payload).cast("B")
    head = encode_head(header, body.nbytes + TAG_BYTES)
    sealed = channel.buffer(body.nbytes + TAG_BYTES)
    channel.seal.seal_into(head, body, sealed)
    views = [memoryview(head), sealed]
    while views:
        deadline.bound(sock, socket.SO_SNDTIMEO, what="peer did not take the frame")
        try:
            sent = sock.sendmsg(views)
        except BlockingIOError:  # the kernel timeout passed with nothing sent
            raise PeerTimeout("peer did not take the frame within the deadline") from None
        except OSError as exc:
            raise PeerClosed(f"connection lost: {exc}") from None
        deadline.moved(sent)
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


TCP_INFO_RTT = struct.Struct("@I")
TCP_INFO_RTT_OFFSET = 68
"""Where Linux's struct tcp_info holds tcpi_rtt (the smoothed round trip, microseconds)."""


def round_trip_s(sock: socket.socket) -> float | None:
    """The kernel's smoothed round trip of a connection we send on (from its ACKs), in seconds;
    None where TCP_INFO says nothing (another kernel, or no sample yet)."""
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    except OSError:
        return None
    if len(info) < TCP_INFO_RTT_OFFSET + TCP_INFO_RTT.size:
        return None
    (micros,) = TCP_INFO_RTT.unpack_from(info, TCP_INFO_RTT_OFFSET)
    return micros / 1e6 if micros else None


def unacknowledged(sock: socket.socket) -> int:
    """Bytes sent on `sock` that the peer has not acknowledged yet (Linux's SIOCOUTQ)."""
    return _queued(sock.fileno(), termios.TIOCOUTQ)


SIOCOUTQNSD = 0x894B
"""Linux's ioctl for the bytes of a socket's send queue not sent yet (TIOCOUTQ counts those in
flight too, which have left this host)."""


def unsent(sock: socket.socket) -> int:
    """Bytes queued on `sock` that have not left this host yet (Linux's SIOCOUTQNSD)."""
    return _queued(sock.fileno(), SIOCOUTQNSD)


def unread(fd: int) -> int:
    """Bytes that have arrived on the socket `fd` and wait to be read (Linux's FIONREAD)."""
    return _queued(fd, termios.FIONREAD)


def _queued(fd: int, request: int) -> int:
    return int(struct.unpack("i", fcntl.ioctl(fd, request, bytes(4)))[0])


def readable_state(sock: socket.socket) -> Literal["idle", "closed", "data"]:
    """What made a socket that the peer must never write to readable: nothing (a spurious wake-up),
    the peer closing (or resetting) it, or bytes it should not have sent."""
    try:
        return "data" if sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) else "closed"
    except BlockingIOError:
        return "idle"
    except OSError:
        return "closed"


def shut(sock: socket.socket) -> None:
    """Wake every thread blocked on `sock` (they get an error at once); the caller closes it later."""
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


async def on_own_thread(work: Callable[[], T], name: str) -> T:
    """`work()` on a thread of its own, for blocking calls on these sockets that may wait long
    (the barrier, a kept lane's rebind). Not asyncio's default executor: a few waits there (one per
    lane) took every worker, and the calls that would have ended them queued behind them.
    Cancelled, it leaves the thread to end when the caller shuts the socket it blocks on."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: T | None, error: BaseException | None) -> None:
        if done.done():  # cancelled meanwhile
            return
        if error is None:
            done.set_result(result)  # type: ignore[arg-type]
        else:
            done.set_exception(error)

    def run() -> None:
        result, error = None, None
        try:
            result = work()
        except BaseException as exc:  # handed to the waiting coroutine
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop is gone: nobody waits any more
            loop.call_soon_threadsafe(settle, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await done
