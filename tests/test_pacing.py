"""Pacing a member's lanes to the uplink it declared (comm.uplink_mbit, transport/pacing.py): the
split, and the kernel's caps on real sockets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from p2ptrain.comm.transport.pacing import SHARE_OF_UPLINK, SO_MAX_PACING_RATE, UplinkPacer, split, unsent

UPLINK = 10e6  # bytes/s


def test_the_lanes_with_bytes_waiting_share_the_uplink_and_an_idle_one_is_held_at_what_it_would_get() -> None:
    budget = SHARE_OF_UPLINK * UPLINK
    assert split(UPLINK, [5, 9, 1]) == [int(budget / 3)] * 3  # the butterfly's reduce-scatter
    # the others' frames have left: the lane to the successor carries the all-gather at the whole rate
    assert split(UPLINK, [0, 7, 0]) == [int(budget / 2), int(budget), int(budget / 2)]
    assert split(UPLINK, [0, 0]) == [int(budget)] * 2
    assert split(1.0, [1, 1, 1]) == [1, 1, 1]  # never 0: a cap of 0 would stop a lane
    # never under the rate the peers' deadlines take for a stalled frame (comm.slowest_link_mbit)
    assert split(UPLINK, [1, 1, 1], floor=0.5 * UPLINK) == [int(0.5 * UPLINK)] * 3


@contextmanager
def connected_pairs(count: int) -> Iterator[list[tuple[socket.socket, socket.socket]]]:
    """`count` TCP connections over loopback: (the end we send on, the end that receives)."""
    listener = socket.create_server(("127.0.0.1", 0))
    pairs = []
    try:
        for _ in range(count):
            sender = socket.create_connection(listener.getsockname())
            receiver, _ = listener.accept()
            pairs.append((sender, receiver))
        yield pairs
    finally:
        listener.close()
        for sender, receiver in pairs:
            sender.close()
            receiver.close()


def fill_send_queue(sock: socket.socket) -> None:
    """Send until bytes wait in `sock`'s send queue (its receiver does not read)."""
    sock.setblocking(False)
    while unsent(sock) == 0:
        try:
            sock.send(bytes(1 << 16))
        except BlockingIOError:
            break


def pacing_cap(sock: socket.socket) -> int:
    return int(sock.getsockopt(socket.SOL_SOCKET, SO_MAX_PACING_RATE))


def test_the_kernel_takes_the_caps_and_a_lane_left_with_a_backlog_gets_the_whole_share() -> None:
    """Two lanes; the receiver of the first stops reading, so its bytes wait in our send queue,
    while the second has sent everything: the first is capped at the whole share, the second at
    half of it (what it would get if it had bytes again)."""
    with connected_pairs(2) as pairs:
        senders = [sender for sender, _ in pairs]
        pacer = UplinkPacer(uplink_bytes_per_s=UPLINK)
        pacer.start(senders)
        try:
            share = int(SHARE_OF_UPLINK * UPLINK)
            assert [pacing_cap(sock) for sock in senders] == [share // 2] * 2  # both busy as it begins
            fill_send_queue(senders[0])
            assert unsent(senders[0]) > 0 and unsent(senders[1]) == 0
            pacer.tick()
            assert [pacing_cap(sock) for sock in senders] == [share, share // 2]
        finally:
            pacer.stop()


def test_the_pacer_updates_the_caps_on_its_own_and_stops_with_the_transfer() -> None:
    """Its thread, not a call of `tick`, moves the whole share to the lane left with a backlog."""
    with connected_pairs(2) as pairs:
        senders = [sender for sender, _ in pairs]
        pacer = UplinkPacer(uplink_bytes_per_s=UPLINK, interval=0.01)
        pacer.start(senders)
        share = int(SHARE_OF_UPLINK * UPLINK)
        fill_send_queue(senders[0])
        deadline = time.monotonic() + 10
        while pacing_cap(senders[0]) != share and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [pacing_cap(sock) for sock in senders] == [share, share // 2]
        pacer.stop()
        assert pacer._thread is not None and not pacer._thread.is_alive()
        assert not any(thread.name == "p2ptrain-pacer" for thread in threading.enumerate())


@pytest.mark.parametrize("capped", [False, True])
def test_a_capped_lane_sends_no_faster_than_its_cap(capped: bool) -> None:
    """The cap is the kernel's: 2 MB through a lane capped at 4 MB/s take at least 0.3 s (0.5 s at
    the cap; the first window's bytes leave before pacing has a rate: 0.41 s measured here);
    uncapped, loopback moves them in milliseconds. A lower bound: a slower machine only takes longer."""
    payload = bytes(2_000_000)
    with connected_pairs(1) as pairs:
        sender, receiver = pairs[0]
        if capped:
            pacer = UplinkPacer(uplink_bytes_per_s=4e6 / SHARE_OF_UPLINK)
            pacer.start([sender])
            pacer.stop()  # the cap stays on the socket
        received = 0

        def drain() -> None:
            nonlocal received
            while received < len(payload):
                chunk = receiver.recv(1 << 20)
                if not chunk:
                    return
                received += len(chunk)

        reader = threading.Thread(target=drain)
        started = time.monotonic()
        reader.start()
        sender.sendall(payload)
        reader.join(30)
        seconds = time.monotonic() - started
    assert received == len(payload)
    if capped:
        assert seconds >= 0.3, seconds
