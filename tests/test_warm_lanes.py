"""Warm lanes (transport/resume.py, net/warm.py): each lane of a step that succeeded is kept and
re-bound to the next step in one round trip. Real member processes on 127.0.0.1, and the rebind
exchange itself over a real socket pair."""

from __future__ import annotations

import functools
import secrets
import socket
import threading
from pathlib import Path

import numpy as np
import pytest

from p2ptrain.comm.transport import resume
from p2ptrain.comm.transport.handshake import PeerBusy, Session
from p2ptrain.comm.transport.resume import Rebind, WarmLane
from p2ptrain.comm.transport.seal import FrameSeal, derive_keys
from p2ptrain.comm.transport.wire import FrameError, PeerTimeout
from p2ptrain.config import CommConfig, Topology
from tests.support.ring_procs import Outcome, run_ring

STEPS = 3


def same_results(results: dict[int, np.ndarray]) -> bool:
    first = results[0].view(np.uint32)
    return all(np.array_equal(first, other.view(np.uint32)) for other in results.values())


def each_step_once(outcomes: dict[int, Outcome]) -> bool:
    """Every member did every step, each in its first attempt."""
    return all(outcome.ok and outcome.attempts == STEPS for outcome in outcomes.values())


@pytest.mark.procs
@pytest.mark.parametrize(
    ("n", "topology", "connections", "per_step"),
    [(3, "ring", 1, 2), (5, "butterfly", 2, 16)],  # lanes per member and step, both ends counted
)
def test_every_lane_of_a_step_is_re_bound_for_the_next(
    tmp_path: Path, n: int, topology: Topology, connections: int, per_step: int
) -> None:
    rebound = {}
    for warm in (True, False):
        comm = CommConfig(chunk_bytes=1 << 16, topology=topology, connections=connections, warm_lanes=warm)
        outcomes, results, _ = run_ring(tmp_path / str(warm), n, 100_003, comm=comm, steps=STEPS)
        assert each_step_once(outcomes) and len(results) == n and same_results(results), outcomes
        rebound[warm] = sorted(outcome.rebound for outcome in outcomes.values())
    assert rebound[True] == [per_step * (STEPS - 1)] * n, rebound
    assert rebound[False] == [0] * n, rebound


@pytest.mark.procs
@pytest.mark.parametrize("fault", ["drop_kept", "junk_on_kept"])
def test_a_kept_lane_that_is_gone_or_fed_junk_is_dialed_afresh(tmp_path: Path, fault: str) -> None:
    """A member that closed its kept lanes (restarted its server, say), or that sends bytes that
    are no frame on them: its peers drop those lanes alone (one line each) and dial afresh; no step
    fails, and every member holds the same result."""
    n = 4
    comm = CommConfig(chunk_bytes=1 << 16, topology="butterfly")
    outcomes, results, _ = run_ring(tmp_path, n, 100_003, comm=comm, steps=STEPS, faults={1: (fault, 0)})
    assert each_step_once(outcomes) and len(results) == n and same_results(results), outcomes
    most = 2 * (n - 1) * 2 * (STEPS - 1)
    assert outcomes[1].rebound < most, outcomes  # its lanes were not re-bound
    assert all(outcomes[i].rebound > 0 for i in (0, 2, 3)), outcomes  # the others' still were


# ---- the exchange itself, on a socket pair ------------------------------------------------------


def kept_pair(step: int = 4, lane: int = 0) -> tuple[WarmLane, WarmLane]:
    """The two ends of a lane kept after `step`, as two handshaken ends would hold them."""
    dialer_sock, listener_sock = socket.socketpair()
    secret, transcript = secrets.token_bytes(32), secrets.token_bytes(64)
    keys = {end: derive_keys(secret, transcript, dialer=end) for end in (True, False)}
    a, b = b"a" * 32, b"b" * 32

    def end(sock: socket.socket, dialed: bool) -> WarmLane:
        me, peer = (a, b) if dialed else (b, a)
        session = Session(
            step=step,
            digest=b"d" * 32,
            local_key=me,
            peer_key=peer,
            lane=lane,
            keys=keys[dialed],
            dialed=dialed,
        )
        sealed = keys[dialed]
        return WarmLane(
            sock=sock,
            session=session,
            sending=FrameSeal(sealed.sending),
            receiving=FrameSeal(sealed.receiving),
            trailing=frozenset({"alive"}),
        )

    return end(dialer_sock, True), end(listener_sock, False)


def answered(listener: WarmLane, answer: object) -> threading.Thread:
    """The listener's side on a thread: read the rebind, then `answer(lane, asked)`."""

    def run() -> None:
        header = None
        while header is None:
            header = listener.receive(5.0)
        answer(listener, resume.parse_request(listener, header))  # type: ignore[operator]

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_a_rebind_gives_both_ends_the_same_fresh_keys_and_drops_trailing_frames() -> None:
    dialer, listener = kept_pair()
    for _ in range(3):  # the last step's keepalives, still on the way
        dialer.send({"kind": "alive", "step": 4}, 1.0)
    result: dict[str, WarmLane] = {}
    thread = answered(
        listener, lambda lane, asked: result.setdefault("listener", resume.accept(lane, asked, 5.0))
    )
    rebound = resume.request(
        dialer, step=5, attempt=2, digest=b"e" * 32, answer_timeout=5.0, setup_timeout=5.0
    )
    thread.join(5)
    other = result["listener"]
    assert rebound.session.step == other.session.step == 5 and rebound.session.attempt == 2
    assert rebound.session.keys is not None and other.session.keys is not None
    assert rebound.session.keys.sending == other.session.keys.receiving
    assert rebound.session.keys.resume == other.session.keys.resume
    old = dialer.session.keys
    assert old is not None and rebound.session.keys.sending not in (old.sending, old.receiving)
    rebound.send({"kind": "rs", "step": 5}, 1.0)  # the new keys carry the next step's frames
    assert other.receive(1.0) == {"kind": "rs", "step": 5}
    for lane in (dialer, listener):
        lane.close()


def test_a_refusal_means_what_a_fresh_handshake_s_would() -> None:
    dialer, listener = kept_pair()
    busy = {"kind": resume.REFUSE, "reason": "still in attempt 0", "retry": True}
    thread = answered(listener, lambda lane, _: lane.send(busy, 1.0))
    with pytest.raises(PeerBusy):
        resume.request(dialer, step=5, attempt=1, digest=b"e" * 32, answer_timeout=5.0, setup_timeout=5.0)
    thread.join(5)
    for lane in (dialer, listener):
        lane.close()


def test_a_listener_that_only_ever_says_held_does_not_hold_the_dialer_past_the_setup_timeout() -> None:
    dialer, listener = kept_pair()

    stop = threading.Event()

    def hold(lane: WarmLane, _: Rebind) -> None:
        while not stop.wait(0.1):  # a "held" every 0.1 s until the test ends
            lane.send({"kind": resume.HELD}, 1.0)

    thread = answered(listener, hold)
    with pytest.raises(PeerTimeout):
        resume.request(dialer, step=5, attempt=0, digest=b"e" * 32, answer_timeout=1.0, setup_timeout=0.5)
    assert thread.is_alive()  # the frames kept coming: the deadline, not their end, stopped the wait
    stop.set()
    thread.join(5)
    for lane in (dialer, listener):
        lane.close()


@pytest.mark.parametrize(
    "fields",
    [
        {"step": 4},  # the step the lane carried: a replay of its own past
        {"lane": 1},  # another lane's
        {"digest": b"short"},
        {"attempt": -1},
        {"kind": "hello"},
    ],
)
def test_a_malformed_or_stale_rebind_is_refused(fields: dict) -> None:
    dialer, listener = kept_pair()
    header = {"kind": "rebind", "step": 5, "attempt": 0, "digest": b"e" * 32, "nonce": b"n" * 32, "lane": 0}
    dialer.send(header | fields, 1.0)
    received = listener.receive(1.0)
    assert received is not None
    with pytest.raises(FrameError):
        resume.parse_request(listener, received)
    for lane in (dialer, listener):
        lane.close()


def test_a_flipped_bit_or_a_flood_of_trailing_frames_ends_the_lane() -> None:
    dialer, listener = kept_pair()
    dialer.send({"kind": "rebind", "step": 5}, 1.0)
    raw = bytearray(listener.sock.recv(4096))
    raw[-1] ^= 1  # in the tag
    evil, victim = socket.socketpair()
    evil.sendall(bytes(raw))
    tampered = WarmLane(
        sock=victim, session=listener.session, sending=listener.sending, receiving=listener.receiving
    )
    with pytest.raises(FrameError, match="authentication"):
        tampered.receive(1.0)
    flood_dialer, flood_listener = kept_pair()
    for _ in range(resume.TRAILING_FRAMES + 1):
        flood_dialer.send({"kind": "alive", "step": 4}, 1.0)
    read = functools.partial(flood_listener.receive, 1.0)
    with pytest.raises(FrameError, match="more than"):
        while read() is None:
            pass
    for sock in (evil, victim):
        sock.close()
    for lane in (dialer, listener, flood_dialer, flood_listener):
        lane.close()
