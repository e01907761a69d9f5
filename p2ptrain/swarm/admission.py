"""Admission tickets for closed runs: the run's authority signs (node key, expiry) for each node.

A run with `run.authority` set (an Ed25519 public key) takes only heartbeats that carry a ticket
signed by that key. The DHT key of such a run's heartbeats names the authority
(records.heartbeat_key), so every DHT node, a bootstrap peer that knows nothing of the run included,
checks that a record stored there holds a ticket from that very authority: a stranger who signs a
ticket with an authority of their own can only write under another key, which nobody of the run
reads. The authority's private key never leaves its owner's machine; a ticket is public.
"""

from __future__ import annotations

import base64
import binascii
import struct
import time
from dataclasses import dataclass, replace

import msgpack

from p2ptrain.comm.transport.handshake import Credentials
from p2ptrain.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, NodeIdentity, short_id, verify
from p2ptrain.untrusted import UndecodableError, unpack_untrusted

TICKET_VERSION = 1
MAX_TICKET_BYTES = 256
TICKET_PREFIX = "p2pt1-"
"""Starts the text form, so a ticket pasted in the wrong place is recognisable."""
_DOMAIN = b"p2ptrain/admission-ticket/v1\0"


class TicketError(ValueError):
    """A ticket that does not parse, verify or apply; the message says which."""


@dataclass(frozen=True, kw_only=True)
class Ticket:
    """The authority's word that `node_key` may take part in its run until `expires` (Unix time)."""

    authority: bytes
    node_key: bytes
    expires: float
    signature: bytes = b""

    def message(self) -> bytes:
        return _DOMAIN + self.authority + self.node_key + struct.pack(">d", self.expires)

    def to_bytes(self) -> bytes:
        return msgpack.packb(
            [TICKET_VERSION, self.authority, self.node_key, self.expires, self.signature], use_bin_type=True
        )

    def to_text(self) -> str:
        return TICKET_PREFIX + base64.urlsafe_b64encode(self.to_bytes()).decode().rstrip("=")


def issue_ticket(authority: NodeIdentity, node_key: bytes, expires: float) -> Ticket:
    unsigned = Ticket(authority=authority.public_key, node_key=node_key, expires=float(expires))
    return replace(unsigned, signature=authority.sign(unsigned.message()))


def decode_ticket(data: bytes) -> Ticket:
    """Parse `data` and verify the authority's signature (not whom or until when it admits)."""
    ticket = read_ticket(data)
    if not verify(ticket.authority, ticket.signature, ticket.message()):
        raise TicketError(f"ticket not signed by the authority it names ({short_id(ticket.authority)})")
    return ticket


def read_ticket(data: bytes) -> Ticket:
    """Parse `data` without verifying the signature: for a ticket decode_ticket verified already."""
    if len(data) > MAX_TICKET_BYTES:
        raise TicketError(f"ticket of {len(data)} bytes exceeds {MAX_TICKET_BYTES}")
    try:
        fields = unpack_untrusted(data, MAX_TICKET_BYTES, max_items=5)
    except UndecodableError as exc:
        raise TicketError(f"ticket is {exc}") from None
    if not (isinstance(fields, list) and len(fields) == 5 and fields[0] == TICKET_VERSION):
        raise TicketError("not a version-1 ticket")
    _, authority, node_key, expires, signature = fields
    sizes = ((authority, PUBLIC_KEY_BYTES), (node_key, PUBLIC_KEY_BYTES), (signature, SIGNATURE_BYTES))
    for value, size in sizes:
        if not isinstance(value, bytes) or len(value) != size:
            raise TicketError("ticket with a malformed key or signature")
    if not isinstance(expires, float) or expires != expires:
        raise TicketError("ticket with a malformed expiry")
    return Ticket(authority=authority, node_key=node_key, expires=expires, signature=signature)


def parse_ticket_text(text: str) -> Ticket:
    """The ticket `p2ptrain admit` printed, verified. A person pasted it: what is wrong is said in
    their words (cut short, changed, the wrong line), not in the encoding's."""
    text = text.strip()
    if not text.startswith(TICKET_PREFIX):
        raise TicketError(
            f"not an admission ticket: those start with {TICKET_PREFIX!r}, as `p2ptrain admit` prints them"
        )
    body = text[len(TICKET_PREFIX) :]
    try:
        ticket = read_ticket(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (binascii.Error, ValueError):  # TicketError is a ValueError
        raise TicketError(
            "not a ticket `p2ptrain admit` printed (it does not decode; cut short or changed when "
            "copied?): copy the whole line it printed"
        ) from None
    if not verify(ticket.authority, ticket.signature, ticket.message()):
        raise TicketError(
            "the ticket was changed after `p2ptrain admit` signed it (its signature does not match): "
            "copy the whole line it printed, or ask the run's operator for a new one"
        )
    return ticket


def check_admits(ticket: Ticket, node_key: bytes, *, authority: bytes, now: float) -> None:
    """Raise TicketError unless `ticket` lets `node_key` into the run of `authority` at `now`."""
    if ticket.authority != authority:
        raise TicketError(
            f"ticket signed by authority {short_id(ticket.authority)}, but the run's (run.authority) is "
            f"{short_id(authority)}"
        )
    if ticket.node_key != node_key:
        raise TicketError(
            f"ticket admits node {short_id(ticket.node_key)}, not node {short_id(node_key)} (a ticket "
            "admits the one node key it was issued for)"
        )
    if ticket.expires <= now:
        raise TicketError(f"ticket of {short_id(node_key)} expired {now - ticket.expires:.0f} s ago")


def parse_public_key(text: str, what: str) -> bytes:
    """A 32-byte Ed25519 public key written as 64 hex digits (as `p2ptrain identity` prints)."""
    try:
        key = bytes.fromhex(text.strip())
    except ValueError:
        key = b""
    if len(key) != PUBLIC_KEY_BYTES:
        raise TicketError(
            f"{what} {text[:80]!r} is not a key: 64 hex digits, as `p2ptrain identity` prints a node's "
            "(after 'node key') and `p2ptrain admit --new` the run's authority"
        )
    return key


def run_credentials(authority: bytes | None, ticket_text: str) -> Credentials | None:
    """What a closed run's node shows and checks in every data-plane handshake (None: open run)."""
    if authority is None:
        return None

    def check(peer: bytes, data: bytes) -> str | None:
        if not data:
            return "it showed no admission ticket"
        try:
            check_admits(decode_ticket(data), peer, authority=authority, now=time.time())
        except TicketError as exc:
            return str(exc)
        return None

    return Credentials(parse_ticket_text(ticket_text).to_bytes(), check)
