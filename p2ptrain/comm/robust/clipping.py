"""Robust aggregation: a member's pseudo-gradient can move the average by about as much as an honest
member's, whatever its size (norm clipping) and, under `comm.robust = "reweighted"`, whatever its
direction (a reweighted mean that leaves out shares pointing away from the others).

With robust aggregation (`comm.robust`) the all-reduce takes the butterfly, where the owner of each
chunk receives every member's share of it separately (the ring sums them on the way and cannot).
The owner waits for all shares of a chunk, takes each one's L2 norm divided by that member's
weight share (so a member that processed more tokens is not held against the others), and scales
every share whose normalised norm is above its limit down to that limit before summing. The limits
come from the members' signed norm claims (claims.py): min(claim × slack, `clip` × the median
claim), so every member can check the owner's sum against them. With one poisoner among three or
more members the median is an honest norm. The owner counts whose shares it cut to under half
their norm (ReduceStats.clipped); the node logs it, so poisoning is never silent.

Norm clipping bounds a share's size, not its direction: a member sending the opposite of what it
learned, at a typical norm, still pulls its weight backwards (measured: 15–21 % of held-out loss,
one of three members). Under "reweighted" the owner then takes a weighted mean of the (weight-
normalised, norm-clipped) shares y_i with weights f_i · k_i, k_i the fraction of its weight a
share keeps, and scales it back to the sum the all-reduce expects (× Σ f_i):

- k_i from agreement with the last result the owner took (`reference`, its chunk of the previous
  step's average): whole from AGREEING × the members' median cosine with it up, falling linearly
  to nothing at cosine 0. Honest pseudo-gradients of one run agree with the last result alike
  (cosine 0.3–0.7 on the debug model, more than with each other, 0.1–0.5); a negated, random or
  zero share, or the last result turned around, does not. With one poisoner among three or more
  members the median cosine is an honest one. Where the reference says nothing (no previous
  result: a node's first step, a joiner's; a median cosine ≤ 0, as at a sharp turn):
- k_i from distance to the coordinate-wise median: REWEIGHT_ROUNDS rounds of a mean whose weights
  are whole up to the median distance and fall with its square beyond. On the debug model this
  kept about 85 % of the honest signal against a negated share (the reference ~100 %;
  docs/results/2026-12-quality.md).

Centered clipping around the coordinate-wise median (Karimireddy, He, Jaggi 2021), tried first,
bounds a share's offset but keeps its weight: the honest signal still shrank by it. The result is
then scaled into the norm rule's bound Σ f_i · limit_i that every member checks (claims.py): a
weighted mean of norm-clipped shares exceeds it only when weight moved to members with larger
limits, and is then cut to it. Only the owner computes any of this, so nothing in it needs to be
bit-identical across members (the owner's encoded result is); an owner without a reference simply
takes the fallback.
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
MIN_MEMBERS = 3
"""Weighted members robust aggregation needs to tell a poisoner from the others: with two neither
outvotes the other (the norm clip alone applies; schedule.MIN_ROBUST_MEMBERS keeps such a step on
the plain mean)."""
CUT_FAR = 0.5
"""A share cut to under this fraction of its norm is reported (and logged by the node). At clip 1
every honest share above the median claim is cut a little, every step: not worth a warning."""
REWEIGHT_ROUNDS = 3
"""Rounds of the reweighted mean: measured on the debug model's pseudo-gradients, one round (or
weights falling only linearly with distance) leaves a negated share about half its weight; three
rounds with squared weights about a tenth."""
AGREEING = 0.5
"""A share whose cosine with the last result is at least this fraction of the members' median
cosine keeps its whole weight: honest pseudo-gradients of one run agree with the last result
alike (cosines 0.3–0.7 on the debug model), a negated, random or zero one does not."""
LEFT_OUT = 0.5
"""A share counted at under this fraction of its weight is reported (and logged by the node)."""


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
    shares were cut to under CUT_FAR of their norm. A member of weight 0 counts for nothing."""
    total = np.zeros_like(next(iter(arrived.values())))
    clipped = []
    for member in sorted(arrived):
        if fractions[member] <= 0:
            continue
        share = arrived[member]
        factor = limit_factor(share, fractions[member], limits[member])
        if factor < 1.0:
            share = np.multiply(share, np.float32(factor))
            if factor < CUT_FAR:
                clipped.append(member)
        total += share
    return total, clipped


def limit_factor(share: np.ndarray, fraction: float, limit: float) -> float:
    """What a weighted share is scaled by so that its norm per unit of weight is at most `limit`:
    1 within it, 0 for a finite share whose norm overflows (never inf or NaN after scaling)."""
    size = norm(share) / fraction
    if not size > limit:
        return 1.0
    return limit / size if math.isfinite(size) else 0.0


@dataclass
class RobustSum:
    """One chunk's robust sum and whom it held back."""

    total: np.ndarray
    clipped: list[int] = field(default_factory=list)
    """Members whose shares were scaled down to their norm limit."""
    left_out: list[int] = field(default_factory=list)
    """Members whose shares the reweighted mean counted at under LEFT_OUT of their weight."""


def robust_sum(
    arrived: dict[int, np.ndarray],
    fractions: Sequence[float],
    limits: Sequence[float] | np.ndarray,
    *,
    reweighted: bool,
    reference: np.ndarray | None = None,
) -> RobustSum:
    """The owner's sum of one chunk: `clipped_sum`, and with `reweighted` a weighted mean that
    leaves out shares pointing away from the others' (module docstring): weighed by their agreement
    with `reference` (this chunk of the last result the owner took) where that says something, else
    by their distance from the coordinate-wise median. Needs three weighted members to tell one from
    the others; with fewer it is the norm-clipped sum."""
    weighted = [member for member in sorted(arrived) if fractions[member] > 0]
    if not reweighted or len(weighted) < MIN_MEMBERS:
        return RobustSum(*clipped_sum(arrived, fractions, limits))
    factors = [limit_factor(arrived[member], fractions[member], limits[member]) for member in weighted]
    clipped = [member for member, factor in zip(weighted, factors, strict=True) if factor < CUT_FAR]
    shares = np.stack(  # each as one unit of weight, within its limit
        [
            np.multiply(arrived[member], np.float32(factor / fractions[member]))
            for member, factor in zip(weighted, factors, strict=True)
        ]
    )
    fractions_of = np.array([float(fractions[member]) for member in weighted])
    kept = _agreement(shares, reference) if reference is not None else None
    if kept is None:
        kept = _around_the_median(shares, fractions_of)
    total = np.multiply(_weighted_mean(shares, fractions_of * kept), np.float32(fractions_of.sum()))
    bound = float(np.dot(fractions_of, [float(limits[member]) for member in weighted]))
    size = norm(total)
    if size > bound:
        np.multiply(total, np.float32(bound / size), out=total)
    left_out = [member for member, factor in zip(weighted, kept, strict=True) if factor < LEFT_OUT]
    return RobustSum(total, clipped, left_out)


def _agreement(shares: np.ndarray, reference: np.ndarray) -> np.ndarray | None:
    """Per share, the fraction of its weight it keeps by its cosine with `reference`
    (`kept_by_cosine`); None where the reference says nothing."""
    direction = norm(reference)
    if not 0 < direction < math.inf:
        return None
    sizes = [norm(share) for share in shares]
    cosines = [
        float(np.dot(share, reference)) / (size * direction) if size > 0 else 0.0
        for share, size in zip(shares, sizes, strict=True)
    ]
    kept = kept_by_cosine(cosines)
    return None if kept is None else np.array(kept)


def kept_by_cosine(cosines: Sequence[float]) -> list[float] | None:
    """Per share, the fraction of its weight it keeps by its cosine with a reference direction:
    whole from AGREEING × the median cosine up, falling linearly to nothing at 0 and below. None
    where the reference says nothing: a median cosine that is not positive (the shares turned away
    from it together, as at a sharp turn of the loss), or nobody kept. Plain float arithmetic in
    one order: the sparse gather needs the same weights on every member."""
    typical = statistics.median(cosines)
    if not typical > 0:
        return None
    kept = [min(1.0, max(0.0, cosine / (AGREEING * typical))) for cosine in cosines]
    return kept if sum(kept) > 0 else None


def _around_the_median(shares: np.ndarray, fractions: np.ndarray) -> np.ndarray:
    """Per share, the fraction of its weight it keeps in REWEIGHT_ROUNDS rounds of a mean weighed
    by distance from the centre (starting at the coordinate-wise median): whole up to the median
    distance, falling with its square beyond."""
    centre = coordinate_median(shares)
    kept = np.ones(len(shares))
    for _ in range(REWEIGHT_ROUNDS):
        distances = np.array([norm(share - centre) for share in shares])
        radius = statistics.median(distances.tolist())
        kept = np.array([min(1.0, (radius / d) ** 2) if d > radius else 1.0 for d in distances])
        centre = _weighted_mean(shares, fractions * kept)
    return kept


def _weighted_mean(shares: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Σ wᵢ yᵢ / Σ wᵢ over the rows of `shares`, float32, in row order."""
    mean = np.zeros_like(shares[0])
    for share, weight in zip(shares, weights / weights.sum(), strict=True):
        mean += np.multiply(share, np.float32(weight))
    return mean


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
