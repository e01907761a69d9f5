"""The members of one all-reduce as every one of them lists them, and what they agree on from the
list: the membership digest every handshake checks, and each member's share of the average."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True)
class Member:
    key: bytes
    host: str
    port: int
    weight: float = 1.0
    reachable: bool = True
    """False for a member behind NAT: it dials its edges to reachable members itself
    (connect.sender_dials); its edges to other members behind NAT go through a relay (relay.py)."""


def membership_digest(step: int, members: Sequence[Member], relays: Sequence[Member] = ()) -> bytes:
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


def shares(members: Sequence[Member]) -> list[float]:
    """Each member's share of the average: weight / total, or equal shares when all weights are 0."""
    weights = [float(member.weight) for member in members]
    if any(not np.isfinite(weight) or weight < 0 for weight in weights):
        raise ValueError("member weights must be finite and non-negative")
    total = sum(weights)
    return [weight / total for weight in weights] if total > 0 else [1.0 / len(weights)] * len(weights)
