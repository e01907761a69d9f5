"""The members of one all-reduce as every one of them lists them, what they agree on from the
list, and what one member's part in a step yields."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from p2ptrain.comm.quant import Buffer


@dataclass(frozen=True)
class RingMember:
    key: bytes
    host: str
    port: int
    weight: float = 1.0
    reachable: bool = True
    """False for a member behind NAT: it dials its edges to reachable members itself
    (connect.sender_dials); its edges to other members behind NAT go through a relay (relay.py)."""


def membership_digest(step: int, members: Sequence[RingMember], relays: Sequence[RingMember] = ()) -> bytes:
    """sha256 over the step and the ordered members (keys, addresses, weights, reachability), and
    the standby relays the election lists (relay.relay_for), so ends that would pick different
    relays never meet under one digest."""
    digest = hashlib.sha256(b"p2ptrain/ring/v2\0" + step.to_bytes(8, "big"))
    for member in members:
        digest.update(
            member.key + f"{member.host}:{member.port}:{member.weight!r}:{member.reachable:d}\0".encode()
        )
    if relays:
        digest.update(b"relays\0")
        for relay in relays:
            digest.update(relay.key + f"{relay.host}:{relay.port}\0".encode())
    return digest.digest()


def shares(members: Sequence[RingMember]) -> list[float]:
    """Each member's share of the average: weight / total, or equal shares when all weights are 0."""
    weights = [float(member.weight) for member in members]
    if any(not np.isfinite(weight) or weight < 0 for weight in weights):
        raise ValueError("member weights must be finite and non-negative")
    total = sum(weights)
    return [weight / total for weight in weights] if total > 0 else [1.0 / len(weights)] * len(weights)


MIN_MEASURED_BYTES = 1 << 20


def link_rates(held_up: dict[bytes, list[float]]) -> dict[bytes, float]:
    """Bytes/s to each peer, from the [bytes, seconds] of the sends to it that waited for its link;
    inf where too few waited to tell (the link kept up)."""
    return {
        key: sent / seconds if sent >= MIN_MEASURED_BYTES and seconds > 0 else math.inf
        for key, (sent, seconds) in held_up.items()
    }


@dataclass
class RingStats:
    seconds: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    frames: int = 0
    result: list[tuple[int, int, Buffer]] = field(default_factory=list)
    """The encoded chunks (start, stop, payload) every member decoded: an exact record of the step."""
    link_rates: dict[bytes, float] = field(default_factory=dict)
    """Bytes/s to each peer we sent to, measured over the frames whose send it held up; inf for a
    peer that took our frames as fast as we produced them (its link was not our bottleneck)."""
    clipped: dict[bytes, int] = field(default_factory=dict)
    """Robust aggregation: member → chunks of ours (we own them) in which its share was clipped."""
