"""robust.clipped_sum: the owner's clipping rule, against plain sums."""

from __future__ import annotations

import numpy as np

from p2ptrain.comm.robust import clipped_sum, norm


def shares(count: int, length: int = 1000) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(0)
    return {member: rng.standard_normal(length).astype(np.float32) / count for member in range(count)}


def test_similar_shares_are_summed_unchanged():
    arrived = shares(4)
    total, clipped = clipped_sum(arrived, [0.25] * 4, clip=2.0)
    assert clipped == []
    assert np.allclose(total, sum(arrived.values()), atol=1e-6)


def test_a_huge_share_is_scaled_to_clip_times_the_median():
    arrived = shares(4)
    arrived[2] = arrived[2] * np.float32(1000)
    typical = float(np.median([norm(share) for share in arrived.values()]))  # the poisoner's too
    total, clipped = clipped_sum(arrived, [0.25] * 4, clip=2.0)
    assert clipped == [2]
    others = sum(share for member, share in arrived.items() if member != 2)
    assert abs(norm(total - others) - 2.0 * typical) < 1e-3 * typical


def test_norms_are_weighed_by_each_members_share_and_overflow_counts_as_zero():
    arrived = shares(3)
    arrived[0] = arrived[0] * np.float32(3)  # it processed 3× the tokens: a 3× share is its due
    _, clipped = clipped_sum(arrived, [0.6, 0.2, 0.2], clip=2.0)
    assert clipped == []
    arrived[1] = np.full(1000, 3e38, np.float32)  # finite, but its float32 norm would be inf
    total, clipped = clipped_sum(arrived, [0.6, 0.2, 0.2], clip=2.0)
    assert np.isfinite(total).all() and 1 in clipped
