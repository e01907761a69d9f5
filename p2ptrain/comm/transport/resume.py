"""Warm lanes: a data-plane connection kept after a step that succeeded, re-bound to the next step.

A fresh connection costs three round trips before its first frame (TCP's handshake, hello →
welcome, proof → ok: handshake.py), and then starts in TCP's slow start: over a 260 ms path at
50 Mbit/s and 0.5 % loss, 6 MB took 3.7–4.5 s on a fresh connection and 1.4–1.5 s on one that
had carried the same bytes a step before (docs/results/2026-12-internet.md). So both ends keep
each lane of a step whose all-reduce succeeded (`WarmLane`), and the next step that needs the same
lane — same peer, same handshake lane, same end dialing — re-binds it in one round trip:

    dialer   → rebind {step, attempt, digest, lane, nonce}
    listener → held                                 (only while it waits to reach the step)
    listener → ok {nonce}      or      refuse {reason[, retry | attempt | views_differ]}

The three are sealed with the keys of the lane's last step, whose frame counters go on: only the
two ends of the handshake that set the lane up can make them, and none can be replayed or moved
to another lane. The new step's keys come from the lane's resumption secret
(seal.SessionKeys.resume) and a transcript of both nonces, the step, attempt, lane and membership
digest, so every lane, attempt and step still has keys of its own. The listener decides as it does
for a hello whose dialer has proven its key (net/server.py).

Frames of the last step may still be on their way when a lane is kept (the ring successor's lane
carries keepalives and barrier sets until the sender's barrier ends): up to TRAILING_FRAMES of the
kinds the lane was kept with are read and dropped; any other frame ends the lane. So does a
refusal: the dialer then dials afresh, and every path of the fresh handshake is still there.
"""

from __future__ import annotations

import secrets
import socket
import time
from dataclasses import dataclass, field, replace

from p2ptrain.comm.transport import lanes
from p2ptrain.comm.transport.handshake import (
    DIGEST_BYTES,
    MAX_ATTEMPT,
    NONCE_BYTES,
    HandshakeError,
    Session,
    raise_refusal,
    transcript_of,
)
from p2ptrain.comm.transport.seal import FrameSeal, derive_keys
from p2ptrain.comm.transport.wire import FrameError, PeerTimeout
from p2ptrain.config import MAX_CONNECTIONS
from p2ptrain.identity import short_id

REBIND, HELD, OK, REFUSE = "rebind", "held", "ok", "refuse"
TRAILING_FRAMES = 16
"""Frames of the last step a kept lane may still bring before its next rebind (a few are
keepalives and barrier sets; a peer that sends more is not following the protocol)."""
MAX_FRAME = 512
"""The largest payload a rebind exchange reads (its frames have none)."""


@dataclass(eq=False, kw_only=True)
class WarmLane:
    """A lane kept after its step: its blocking socket, the session it last carried (peer, lane,
    step, keys) and both directions' seals, whose frame counters go on."""

    sock: socket.socket
    session: Session
    sending: FrameSeal
    receiving: FrameSeal
    trailing: frozenset[str] = field(default_factory=frozenset)
    """Kinds of the last step's frames that may still arrive after it (dropped)."""
    dropped: int = 0
    """Trailing frames dropped so far."""

    @property
    def key(self) -> tuple[bytes, int, bool]:
        """(peer key, handshake lane, dialed): the lane a later step may re-bind."""
        return self.session.peer_key, self.session.lane, self.session.dialed

    def send(self, header: dict, timeout: float) -> None:
        lanes.send_frame(lanes.Channel(self.sock, self.sending), header, payload=b"", timeout=timeout)

    def receive(self, timeout: float) -> dict | None:
        """The next frame's header; None for a trailing frame of the last step (dropped). Raises
        FrameError for any other frame, or for more trailing frames than TRAILING_FRAMES."""
        frame = lanes.recv_frame(lanes.Channel(self.sock, self.receiving), timeout, max_payload=MAX_FRAME)
        header = frame.header
        if header.get("kind") in self.trailing and header.get("step") == self.session.step:
            self.dropped += 1
            if self.dropped > TRAILING_FRAMES:
                raise FrameError(f"more than {TRAILING_FRAMES} frames of step {self.session.step} after it")
            return None
        if len(frame.payload):
            raise FrameError(f"a {header.get('kind')!r} frame with a payload on a kept lane")
        return header

    def close(self) -> None:
        lanes.shut(self.sock)
        self.sock.close()


@dataclass(frozen=True, kw_only=True)
class Rebind:
    """What a dialer asks of a kept lane."""

    step: int
    attempt: int
    digest: bytes
    nonce: bytes


def _rebound(lane: WarmLane, asked: Rebind, *, nonce: bytes) -> WarmLane:
    """The lane for the step `asked`: its session, with the keys both ends derive from the lane's
    resumption secret (`nonce`: the listener's), and fresh seals of those keys."""
    old = lane.session
    assert old.keys is not None
    session = replace(old, step=asked.step, attempt=asked.attempt, digest=asked.digest, keys=None)
    me, peer = old.local_key, old.peer_key
    dialer, listener = (me, peer) if old.dialed else (peer, me)
    base = transcript_of(b"R", session, dialer=dialer, listener=listener, nonces=asked.nonce + nonce)
    keys = derive_keys(old.keys.resume, base, dialer=old.dialed)
    return replace(
        lane,
        session=replace(session, keys=keys),
        sending=FrameSeal(keys.sending),
        receiving=FrameSeal(keys.receiving),
        dropped=0,
    )


def request(
    lane: WarmLane, *, step: int, attempt: int, digest: bytes, answer_timeout: float, setup_timeout: float
) -> WarmLane:
    """Dialer: re-bind `lane` to `attempt` of `step` (blocking). A live listener answers within
    `answer_timeout` (held, if it has not reached the step yet), and then within `setup_timeout`.

    Raises PeerBusy, AttemptBehind or ViewsDiffer as a fresh handshake would, HandshakeError for a
    plain no, or WireError (the lane is gone): in each case the lane is spent. Returns the lane as
    the new step's (its session and seals)."""
    asked = Rebind(step=step, attempt=attempt, digest=digest, nonce=secrets.token_bytes(NONCE_BYTES))
    number = lane.session.lane
    header = {
        "kind": REBIND,
        "step": step,
        "attempt": attempt,
        "digest": digest,
        "nonce": asked.nonce,
        "lane": number,
    }
    lane.send(header, answer_timeout)
    held_until = None  # once held: one deadline, which more "held" frames do not move
    while True:
        timeout = answer_timeout if held_until is None else held_until - time.monotonic()
        if timeout <= 0:
            raise PeerTimeout(f"held for {setup_timeout:.0f} s without an answer")
        answer = lane.receive(timeout)
        if answer is None:
            continue
        if answer.get("kind") == HELD:
            held_until = held_until or time.monotonic() + setup_timeout
            continue
        break
    peer = lane.session.peer_key
    if answer.get("kind") == REFUSE:
        raise_refusal(answer, peer)
        raise HandshakeError(f"{short_id(peer)}: {str(answer.get('reason', 'no reason given'))[:200]}")
    nonce = answer.get("nonce")
    if answer.get("kind") != OK or not isinstance(nonce, bytes) or len(nonce) != NONCE_BYTES:
        raise FrameError(f"expected the answer to a rebind, got {answer.get('kind')!r}")
    return _rebound(lane, asked, nonce=nonce)


def parse_request(lane: WarmLane, header: dict) -> Rebind:
    """Listener: the rebind `header` (already read from `lane`), checked; FrameError if malformed
    or for another lane, or for a step before the lane's last."""
    step, attempt = header.get("step"), header.get("attempt")
    digest, nonce, number = header.get("digest"), header.get("nonce"), header.get("lane")
    if header.get("kind") != REBIND:
        raise FrameError(f"expected a rebind on a kept lane, got {header.get('kind')!r}")
    if not all(_count(value, limit) for value, limit in ((step, 1 << 63), (attempt, MAX_ATTEMPT + 1))):
        raise FrameError("a rebind with a malformed step or attempt")
    if not _count(number, 2 * MAX_CONNECTIONS) or number != lane.session.lane:
        raise FrameError(f"a rebind for lane {number!r} on lane {lane.session.lane}")
    if not (isinstance(digest, bytes) and len(digest) == DIGEST_BYTES):
        raise FrameError("a rebind with a malformed digest")
    if not (isinstance(nonce, bytes) and len(nonce) == NONCE_BYTES):
        raise FrameError("a rebind with a malformed nonce")
    assert isinstance(step, int) and isinstance(attempt, int)
    if step <= lane.session.step:
        raise FrameError(f"a rebind for step {step} on a lane that carried step {lane.session.step}")
    return Rebind(step=step, attempt=attempt, digest=digest, nonce=nonce)


def accept(lane: WarmLane, asked: Rebind, timeout: float) -> WarmLane:
    """Listener: take the rebind (blocking): answer ok; returns the lane as the new step's."""
    nonce = secrets.token_bytes(NONCE_BYTES)
    lane.send({"kind": OK, "nonce": nonce}, timeout)
    return _rebound(lane, asked, nonce=nonce)


def _count(value: object, limit: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < limit
