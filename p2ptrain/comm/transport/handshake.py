"""Mutual authentication of a data-plane connection between two members of one outer step.

    dialer   → hello   {node_key, step, attempt, digest, nonce, lane, ephemeral[, ticket]}
    listener → welcome {node_key, nonce, ephemeral, signature[, ticket]}     (or refuse {reason})
    dialer   → proof   {signature}
    listener → ok                      (or refuse {reason[, retry | attempt | views_differ]})

In a closed run each side also shows its admission ticket and checks the other's (`Credentials`:
the run's authority signed it for that very key, and it has not expired); the listener before it
signs anything. The listener checks the hello against the step's members before it signs anything
where it knows them; a hello for a step it has not reached yet waits for that step only once the
dialer has proven its key, so no one can hold a member's waiting slot, or be heard from in its
name, with a forged key.

Each signature is Ed25519 over a transcript that binds both nonces, both keys, the role, the step,
the attempt, the membership digest and both ephemeral X25519 keys: a recorded handshake cannot be
replayed, a member of another step or another membership cannot get in, the dialer knows it
reached the member it meant to reach, and the X25519 secret of the two ephemeral keys is shared
with that member only. Every frame after the handshake is sealed with keys derived from it
(seal.py). `lane` numbers the parallel connections between one pair of members (comm.connections):
below comm.connections they carry the dialer's frames, above it the listener's (a reversed
connection, dialed by a member behind NAT to one that can be reached: connect.py).

`attempt` numbers the tries of one step. A failed all-reduce is retried with the same members, hence
the same digest, and members give an attempt up at slightly different times: without the number a
re-dial could land in a peer's dying earlier attempt. Once the dialer has proven its key the listener
compares attempts: a dialer that is ahead is asked to `retry` (the listener drops its own, older
attempt and dials into the newer one), a dialer that is behind is told the listener's `attempt` and
starts its next try there.

The listener stops reading before it sends "ok", and the dialer sends nothing more until it has
read "ok": after the handshake no byte of the data phase waits in asyncio's buffers, so the ring can
take the raw socket (lanes.detach).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, replace

from p2ptrain.comm.transport.seal import EPHEMERAL_BYTES, Ephemeral, SessionKeys, derive_keys
from p2ptrain.comm.transport.wire import (
    Frame,
    FrameError,
    WireError,
    expect,
    read_frame,
    stream_transport,
    write_frame,
)
from p2ptrain.config import MAX_CONNECTIONS
from p2ptrain.identity import PUBLIC_KEY_BYTES, NodeIdentity, short_id, verify

log = logging.getLogger(__name__)

_DOMAIN = b"p2ptrain/ring-handshake/v6\0"
"""Bumped with every change of the data-phase protocol, so that nodes of two versions refuse each
other's handshakes instead of failing steps (v5: keepalives between data frames; v6: warm lanes,
resume.py)."""
NONCE_BYTES = 32
DIGEST_BYTES = 32
MAX_HANDSHAKE_FRAME = 1024


class HandshakeError(WireError):
    """The peer is not who it should be, or not a member of this step (reason in the message)."""


class ViewsDiffer(HandshakeError):
    """The peer elected other members for this step (another digest): both views are still
    converging, and a new election shortly after, not a blame, is the answer."""


class PeerBusy(HandshakeError):
    """The peer accepted our proof but is still in an earlier attempt of the step: dial again."""


class AttemptBehind(HandshakeError):
    """The peer is at a later attempt of the step than ours (`attempt`): this one is lost."""

    def __init__(self, message: str, attempt: int):
        super().__init__(message)
        self.attempt = attempt


MAX_ATTEMPT = (1 << 31) - 1


@dataclass(frozen=True, kw_only=True)
class Session:
    """What a successful handshake established."""

    step: int
    digest: bytes
    local_key: bytes
    peer_key: bytes
    lane: int = 0
    attempt: int = 0
    keys: SessionKeys | None = None
    """This end's keys for the frames that follow (seal.py)."""
    dialed: bool = False
    """This end dialed the connection."""


@dataclass(frozen=True)
class Credentials:
    """A closed run's admission in the handshake: this node's ticket, shown in its hello or welcome,
    and the check of the peer's (`check(peer key, ticket bytes)`: why it does not admit the peer to
    the run, or None). Open runs have none."""

    ticket: bytes
    check: Callable[[bytes, bytes], str | None]

    def verify_peer(self, peer: bytes, header: dict) -> None:
        ticket = header.get("ticket", b"")
        reason = self.check(peer, ticket) if isinstance(ticket, bytes) else "malformed ticket"
        if reason is not None:
            raise HandshakeError(f"{short_id(peer)} is not admitted to this closed run: {reason}")


@dataclass(frozen=True)
class Refusal:
    """Why a listener does not take an authenticated connection now (see the module docstring)."""

    reason: str
    retry: bool = False
    attempt: int | None = None
    """The listener's attempt, when the dialer's is older."""


def transcript_of(role: bytes, session: Session, *, dialer: bytes, listener: bytes, nonces: bytes) -> bytes:
    numbers = (
        session.step.to_bytes(8, "big") + session.lane.to_bytes(1, "big") + session.attempt.to_bytes(4, "big")
    )
    return b"".join([_DOMAIN, role, numbers, session.digest, dialer, listener, nonces])


def _int_field(header: dict, name: str, limit: int) -> int:
    value = header.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
        raise HandshakeError(f"malformed {name} {value!r}")
    return value


def _bytes_field(header: dict, name: str, size: int) -> bytes:
    value = header.get(name)
    if not isinstance(value, bytes) or len(value) != size:
        raise HandshakeError(f"malformed handshake field {name!r}")
    return value


def hello_header(
    identity: NodeIdentity,
    step: int,
    *,
    digest: bytes,
    nonce: bytes,
    ephemeral: bytes,
    lane: int = 0,
    attempt: int = 0,
    credentials: Credentials | None = None,
) -> dict:
    """The dialer's first frame (see the module docstring)."""
    ticket = {"ticket": credentials.ticket} if credentials is not None else {}
    return {
        **ticket,
        "kind": "hello",
        "node_key": identity.public_key,
        "step": step,
        "attempt": attempt,
        "digest": digest,
        "nonce": nonce,
        "lane": lane,
        "ephemeral": ephemeral,
    }


async def dial(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    identity: NodeIdentity,
    expected_peer: bytes,
    step: int,
    digest: bytes,
    timeout: float,
    lane: int = 0,
    attempt: int = 0,
    credentials: Credentials | None = None,
    answer_timeout: float | None = None,
) -> Session:
    """Authenticate an outgoing connection to `expected_peer` (in a closed run, with `credentials`).
    `answer_timeout` bounds the wait for the first answer (a live listener answers a hello at once,
    even for a step it has not reached: it welcomes first, the wait comes after the proof), the
    rest is bounded by `timeout`.

    Raises PeerBusy (dial again), AttemptBehind (start the next attempt at the peer's), other
    HandshakeErrors, or WireError.
    """
    nonce, ephemeral = secrets.token_bytes(NONCE_BYTES), Ephemeral()
    header = hello_header(
        identity,
        step,
        digest=digest,
        nonce=nonce,
        ephemeral=ephemeral.public,
        lane=lane,
        attempt=attempt,
        credentials=credentials,
    )
    await write_frame(writer, header, timeout=timeout)
    first = await read_frame(reader, min(timeout, answer_timeout or timeout), MAX_HANDSHAKE_FRAME)
    if first.kind == "refuse" and first.header.get("views_differ") is True:
        raise ViewsDiffer(f"peer refused: {str(first.header.get('reason', ''))[:200]}")
    try:
        welcome = expect(first, "welcome")
    except FrameError as exc:
        raise HandshakeError(str(exc)) from None
    peer_key = _bytes_field(welcome.header, "node_key", PUBLIC_KEY_BYTES)
    peer_nonce = _bytes_field(welcome.header, "nonce", NONCE_BYTES)
    peer_ephemeral = _bytes_field(welcome.header, "ephemeral", EPHEMERAL_BYTES)
    signature = _bytes_field(welcome.header, "signature", 64)
    if peer_key != expected_peer:
        raise HandshakeError(f"reached {short_id(peer_key)} instead of {short_id(expected_peer)}")
    if credentials is not None:
        credentials.verify_peer(peer_key, welcome.header)
    session = Session(
        step=step, digest=digest, local_key=identity.public_key, peer_key=peer_key, lane=lane, attempt=attempt
    )
    nonces = nonce + peer_nonce + ephemeral.public + peer_ephemeral
    if not verify(
        peer_key,
        signature,
        transcript_of(b"L", session, dialer=identity.public_key, listener=peer_key, nonces=nonces),
    ):
        raise HandshakeError(f"{short_id(peer_key)} failed to prove its key")
    proof = identity.sign(
        transcript_of(b"D", session, dialer=identity.public_key, listener=peer_key, nonces=nonces)
    )
    await write_frame(writer, {"kind": "proof", "signature": proof}, timeout=timeout)
    answer = await read_frame(reader, timeout, MAX_HANDSHAKE_FRAME)
    if answer.kind == "refuse":
        raise_refusal(answer.header, peer_key)
    try:
        expect(answer, "ok")
        secret = ephemeral.shared(peer_ephemeral)
    except FrameError as exc:
        raise HandshakeError(str(exc)) from None
    base = transcript_of(b"K", session, dialer=identity.public_key, listener=peer_key, nonces=nonces)
    return replace(session, keys=derive_keys(secret, base, dialer=True), dialed=True)


def raise_refusal(header: dict, peer_key: bytes) -> None:
    """Raise what a listener's refusal (`header`, kind "refuse") means for the dialer: ViewsDiffer,
    PeerBusy (dial again), AttemptBehind (start the next attempt at the peer's), or nothing (a plain
    no: the caller's check of the answer raises)."""
    reason = f"{short_id(peer_key)}: {header.get('reason', 'no reason given')}"
    if header.get("views_differ") is True:
        raise ViewsDiffer(f"peer refused: {reason[:200]}")
    if header.get("retry") is True:
        raise PeerBusy(reason)
    if "attempt" in header:
        raise AttemptBehind(reason, _int_field(header, "attempt", MAX_ATTEMPT + 1))


def refusal_fields(refusal: Refusal) -> dict:
    """The fields of a refusal frame that say why (see `raise_refusal`)."""
    answer: dict = {"reason": refusal.reason, "retry": refusal.retry}
    if refusal.attempt is not None:
        answer["attempt"] = refusal.attempt
    return answer


@dataclass(frozen=True)
class Admission:
    """Who may connect for one step: the allowed peer keys, the membership digest, the lanes."""

    allowed: Collection[bytes]
    digest: bytes
    lanes: int = 1


Resolver = Callable[[int, bytes], Awaitable["Admission | None"]]
"""Who may connect for (step, the key the dialer has proven); may wait for this node to reach the
step, and may raise HandshakeError with the reason."""
Peek = Callable[[int], "Admission | None"]
"""Who may connect for `step`, where that is known at once (None: resolve after the proof); may
raise HandshakeError for a hello refused before any signature (a step that is over, or far ahead)."""
Claim = Callable[[Session], "Refusal | None"]
"""Called once the dialer has proven its key: None takes the connection."""


async def accept(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    identity: NodeIdentity,
    members: Collection[bytes],
    step: int,
    digest: bytes,
    timeout: float,
) -> Session:
    """Authenticate an incoming connection for one known step (see `accept_any`)."""

    def peek(asked: int) -> Admission | None:
        return Admission(members, digest) if asked == step else None

    async def resolve(asked: int, _: bytes) -> Admission | None:
        return peek(asked)

    return await accept_any(reader, writer, identity=identity, resolve=resolve, timeout=timeout, peek=peek)


async def accept_any(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    *,
    identity: NodeIdentity,
    resolve: Resolver,
    timeout: float,
    claim: Claim | None = None,
    log_refusal: Callable[[str], None] | None = None,
    first: Frame | None = None,
    peek: Peek | None = None,
    credentials: Credentials | None = None,
) -> Session:
    """Authenticate an incoming connection; `resolve(step, key)` says who may connect for that
    step, and `claim` whether the authenticated connection is wanted now.

    `resolve` sees only keys the dialer has proven: a hello that would wait for this node to reach
    its step (or that another membership sent) is answered and proven first, so nobody waits, or
    counts as heard from, under another node's key. Where `peek` knows the step's members, a
    non-member is refused before anything is signed.

    A refusal is sent to the peer, logged (by `log_refusal`, which a server throttles), and raised
    as HandshakeError. `first`: the hello, where the caller has read it already. `credentials`:
    a closed run's, checked before anything is signed.
    """
    hello = expect(first or await read_frame(reader, timeout, MAX_HANDSHAKE_FRAME), "hello")
    try:
        peer_key = _bytes_field(hello.header, "node_key", PUBLIC_KEY_BYTES)
        peer_nonce = _bytes_field(hello.header, "nonce", NONCE_BYTES)
        peer_ephemeral = _bytes_field(hello.header, "ephemeral", EPHEMERAL_BYTES)
        step = _int_field(hello.header, "step", 1 << 63)
        lane = _int_field(hello.header, "lane", 2 * MAX_CONNECTIONS)  # reversed lanes above
        attempt = _int_field(hello.header, "attempt", MAX_ATTEMPT + 1)
        digest = _bytes_field(hello.header, "digest", DIGEST_BYTES)
        known = peek(step) if peek is not None else None
        if known is not None and known.digest == digest:
            check_member(known, identity, peer=peer_key, step=step, lane=lane, digest=None)
        if credentials is not None:
            credentials.verify_peer(peer_key, hello.header)
        session = Session(
            step=step,
            digest=digest,
            local_key=identity.public_key,
            peer_key=peer_key,
            lane=lane,
            attempt=attempt,
        )
        nonce, ephemeral = secrets.token_bytes(NONCE_BYTES), Ephemeral()
        nonces = peer_nonce + nonce + peer_ephemeral + ephemeral.public
        signature = identity.sign(
            transcript_of(b"L", session, dialer=peer_key, listener=identity.public_key, nonces=nonces)
        )
        welcome = {
            **({"ticket": credentials.ticket} if credentials is not None else {}),
            "kind": "welcome",
            "node_key": identity.public_key,
            "nonce": nonce,
            "ephemeral": ephemeral.public,
            "signature": signature,
        }
        await write_frame(writer, welcome, timeout=timeout)
        proof = expect(await read_frame(reader, timeout, MAX_HANDSHAKE_FRAME), "proof")
        transcript = transcript_of(
            b"D", session, dialer=peer_key, listener=identity.public_key, nonces=nonces
        )
        if not verify(peer_key, _bytes_field(proof.header, "signature", 64), transcript):
            raise HandshakeError(f"{short_id(peer_key)} failed to prove its key")
        admission = await resolve(step, peer_key)  # the key is proven now
        if admission is None:
            raise HandshakeError(f"step {step} is not a step this node is reducing")
        check_member(admission, identity, peer=peer_key, step=step, lane=lane, digest=digest)
        base = transcript_of(b"K", session, dialer=peer_key, listener=identity.public_key, nonces=nonces)
        session = replace(session, keys=derive_keys(ephemeral.shared(peer_ephemeral), base, dialer=False))
    except (HandshakeError, FrameError) as exc:
        (log_refusal or _log_refusal)(str(exc))
        await _refuse(writer, {"reason": str(exc), "views_differ": isinstance(exc, ViewsDiffer)})
        raise HandshakeError(str(exc)) from None
    refusal = claim(session) if claim is not None else None
    if refusal is not None:
        log.info("sent %s to another attempt: %s", short_id(peer_key), refusal.reason)
        await _refuse(writer, refusal_fields(refusal))
        raise HandshakeError(refusal.reason)
    stream_transport(writer).pause_reading()  # the rest of this connection is read from its raw socket
    await write_frame(writer, {"kind": "ok"}, timeout=timeout)
    return session


def check_member(
    admission: Admission, identity: NodeIdentity, *, peer: bytes, step: int, lane: int, digest: bytes | None
) -> None:
    """Raise HandshakeError unless `peer` may connect on `lane` (with `digest`, where given).

    The digest is checked first: a peer that elected other members is often not among ours, and
    that is a difference of views (elect again), not a failed attempt — counted as one, a node
    refused at once burned every retry of the step within a second."""
    if digest is not None and digest != admission.digest:
        raise ViewsDiffer("membership digest differs (the two nodes elected different members)")
    if peer not in admission.allowed or peer == identity.public_key:
        raise HandshakeError(f"{short_id(peer)} is not a member of step {step}")
    if lane >= admission.lanes:
        raise HandshakeError(f"lane {lane} of {admission.lanes} (the two nodes differ in comm.connections)")


def _log_refusal(reason: str) -> None:
    log.warning("refused data-plane connection: %s", reason)


async def _refuse(writer: asyncio.StreamWriter, fields: dict) -> None:
    """Tell the peer why, best effort, and close."""
    header = {"kind": "refuse", **fields, "reason": str(fields.get("reason", ""))[:200]}
    try:
        await write_frame(writer, header, timeout=1.0)
    except WireError:
        pass
    finally:
        writer.close()
