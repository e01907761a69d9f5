"""Robust aggregation: one member's huge but finite pseudo-gradient counts as at most a few typical ones.

With `comm.clip` > 0 the all-reduce takes the butterfly, where the owner of each chunk receives
every member's share of it separately (the ring sums them on the way and cannot). The owner waits
for all shares of a chunk, takes each one's L2 norm divided by that member's weight share (so a
member that processed more tokens is not held against the others), and scales every share whose
normalised norm is above its limit down to that limit before summing. The limits come from the
members' signed norm claims (claims.py): min(claim × slack, `clip` × the median claim), so every
member can check the owner's sum against them. With one poisoner among three or more members the
median is an honest norm. The owner counts whose shares it clipped (ReduceStats.clipped); the node
logs it, so poisoning is never silent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

FLOAT32_TINY = float(np.finfo(np.float32).tiny)


def norm(values: np.ndarray) -> float:
    """L2 norm. The float32 dot product (BLAS, no copy) serves where its sum of squares is a normal
    float32; huge values (inf), tiny ones (underflow) and NaN take a float64 copy."""
    with np.errstate(all="ignore"):
        squares = float(np.dot(values, values))
    if not FLOAT32_TINY <= squares < math.inf:
        wide = values.astype(np.float64)
        squares = float(np.dot(wide, wide))
    return math.sqrt(squares)


def clipped_sum(
    arrived: dict[int, np.ndarray], fractions: Sequence[float], limits: Sequence[float] | np.ndarray
) -> tuple[np.ndarray, list[int]]:
    """Σ of every member's (weighted) share of one chunk, each scaled down to its limit (a norm per
    unit of weight: claims.limits) where above it, summed in member order; and the members whose
    shares were clipped. A member of weight 0 counts for nothing."""
    total = np.zeros_like(next(iter(arrived.values())))
    clipped = []
    for member in sorted(arrived):
        if fractions[member] <= 0:
            continue
        share, limit = arrived[member], limits[member]
        size = norm(share) / fractions[member]
        if size > limit:
            factor = limit / size if math.isfinite(size) else 0.0
            share = np.multiply(share, np.float32(factor))
            clipped.append(member)
        total += share
    return total, clipped
