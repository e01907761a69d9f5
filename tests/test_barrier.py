"""The completion barrier (p2ptrain/comm/barrier.py) over real sealed socket pairs, one thread per
member; the ring harness (test_ring.py) covers it inside whole all-reduces."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from p2ptrain.comm.reduce.barrier import (
    ALIVE,
    BEATS_PER_TIMEOUT,
    DONE,
    Holding,
    ToSuccessor,
    await_every_holder,
)
from p2ptrain.comm.transport import lanes
from p2ptrain.comm.transport.seal import FrameSeal
from p2ptrain.comm.transport.wire import FrameError, PeerClosed, PeerTimeout
from p2ptrain.identity import NodeIdentity

STEP = 11
FAILURE_TIMEOUT = 5.0
DIGEST = bytes(range(32))
IDENTITIES = [NodeIdentity(Ed25519PrivateKey.generate(), Path("unused")) for _ in range(70)]


def holding(index: int, n: int, *, attempt: int = 0, digest: bytes = DIGEST) -> Holding:
    """Member `index`'s part in the barrier of attempt `attempt` among the first `n` identities
    (`digest` stands for the membership digest, which covers the step)."""
    keys = [identity.public_key for identity in IDENTITIES[:n]]
    return Holding.signed(IDENTITIES[index], STEP, keys=keys, digest=digest, attempt=attempt)


def proofs(holders: int, n: int = 4, *, attempt: int = 0, digest: bytes = DIGEST) -> bytes:
    """The members' real signatures for every member in `holders`, as an honest sender's first frame."""
    return b"".join(
        holding(m, n, attempt=attempt, digest=digest).signature for m in range(n) if holders >> m & 1
    )


def channel_pair() -> tuple[lanes.Channel, lanes.Channel]:
    """(the sending end, the receiving end) of one sealed connection."""
    key = os.urandom(32)
    sender, receiver = socket.socketpair()
    return lanes.Channel(sender, FrameSeal(key)), lanes.Channel(receiver, FrameSeal(key))


def run_ring(n: int, seconds: float = 5.0) -> dict[int, str]:
    """n members, member i's successor i + 1: what each one's barrier ended with."""
    links = [channel_pair() for _ in range(n)]  # link i: member i to member i + 1
    outcomes: dict[int, str] = {}

    def member(index: int) -> None:
        to_successor = ToSuccessor(STEP, FAILURE_TIMEOUT)
        to_successor.start(links[index][0])
        try:
            await_every_holder(
                holding(index, n), to_successor, from_predecessor=links[(index - 1) % n][1], seconds=seconds
            )
            outcomes[index] = "holds"
        except Exception as exc:
            outcomes[index] = f"{type(exc).__name__}: {exc}"
        finally:
            to_successor.stop()

    threads = [threading.Thread(target=member, args=(index,)) for index in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    for link in links:
        for end in link:
            end.sock.close()
    return outcomes


@pytest.mark.parametrize("n", [2, 3, 16, 70])
def test_every_member_of_a_ring_learns_that_all_hold_the_result(n: int) -> None:
    """70: the set is a bitmap of bytes (an int over 64 bits cannot go through msgpack)."""
    assert run_ring(n) == dict.fromkeys(range(n), "holds")


def predecessor(
    behave: Callable[[lanes.Channel], None],
    seconds: float = 3.0,
    *,
    attempt: int = 0,
    failure_timeout: float = FAILURE_TIMEOUT,
) -> tuple[str, float]:
    """Member 2 of 4, in attempt `attempt`, whose predecessor (member 1) sends what `behave` sends;
    its outcome, and when."""
    to_successor, successor = channel_pair()
    theirs, ours = channel_pair()
    sender = threading.Thread(target=behave, args=(theirs,), daemon=True)
    sender.start()
    started = time.monotonic()
    ends = ToSuccessor(STEP, failure_timeout)
    ends.start(to_successor)
    try:
        await_every_holder(holding(2, 4, attempt=attempt), ends, from_predecessor=ours, seconds=seconds)
        outcome = "holds"
    except (FrameError, PeerClosed, PeerTimeout) as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    seconds = time.monotonic() - started
    ends.stop()
    for end in (to_successor, successor, theirs, ours):
        end.sock.close()  # a sender still at it ends with the connection
    sender.join(5)
    return outcome, seconds


def send(
    channel: lanes.Channel,
    holders: object,
    *,
    kind: str = DONE,
    step: int = STEP,
    signed: bytes | None = None,
) -> None:
    """A barrier frame with `holders`, carrying `signed` or else every named member's real signature."""
    if signed is None:
        signed = proofs(int.from_bytes(holders, "little")) if isinstance(holders, bytes) else b""
    header = {"kind": kind, "step": step, "holders": holders, "proofs": signed}
    lanes.send_frame(channel, header, payload=b"", timeout=1.0)


def test_a_predecessor_that_repeats_its_set_is_refused_at_once() -> None:
    """Each frame must grow the sender's set: repeating one kept its successor waiting for good."""

    def repeat(channel: lanes.Channel) -> None:
        with contextlib.suppress(PeerClosed, OSError):
            for _ in range(20):
                send(channel, bytes([0b0010]))
                time.sleep(0.05)

    outcome, seconds = predecessor(repeat)
    assert outcome.startswith("FrameError") and "bad set of holders" in outcome and seconds < 1.0


@pytest.mark.parametrize(
    ("holders", "needle"),
    [
        (bytes([0b0001]), "bad set"),  # without the sender's own bit
        (bytes([0b10010]), "bad set"),  # a member beyond the ring's 4
        (b"\x02\x00", "not 1 bytes"),
        (2, "not 1 bytes"),
        ("x", "not 1 bytes"),
    ],
)
def test_a_malformed_set_fails_the_barrier(holders: object, needle: str) -> None:
    outcome, _ = predecessor(lambda channel: send(channel, holders))
    assert outcome.startswith("FrameError") and needle in outcome, outcome


def test_a_frame_of_another_kind_or_step_fails_the_barrier() -> None:
    assert "expected a barrier frame" in predecessor(lambda c: send(c, bytes([2]), kind="ag"))[0]
    assert "expected a barrier frame" in predecessor(lambda c: send(c, bytes([2]), step=STEP + 1))[0]


def test_a_silent_predecessor_fails_the_barrier_at_twice_the_failure_timeout_and_a_gone_one_at_once() -> None:
    """A predecessor that froze or lost its link (no reset comes) was waited for the whole bound:
    failure_timeout for every frame of the data phase, hours for a large model."""
    outcome, seconds = predecessor(lambda channel: None, seconds=600.0, failure_timeout=0.5)
    assert outcome.startswith("PeerTimeout") and 0.9 < seconds < 10.0, (outcome, seconds)
    outcome, seconds = predecessor(lambda channel: channel.sock.close(), seconds=600.0)
    assert outcome.startswith("PeerClosed") and seconds < 5.0


def keep_alive(channel: lanes.Channel, every: float, until: float) -> None:
    """Keepalives from a predecessor still at work, every `every` seconds for `until` seconds."""
    ends = time.monotonic() + until
    with contextlib.suppress(PeerClosed, OSError):
        while time.monotonic() < ends:
            lanes.send_frame(channel, {"kind": ALIVE, "step": STEP}, payload=b"", timeout=1.0)
            time.sleep(every)


def test_a_predecessor_that_keeps_alive_is_waited_for_up_to_the_bound() -> None:
    """Keepalives stand for a predecessor still receiving (a slow link): its set, three failure
    timeouts late, is taken; one that never sends it (a stranger) holds the step for the bound."""
    failure_timeout = 1.0
    every = failure_timeout / BEATS_PER_TIMEOUT

    def late(channel: lanes.Channel) -> None:
        keep_alive(channel, every, 3 * failure_timeout)
        send(channel, bytes([0b1111]))

    assert predecessor(late, seconds=60.0, failure_timeout=failure_timeout)[0] == "holds"
    outcome, seconds = predecessor(
        lambda channel: keep_alive(channel, every, 60.0), seconds=4.0, failure_timeout=failure_timeout
    )
    assert outcome.startswith("PeerTimeout") and 3.9 < seconds < 20.0, (outcome, seconds)
    for header in ({"kind": ALIVE, "step": STEP + 1}, {"kind": ALIVE, "step": STEP, "pad": bytes(3000)}):
        outcome, _ = predecessor(functools.partial(lanes.send_frame, header=header, payload=b"", timeout=1.0))
        assert outcome.startswith("FrameError") and "expected a barrier frame" in outcome, outcome


def test_a_send_after_the_attempt_closed_the_lane_returns_false() -> None:
    """The keepalive thread or the barrier may send just as the attempt ends and closes the socket:
    an OSError (not a WireError) escaped the thread with a traceback."""
    to_successor, successor = channel_pair()
    ends = ToSuccessor(STEP, FAILURE_TIMEOUT)
    ends.start(to_successor)
    ends.stop()
    to_successor.sock.close()
    assert ends.send({"kind": DONE, "step": STEP, "holders": bytes([1]), "proofs": proofs(1)}) is False
    successor.sock.close()


def test_the_full_set_of_an_honest_predecessor_ends_the_barrier() -> None:
    """What the refusals below are measured against: real signatures of this attempt, and a junk
    one for the receiver's own bit (it knows that one, so it does not look)."""
    assert predecessor(lambda channel: send(channel, bytes([0b1111])))[0] == "holds"
    own_junk = proofs(0b1011)[:128] + bytes(64) + proofs(0b1000)
    assert predecessor(lambda channel: send(channel, bytes([0b1111]), signed=own_junk))[0] == "holds"


@pytest.mark.parametrize(
    ("signed", "attempt", "needle"),
    [
        (bytes(64) + proofs(0b1110), 0, "without its signature"),  # junk for member 0
        (proofs(0b0111) + proofs(0b0010), 0, "without its signature"),  # member 1's for member 3
        (proofs(0b1111, attempt=0), 1, "without its signature"),  # an earlier attempt's
        (proofs(0b1111, digest=bytes(32)), 0, "without its signature"),  # another step's or members'
        (proofs(0b0111), 0, "without the 4 signature"),  # one short
        (proofs(0b1111) + bytes(64), 0, "without the 4 signature"),
    ],
)
def test_a_set_naming_a_member_without_that_members_signature_is_refused(
    signed: bytes, attempt: int, needle: str
) -> None:
    """A member that forwards a full set it did not receive (its accomplice withholding the last
    chunk from someone) would have the members after it take the result while the deprived one
    retries without them: a set must carry each member's signature of this very attempt."""
    outcome, seconds = predecessor(lambda c: send(c, bytes([0b1111]), signed=signed), attempt=attempt)
    assert outcome.startswith("FrameError") and needle in outcome and seconds < 1.0, outcome


def test_keepalives_to_a_successor_that_does_not_read_yet_neither_block_nor_cut_a_frame() -> None:
    """A successor still in its data phase does not read the lane: keepalives once filled its
    buffers, a send timed out half written, the thread stopped for good and the set sent after it
    was lost or cut (small buffers here stand for a long wait with default ones). Now a keepalive
    waits while bytes of ours are unacknowledged: the set goes out whole after the backlog."""
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.socket()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    sender.connect(listener.getsockname())
    receiver, _ = listener.accept()
    listener.close()
    receiver.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    key = os.urandom(32)
    to_successor = ToSuccessor(STEP, failure_timeout=0.01)
    to_successor.start(lanes.Channel(sender, FrameSeal(key)))
    try:
        time.sleep(4.0)  # the successor's data phase: 1600 beats due, far more than the buffers hold
        assert to_successor.send({"kind": DONE, "step": STEP, "holders": bytes([1]), "proofs": proofs(1)})
        channel, kinds = lanes.Channel(receiver, FrameSeal(key)), list[str]()
        while not kinds or kinds[-1] != DONE:
            kinds.append(lanes.recv_frame(channel, 10.0, max_payload=0).header["kind"])
        assert set(kinds[:-1]) == {ALIVE} and len(kinds) > 10, kinds
    finally:
        to_successor.stop()
        sender.close()
        receiver.close()
