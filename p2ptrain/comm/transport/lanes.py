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
import time
from collections.abc import Callable, Mapping
from typing import Any, Literal

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


def _kernel_timeout(sock: socket.socket, option: int, *, deadline: float, what: str) -> None:
    """Bound the next blocking call on `sock` by `deadline` (a partial transfer returns then)."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise PeerTimeout(f"{what} within the deadline")
    seconds = int(left)
    micros = max(1, int((left - seconds) * 1e6)) if seconds == 0 else int((left - seconds) * 1e6)
    sock.setsockopt(socket.SOL_SOCKET, option, struct.pack("@ll", seconds, micros))


def _recv_exactly(sock: socket.socket, view: memoryview, deadline: float) -> None:
    got = 0
    while got < len(view):
        pending = f"no complete frame ({len(view) - got} bytes pending)"
        _kernel_timeout(sock, socket.SO_RCVTIMEO, deadline=deadline, what=pending)
        try:
            count = sock.recv_into(view[got:], 0, socket.MSG_WAITALL)
        except BlockingIOError:  # the kernel timeout passed with nothing received
            raise PeerTimeout(f"{pending} within the deadline") from None
        except OSError as exc:
            raise PeerClosed(f"connection lost: {exc}") from None
        if count == 0:
            raise PeerClosed(f"connection closed after {got} of {len(view)} bytes")
        got += count


Placement = Callable[[dict[str, Any], int], "memoryview | None"]
"""Where a frame's payload should land, given its header and payload length: a view of exactly that
many bytes, or None for a fresh buffer."""


def recv_frame(
    channel: Channel, timeout: float, *, max_payload: int, place: Placement | None = None
) -> Frame:
    """Read one whole sealed frame within `timeout` seconds and open it. The payload is decrypted
    straight into the buffer `place` picks for it; its length was checked against `max_payload`
    first. Raises FrameError when the frame fails authentication."""
    sock = channel.sock
    deadline = time.monotonic() + timeout
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


def send_frame(channel: Channel, header: Mapping[str, Any], *, payload: Any, timeout: float) -> None:
    """Seal one frame and hand it to the kernel within `timeout` seconds."""
    sock = channel.sock
    deadline = time.monotonic() + timeout
    body = memoryview(payload).cast("B")
    head = encode_head(header, body.nbytes + TAG_BYTES)
    sealed = channel.buffer(body.nbytes + TAG_BYTES)
    channel.seal.seal_into(head, body, sealed)
    views = [memoryview(head), sealed]
    while views:
        _kernel_timeout(sock, socket.SO_SNDTIMEO, deadline=deadline, what="peer did not take the frame")
        try:
            sent = sock.sendmsg(views)
        except BlockingIOError:  # the kernel timeout passed with nothing sent
            raise PeerTimeout("peer did not take the frame within the deadline") from None
        except OSError as exc:
            raise PeerClosed(f"connection lost: {exc}") from None
        while sent and views:
            if sent >= len(views[0]):
                sent -= len(views[0])
                views.pop(0)
            else:
                views[0] = views[0][sent:]
                sent = 0


def unacknowledged(sock: socket.socket) -> int:
    """Bytes sent on `sock` that the peer has not acknowledged yet (Linux's SIOCOUTQ)."""
    return int(struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, bytes(4)))[0])


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
