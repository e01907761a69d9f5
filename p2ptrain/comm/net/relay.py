"""Relays: an edge between two members behind NAT, spliced by a reachable member.

Neither end of such an edge can be dialed, so both dial the edge's relay — a reachable member of
the same step, the same one for both (`relay_for`, a pure function of the members; where no member
can be reached, a standby relay the election lists) — and present a signed request for that step,
attempt, pair and lane:

    end   → relay   {kind: "relay", step, attempt, digest, sender, receiver, lane, role, relay, signature}
    relay → end     {kind: "relay-ok"}        once the other end's matching request is there
                    {kind: "refuse", reason, views_differ[, absent][, attempt]}   otherwise

A refusal names the other end (`absent`) only when it never asked in time, and says `views_differ`
when it asked under another attempt or membership (the two elected differently: no one's fault),
with the other's `attempt` where only the attempts differ: the end behind takes that number next,
as after a handshake's refusal, so two ends whose only link is relayed still converge.

`role` is "send" for the end whose frames the edge carries (it dials the end-to-end handshake
through the relay, as it would dial the receiver) and "accept" for the other (its data-plane server
answers that handshake as if the connection had come in directly). After "relay-ok" the relay
copies bytes both ways and nothing else: the handshake is end to end, so the relay sees only sealed
frames and can neither read nor change them unnoticed (seal.py).

The relay (relay_service.py) serves only what its own step admits: both ends must be members
behind NAT of a membership it registered itself (same digest), the relay must be the one
`relay_for` names, and the request must carry the requester's own signature. Requests waiting for
their partner, and splices, are bounded in number and time; the bytes it copies are capped
(`node.relay_mbps`) and counted. This module is what both ends share: the request, the choice of
relay, and an end's side of the exchange.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from p2ptrain.comm.net.members import Member
from p2ptrain.comm.transport.wire import WireError, expect, read_frame, write_frame
from p2ptrain.deadline import within
from p2ptrain.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, NodeIdentity, short_id, verify

log = logging.getLogger(__name__)

_DOMAIN = b"p2ptrain/relay/v1\0"
RELAY_KINDS = frozenset({"relay"})
"""First frame of a data-plane connection that asks this node to relay."""

Role = Literal["send", "accept"]
Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def relay_for(
    step: int,
    members: Sequence[Member],
    *,
    sender: bytes,
    receiver: bytes,
    standby: Sequence[Member] = (),
) -> Member | None:
    """The node that relays `sender` → `receiver` at `step`: the reachable member with the smallest
    hash of (step, pair, member), so every member computes the same one and edges spread over the
    reachable members; where no member can be reached, the standby relay (`p2ptrain bootstrap
    --relay`, listed in the election and so in its digest) chosen the same way. None when neither
    exists."""
    reachable = [member for member in members if member.reachable and member.key not in (sender, receiver)]
    candidates = reachable or [relay for relay in standby if relay.key not in (sender, receiver)]
    if not candidates:
        return None

    def rank(member: Member) -> bytes:
        return hashlib.sha256(_DOMAIN + step.to_bytes(8, "big") + sender + receiver + member.key).digest()

    return min(candidates, key=rank)


def needs_relay(sender: Member, receiver: Member) -> bool:
    """Neither end of the edge can be dialed (connect.sender_dials covers every other case)."""
    return not sender.reachable and not receiver.reachable


@dataclass(frozen=True, kw_only=True)
class RelayRequest:
    step: int
    attempt: int
    digest: bytes
    sender: bytes
    receiver: bytes
    lane: int
    role: Role
    relay: bytes

    @property
    def signer(self) -> bytes:
        return self.sender if self.role == "send" else self.receiver

    @property
    def partner(self) -> bytes:
        """The other end of the edge."""
        return self.receiver if self.role == "send" else self.sender

    @property
    def edge(self) -> tuple[int, int, bytes, bytes, bytes, int]:
        """What both ends' requests share (the pair's key at the relay)."""
        return (self.step, self.attempt, self.digest, self.sender, self.receiver, self.lane)

    def message(self) -> bytes:
        numbers = (
            self.step.to_bytes(8, "big") + self.attempt.to_bytes(4, "big") + self.lane.to_bytes(1, "big")
        )
        role = b"S" if self.role == "send" else b"A"
        return b"".join([_DOMAIN, role, numbers, self.digest, self.sender, self.receiver, self.relay])

    def header(self, identity: NodeIdentity) -> dict:
        assert identity.public_key == self.signer, "a request is signed by the end that sends it"
        return {
            "kind": "relay",
            "step": self.step,
            "attempt": self.attempt,
            "digest": self.digest,
            "sender": self.sender,
            "receiver": self.receiver,
            "lane": self.lane,
            "role": self.role,
            "relay": self.relay,
            "signature": identity.sign(self.message()),
        }

    @classmethod
    def parse(cls, header: dict) -> RelayRequest:
        """The request in a frame's header, its signature checked; WireError with the reason if not."""

        def number(name: str, limit: int) -> int:
            value = header.get(name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value < limit:
                raise WireError(f"malformed relay request field {name!r}")
            return value

        def raw(name: str, size: int) -> bytes:
            value = header.get(name)
            if not isinstance(value, bytes) or len(value) != size:
                raise WireError(f"malformed relay request field {name!r}")
            return value

        role = header.get("role")
        if role not in ("send", "accept"):
            raise WireError("malformed relay request field 'role'")
        request = cls(
            step=number("step", 1 << 63),
            attempt=number("attempt", 1 << 31),
            digest=raw("digest", 32),
            sender=raw("sender", PUBLIC_KEY_BYTES),
            receiver=raw("receiver", PUBLIC_KEY_BYTES),
            lane=number("lane", 256),
            role=role,
            relay=raw("relay", PUBLIC_KEY_BYTES),
        )
        if not verify(request.signer, raw("signature", SIGNATURE_BYTES), request.message()):
            raise WireError(f"relay request not signed by {short_id(request.signer)}")
        return request


Route = tuple[Member, RelayRequest]
"""The relay of an edge and the request one end presents to it."""


def route(
    step: int,
    attempt: int,
    *,
    digest: bytes,
    members: Sequence[Member],
    sender: bytes,
    receiver: bytes,
    lane: int,
    role: Role,
    standby: Sequence[Member] = (),
) -> Route:
    """How one end reaches the other end of a relayed edge; WireError when nobody can relay."""
    relay = relay_for(step, members, sender=sender, receiver=receiver, standby=standby)
    if relay is None:
        raise WireError(
            f"step {step}: every member is behind NAT, none can relay (a bootstrap peer with --relay can)"
        )
    return relay, RelayRequest(
        step=step,
        attempt=attempt,
        digest=digest,
        sender=sender,
        receiver=receiver,
        lane=lane,
        role=role,
        relay=relay.key,
    )


class RelayRefused(WireError):
    """The relay would not (or could not) pair this end: `absent`, the other end where it never
    came; `views_differ`, where it came under another attempt or membership (`attempt`: the
    other's, where only the attempts differ)."""

    def __init__(
        self,
        message: str,
        absent: bytes | None = None,
        *,
        views_differ: bool = False,
        attempt: int | None = None,
    ):
        super().__init__(message)
        self.absent = absent
        self.views_differ = views_differ
        self.attempt = attempt


async def open_relayed(
    identity: NodeIdentity, relay: Member, *, request: RelayRequest, timeout: float
) -> Stream:
    """Our end of a relayed edge: dial the relay, ask, and return the stream once it has paired us
    (the end-to-end handshake comes next). RelayRefused with the relay's reason when it refuses;
    other WireErrors when the relay cannot be reached or does not answer."""
    try:
        reader, writer = await within(asyncio.open_connection(relay.host, relay.port), timeout)
    except (OSError, asyncio.TimeoutError) as exc:
        raise WireError(
            f"cannot connect to relay {short_id(relay.key)} at {relay.host}:{relay.port}: {exc}"
        ) from None
    try:
        await write_frame(writer, request.header(identity), timeout=timeout)
        answer = await read_frame(reader, timeout + 5.0, 0)
        if answer.kind == "refuse":
            reason = str(answer.header.get("reason", "no reason given"))[:200]
            absent = request.partner if answer.header.get("absent") == request.partner else None
            differ = answer.header.get("views_differ") is True
            attempt = answer.header.get("attempt")
            if not (isinstance(attempt, int) and not isinstance(attempt, bool) and 0 <= attempt < 1 << 31):
                attempt = None
            raise RelayRefused(
                f"relay {short_id(relay.key)} refused: {reason}", absent, views_differ=differ, attempt=attempt
            )
        expect(answer, "relay-ok")
    except BaseException:
        writer.close()
        raise
    return reader, writer
