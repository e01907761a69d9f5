"""Robust aggregation: a member's pseudo-gradient can move the average by about as much as an honest
member's, whatever its size (norm clipping) and, under `comm.robust = "centered"`, whatever its
direction (centered clipping).

With robust aggregation (`comm.robust`) the all-reduce takes the butterfly, where the owner of each
chunk receives every member's share of it separately (the ring sums them on the way and cannot).
The owner waits for all shares of a chunk, takes each one's L2 norm divided by that member's
weight share (so a member that processed more tokens is not held against the others), and scales
every share whose normalised norm is above its limit down to that limit before summing. The limits
come from the members' signed norm claims (claims.py): min(claim × slack, `clip` × the median
claim), so every member can check the owner's sum against them. With one poisoner among three or
more members the median is an honest norm. The owner counts whose shares it clipped
(ReduceStats.clipped); the node logs it, so poisoning is never silent.

Norm clipping bounds a share's size, not its direction: a member sending the opposite of what it
learned, at a typical norm, still pulls its weight backwards (measured: 14.7 % of held-out loss, one
of three members). Centered clipping (Karimireddy, He, Jaggi 2021, around a robust centre) takes
that away: per chunk, the owner takes the coordinate-wise median m of the weighted members'
(weight-normalised, norm-clipped) shares y_i, each share's distance d_i = ‖y_i − m‖ and the median
distance τ, and sums Σ f_i · (m + min(1, τ / d_i) · (y_i − m)). A share as far from the others as
an honest one is counted whole (honest runs lose nothing measurable: the mean is kept where no
share is unusually far); one far from them, the poisoner's, moves the result by at most τ · f_i
from the centre, in whatever direction it points. With one poisoner among three or more members, m
and τ are set by honest shares. Finally the result is scaled into the norm rule's bound Σ f_i ·
limit_i, which every member checks (claims.py); a sum of norm-clipped shares never exceeds it, so an
honest result is not changed by it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

FLOAT32_TINY = float(np.finfo(np.float32).tiny)
SORTED_IN_PLACE = 8
"""Members up to which coordinate_median sorts with a network of min/max passes."""
PULLED_FAR = 0.5
"""A share counted at less than this fraction of its distance from the centre is reported (and
logged by the node): honest shares in high dimension sit at similar distances, so only a share
pointing well away from the others is pulled in this far."""


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


@dataclass
class RobustSum:
    """One chunk's robust sum and whom it held back."""

    total: np.ndarray
    clipped: list[int] = field(default_factory=list)
    """Members whose shares were scaled down to their norm limit."""
    pulled: list[int] = field(default_factory=list)
    """Members whose shares centered clipping counted at under PULLED_FAR of their offset."""


def robust_sum(
    arrived: dict[int, np.ndarray],
    fractions: Sequence[float],
    limits: Sequence[float] | np.ndarray,
    *,
    centered: bool,
) -> RobustSum:
    """The owner's sum of one chunk: `clipped_sum`, and with `centered` centered clipping around
    the coordinate-wise median (module docstring). Needs three weighted members to have a centre
    other than the mean; with fewer it is the norm-clipped sum."""
    total, clipped = clipped_sum(arrived, fractions, limits)
    weighted = [member for member in sorted(arrived) if fractions[member] > 0]
    if not centered or len(weighted) < 3:
        return RobustSum(total, clipped)
    shares = np.stack(
        [_within_limit(arrived[member], fractions[member], limits[member]) for member in weighted]
    )
    centre = coordinate_median(shares)
    np.subtract(shares, centre, out=shares)  # each row: the share's offset from the centre
    distances = [norm(row) for row in shares]
    radius = statistics.median(distances)
    weights = [float(fractions[member]) for member in weighted]
    total = np.multiply(centre, np.float32(sum(weights)))
    pulled = []
    for member, weight, offset, distance in zip(weighted, weights, shares, distances, strict=True):
        kept = min(1.0, radius / distance) if distance > 0 else 1.0
        if kept < PULLED_FAR:
            pulled.append(member)
        total += np.multiply(offset, np.float32(weight * kept))
    bound = float(np.dot(weights, [float(limits[member]) for member in weighted]))
    size = norm(total)
    if size > bound:  # never for norm-clipped shares kept whole (the triangle inequality)
        np.multiply(total, np.float32(bound / size), out=total)
    return RobustSum(total, clipped, pulled)


def coordinate_median(rows: np.ndarray) -> np.ndarray:
    """The median of each column of `rows` (members × values), float32. Up to SORTED_IN_PLACE rows
    a sorting network of element-wise min/max over a copy (about 10× numpy.median's time on 1M
    values and 3–4 rows, which selects along the strided axis); numpy.median above it."""
    count = len(rows)
    if count > SORTED_IN_PLACE:
        return np.median(rows, axis=0).astype(np.float32, copy=False)
    ordered = rows.copy()
    low = np.empty_like(ordered[0])
    for round_ in range(count):  # odd-even transposition: sorted after `count` rounds
        for i in range(round_ % 2, count - 1, 2):
            np.minimum(ordered[i], ordered[i + 1], out=low)
            np.maximum(ordered[i], ordered[i + 1], out=ordered[i + 1])
            ordered[i] = low
    middle = count // 2
    if count % 2:
        return ordered[middle]
    return np.multiply(np.add(ordered[middle - 1], ordered[middle]), np.float32(0.5))


def _within_limit(share: np.ndarray, fraction: float, limit: float) -> np.ndarray:
    """A weighted share as one unit of weight, scaled down to its norm limit (as `clipped_sum`),
    in one multiplication: a finite share whose norm overflows becomes zeros, not inf or NaN."""
    size = norm(share) / fraction
    factor = (limit / size if math.isfinite(size) else 0.0) if size > limit else 1.0
    return np.multiply(share, np.float32(factor / fraction))
