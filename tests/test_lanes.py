"""A frame's deadline on the ring's blocking lanes (lanes.Deadline): a large frame that keeps
arriving is not cut off by its size, a trickle below the floor rate still is."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from p2ptrain.comm.transport import lanes
from p2ptrain.comm.transport.seal import FrameSeal
from p2ptrain.comm.transport.wire import PeerTimeout

PAYLOAD = 256 * 1024
KEY = os.urandom(32)


def sealed_frame() -> bytes:
    """The bytes of one sealed frame of PAYLOAD bytes, as a sender puts them on the wire."""
    a, b = socket.socketpair()

    def send() -> None:
        with a:
            lanes.send_frame(
                lanes.Channel(a, FrameSeal(KEY)), {"kind": "rs"}, payload=bytes(PAYLOAD), timeout=10
            )

    sender = threading.Thread(target=send)
    sender.start()
    with b:
        data = bytearray()
        while piece := b.recv(1 << 20):
            data += piece
    sender.join()
    return bytes(data)


@pytest.fixture
def receiver() -> Iterator[tuple[lanes.Channel, socket.socket]]:
    """(the receiving channel, the raw socket a trickling peer writes into)."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        yield lanes.Channel(ours, FrameSeal(KEY)), theirs


def trickle(sock: socket.socket, data: bytes, *, rate: float, stop: threading.Event) -> threading.Thread:
    """Write `data` at about `rate` bytes/s, in pieces of a 20th of a second."""

    def write() -> None:
        piece = max(1, int(rate / 20))
        for start in range(0, len(data), piece):
            if stop.wait(0.05):
                return
            sock.sendall(data[start : start + piece])

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def test_a_large_frame_that_keeps_coming_outlasts_the_timeout(
    receiver: tuple[lanes.Channel, socket.socket],
) -> None:
    channel, theirs = receiver
    data, stop = sealed_frame(), threading.Event()
    writer = trickle(theirs, data, rate=PAYLOAD * 2, stop=stop)  # about 0.5 s, well above the floor
    frame = lanes.recv_frame(channel, 0.2, max_payload=PAYLOAD, min_rate=PAYLOAD / 4)
    assert frame.header["kind"] == "rs" and len(frame.payload) == PAYLOAD
    writer.join()


def test_without_a_floor_rate_the_same_frame_times_out(receiver: tuple[lanes.Channel, socket.socket]) -> None:
    channel, theirs = receiver
    data, stop = sealed_frame(), threading.Event()
    writer = trickle(theirs, data, rate=PAYLOAD * 2, stop=stop)
    try:
        with pytest.raises(PeerTimeout, match="bytes pending"):
            lanes.recv_frame(channel, 0.2, max_payload=PAYLOAD)
    finally:
        stop.set()
        writer.join()


def test_a_trickle_below_the_floor_rate_still_fails(receiver: tuple[lanes.Channel, socket.socket]) -> None:
    channel, theirs = receiver
    data, stop = sealed_frame(), threading.Event()
    floor = PAYLOAD / 4
    writer = trickle(theirs, data, rate=floor / 10, stop=stop)  # would take 40 s
    started = time.monotonic()
    try:
        with pytest.raises(PeerTimeout, match="bytes pending"):
            lanes.recv_frame(channel, 0.3, max_payload=PAYLOAD, min_rate=floor)
    finally:
        stop.set()
        writer.join()
    # 0.3 s, plus what it trickled meanwhile at the floor rate (a tenth of the elapsed time)
    assert time.monotonic() - started < 5.0


def test_a_frame_behind_another_lane_is_due_only_after_that_one(
    receiver: tuple[lanes.Channel, socket.socket],
) -> None:
    """With parallel lanes, frame p + 1 on lane 1 waits while frame p takes lane 0: its clock starts
    once frame p has arrived (`after`), not when lane 1 began to wait."""
    channel, _ = receiver
    arrived: list[float] = []
    started = time.monotonic()
    timer = threading.Timer(0.6, lambda: arrived.append(time.monotonic()))
    timer.start()
    try:
        with pytest.raises(PeerTimeout):
            lanes.recv_frame(channel, 0.2, max_payload=PAYLOAD, after=lambda: arrived[0] if arrived else None)
    finally:
        timer.cancel()
    waited = time.monotonic() - started
    assert arrived and waited >= 0.6 + 0.2 - 0.01, waited
    assert waited < 5.0
