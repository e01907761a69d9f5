"""The completion barrier: a member takes an all-reduce's result only once it knows that every
member holds all of it.

Without it, a member that died in the last rounds of the all-gather left the members that already
had every frame with the result and the others with an error; those retried the step among the
survivors, and the step had two results (seen: a node stopped in the middle of the all-gather).

Once every frame of the all-reduce is in (and, with robust aggregation, checked), a member sends its
successor in the ring the set of members it knows to hold the whole result, itself first, on the
connection that carried its all-gather frames; it reads its predecessor's sets and passes the union
on whenever it grows. It takes the result once the set holds every member. Sets only grow, so each
member sends at most n frames of a few bytes, and the last member to finish is known everywhere n − 1
hops later.

Only what a member receives decides: its sends are best effort (a successor that already knows
everything may have closed the connection). A member whose barrier fails shuts its connections, so
its successor fails at once, and so on around the ring; a member that dies before it sent its own
set leaves every survivor with an error, all alike, and they retry together.

How long a member waits for its predecessor: while it hears from it, as long as the data phase may
still legitimately take, failure_timeout for each frame it receives, plus one for each hop of the
sets. A predecessor on a slow link may be a whole segment of frames behind (with a fixed wait of two
failure timeouts, a ring with one slow link failed every attempt, and members that had sent their
set and then timed out left others with the result). So that a predecessor that froze or lost its
link (no reset comes) is not waited for that long (hours for a large model), every member sends its
successor a keepalive every failure_timeout / 4, from its last data frame to it until its own
barrier ends; a member whose predecessor is silent for 2 × failure_timeout fails. A frame that
does not grow the sender's set is refused, so a member cannot hold its successor longer by
repeating itself.

Testimony: where members could hold different things (the sparse gather's shares: what each member
sent each other one), a member's first barrier frame carries, as its payload, what it holds (each
share's sha256 and its sender's signature of it), and its successor compares that with its own
before it takes any set: a member that signed two different shares is named (Proven), with its
two signatures as the proof each honest member who saw both can check, and so is a predecessor
whose testimony does not hold up (a signature it could not have been given).

Each member's bit is its signature of the attempt: the membership digest (which covers the step)
and the attempt number, the same on every member, as neighbours' handshakes agree on both. It is
sent once and passed on with the set, and a member checks every signature it did not have, so a set
that names a member proves that this member holds the result. Unsigned, two colluding members
could split the others: one withholding the all-gather's last chunk from its successor, the other
forwarding a full set it never received, so that the members after it took the result while the
deprived one failed and retried without them. Another attempt's or step's signature proves nothing
here: both are in what is signed.

What it cannot close: a member that dies (or goes silent for 2 × failure_timeout) while the sets
travel, after some members learned that all hold the result and before the others did. That window
is a few small frames long; before, it was the last round of the all-gather's data. A lying member
can open it on purpose: it passes on every signature but one (its successor is the only way that
one reaches it), so the members after its successor take the result and its successor fails. No
exchange along a ring can stop that. What decides then is what decides after a crash in the
window: a node that gave a step up replays it once a majority is past it (election.swarm_ahead),
and one whose params hash differs from the majority's goes back to their checkpoint. A member
that sends keepalives and withholds its sets holds the step for up to the bound.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from p2ptrain.comm.transport import lanes
from p2ptrain.comm.transport.wire import FrameError, WireError
from p2ptrain.identity import SIGNATURE_BYTES, NodeIdentity, short_id, verify

log = logging.getLogger(__name__)

DONE = "done"
"""The kind of a barrier frame: header {"kind", "step", "holders", "proofs"}, no payload.
"holders" is a bitmap (bit i of byte i // 8: member i), bytes so that it fits any number of
members; "proofs" the signatures of the members new in it since the sender's last frame, in
member order, 64 bytes each."""
DOMAIN = b"p2ptrain/barrier/v1\0"


class Proven(FrameError):
    """What arrived proves that one member broke the protocol (it signed two versions of what it
    sent, or sent a testimony nobody could have given it): `culprit` is its key."""

    def __init__(self, message: str, culprit: bytes):
        super().__init__(message)
        self.culprit = culprit


Testimony = Callable[[bytes], None]
"""Checks the predecessor's first barrier payload against what this member holds: raises
Proven, naming the member the testimony convicts, or its sender."""
ALIVE = "alive"
"""The kind of a keepalive frame: header {"kind", "step"}, no payload."""
BEATS_PER_TIMEOUT = 4
"""Keepalives a member sends per failure_timeout; its successor gives up after twice as many
missing (a descheduled process is late, not gone)."""


class ToSuccessor:
    """The lane to the ring successor once this member's data frames to it are out (`start`):
    keepalives every failure_timeout / BEATS_PER_TIMEOUT until `stop`, and the barrier's sets
    between them, one frame at a time. Sends are best effort: a successor that knows everything
    may have closed."""

    def __init__(self, step: int, failure_timeout: float):
        self.step = step
        self.failure_timeout = failure_timeout
        self.channel: lanes.Channel | None = None
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._broken = False

    def start(self, channel: lanes.Channel) -> None:
        """Begin the keepalives on `channel` (its data frames all sent); once, and not after `stop`."""
        with self._lock:
            if self.channel is not None or self._stopped.is_set():
                return
            self.channel = channel
        threading.Thread(target=self._beat, name=f"p2ptrain-ring-alive-{self.step}", daemon=True).start()

    def send(self, header: dict, beat: bool = False, payload: bytes = b"") -> bool:
        """One frame to the successor; False when it no longer takes them (it knows already, or it
        failed: either way our outcome is ours). A failed send may have cut a frame in two, so
        nothing more goes on the lane. A keepalive (`beat`) is skipped while bytes of ours are
        still unacknowledged (a successor still in its data phase does not read this lane yet): it
        never waits for room, so it can neither time out half sent nor pile up past one."""
        with self._lock:
            if self.channel is None or self._broken or (beat and self._stopped.is_set()):
                return False
            try:
                if beat and lanes.unacknowledged(self.channel.sock):
                    return True
                lanes.send_frame(self.channel, header, payload=payload, timeout=self.failure_timeout)
            except (WireError, OSError) as exc:  # OSError: the attempt closed the socket meanwhile
                self._broken = True
                log.debug("step %d: frame not sent to the ring successor: %s", self.step, exc)
                return False
        return True

    def stop(self) -> None:
        self._stopped.set()

    def release(self) -> bool:
        """Stop, and wait for a frame on its way out: True when the lane is whole (every frame on
        it went out whole, or none was sent), so that it can be kept for the next step."""
        self.stop()
        with self._lock:
            return not self._broken

    def _beat(self) -> None:
        while not self._stopped.wait(self.failure_timeout / BEATS_PER_TIMEOUT):
            if not self.send({"kind": ALIVE, "step": self.step}, beat=True):
                return


@dataclass(frozen=True, kw_only=True)
class Holding:
    """One member's part in the barrier of one attempt: the members' keys in ring order, what
    each signs once it holds the result, and this member's signature of it."""

    index: int
    step: int
    keys: Sequence[bytes]
    statement: bytes
    signature: bytes

    @classmethod
    def signed(
        cls,
        identity: NodeIdentity,
        step: int,
        *,
        keys: Sequence[bytes],
        digest: bytes,
        attempt: int,
        holds: bytes = b"",
    ) -> Holding:
        """`holds`: a digest of what this member holds where members could hold different things
        (the sparse gather's shares, gather.py), so that a member holding others fails the barrier."""
        statement = DOMAIN + digest + attempt.to_bytes(4, "big") + holds
        return cls(
            index=keys.index(identity.public_key),
            step=step,
            keys=tuple(keys),
            statement=statement,
            signature=identity.sign(statement),
        )

    @property
    def n(self) -> int:
        return len(self.keys)


def holders_in(header: dict, step: int, *, n: int, sender: int, before: int) -> tuple[int, dict[int, bytes]]:
    """The set a barrier frame from member `sender` carries, and the signatures it brings (member →
    signature); FrameError for anything else. A sender sends only once it holds the result (its own
    bit is in the set) and only when its set grew (a strict superset of `before`, the set it sent
    last): so at most n frames come, each with the signatures of the members new in it."""
    raw, proofs = header.get("holders"), header.get("proofs")
    if header.get("kind") != DONE or header.get("step") != step:
        raise FrameError(f"expected a barrier frame of step {step}, got {header.get('kind')!r}")
    if not isinstance(raw, bytes) or len(raw) != (n + 7) // 8:
        raise FrameError(f"barrier frame whose set of holders is not {(n + 7) // 8} bytes")
    holders = int.from_bytes(raw, "little")
    if holders >> n or not holders >> sender & 1 or holders & before != before or holders == before:
        raise FrameError(f"barrier frame with a bad set of holders: {holders:#x} after {before:#x}")
    new = [member for member in range(n) if (holders & ~before) >> member & 1]
    if not isinstance(proofs, bytes) or len(proofs) != SIGNATURE_BYTES * len(new):
        raise FrameError(f"barrier frame without the {len(new)} signature(s) of the members new in it")
    return holders, {
        member: proofs[k * SIGNATURE_BYTES : (k + 1) * SIGNATURE_BYTES] for k, member in enumerate(new)
    }


def await_every_holder(
    holding: Holding,
    to_successor: ToSuccessor,
    *,
    from_predecessor: lanes.Channel,
    seconds: float,
    testimony: bytes = b"",
    check_testimony: Testimony | None = None,
) -> None:
    """Block until this member knows that all members hold the result (`to_successor` is started:
    every data frame to it is out). WireError when that takes more than `seconds`, the predecessor
    is silent for 2 × failure_timeout, a frame of its is neither a keepalive nor a barrier frame
    (or does not grow its set, or names a member without that member's signature), or the
    connection ends first. `testimony` goes with this member's first frame, and the predecessor's
    first frame's to `check_testimony` (both empty where members hold the same bytes)."""
    n, index, step = holding.n, holding.index, holding.step
    everyone = (1 << n) - 1
    known = 1 << index
    deadline = time.monotonic() + seconds
    silence = 2 * to_successor.failure_timeout
    signatures = {index: holding.signature}
    sent = _tell(to_successor, n, holders=known, sent=0, signatures=signatures, testimony=testimony)
    predecessor, theirs = (index - 1) % n, 0
    while known != everyone:
        wait = min(silence, deadline - time.monotonic())
        testifies = check_testimony is not None and theirs == 0
        limit = len(testimony) if testifies else 0
        frame = lanes.recv_frame(from_predecessor, max(0.0, wait), max_payload=limit)
        if frame.header == {"kind": ALIVE, "step": step} and not frame.payload:  # no junk to chew on
            continue
        if frame.payload and not testifies:
            raise FrameError("a barrier frame with a payload it must not carry")
        if testifies and check_testimony is not None:
            check_testimony(bytes(frame.payload))
        theirs, proofs = holders_in(frame.header, step, n=n, sender=predecessor, before=theirs)
        for member, signature in proofs.items():
            if known >> member & 1:
                continue  # ours already, checked: what comes with it again changes nothing
            if not verify(holding.keys[member], signature, holding.statement):
                raise FrameError(
                    f"barrier frame naming member {member} ({short_id(holding.keys[member])}) as a "
                    "holder without its signature of this attempt: a forged set, or it holds other "
                    "shares than this member (a sender gave members different ones)"
                )
            signatures[member] = signature
            known |= 1 << member
        if known != sent:
            sent = _tell(to_successor, n, holders=known, sent=sent, signatures=signatures)


def _tell(
    to_successor: ToSuccessor,
    n: int,
    *,
    holders: int,
    sent: int,
    signatures: dict[int, bytes],
    testimony: bytes = b"",
) -> int:
    """Send `holders` with the signatures of the members not in `sent` (what went before), and
    `testimony` as the payload of the first frame; returns `holders`, the new `sent`."""
    proofs = b"".join(signatures[member] for member in range(n) if (holders & ~sent) >> member & 1)
    holders_bytes = holders.to_bytes((n + 7) // 8, "little")
    header = {"kind": DONE, "step": to_successor.step, "holders": holders_bytes, "proofs": proofs}
    to_successor.send(header, payload=testimony if sent == 0 else b"")
    return holders
