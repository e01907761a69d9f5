"""Robust aggregation's rules: the owner's clipping (clipping.clipped_sum) to the limits from the
members' signed norm claims, the reweighted mean around their coordinate-wise median
(clipping.robust_sum), the bound every member checks an owner's result against, the claims' format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from p2ptrain.comm.robust import claims
from p2ptrain.comm.robust.clipping import clipped_sum, coordinate_median, norm, robust_sum
from p2ptrain.comm.transport.wire import FrameError
from p2ptrain.identity import load_or_create_identity

DIGEST = bytes(range(32))


def shares(count: int, length: int = 1000) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(0)
    return {member: rng.standard_normal(length).astype(np.float32) / count for member in range(count)}


def honest_limits(arrived: dict[int, np.ndarray], fractions: list[float], clip: float) -> np.ndarray:
    """The limits when every member claims the norm of what it sends (per unit of weight)."""
    claimed = np.array(
        [norm(arrived[m]) / fractions[m] if fractions[m] > 0 else 0.0 for m in sorted(arrived)]
    )
    return claims.limits(claimed, fractions, clip=clip, bits=8)


def test_similar_shares_are_summed_unchanged() -> None:
    arrived = shares(4)
    total, clipped = clipped_sum(arrived, [0.25] * 4, honest_limits(arrived, [0.25] * 4, 2.0))
    assert clipped == []
    assert np.allclose(total, sum(arrived.values()), atol=1e-6)


def test_a_huge_share_is_scaled_to_clip_times_the_median_claim() -> None:
    arrived = shares(4)
    arrived[2] = arrived[2] * np.float32(1000)
    typical = float(np.median([norm(share) for share in arrived.values()]))  # the poisoner's too
    total, clipped = clipped_sum(arrived, [0.25] * 4, honest_limits(arrived, [0.25] * 4, 2.0))
    assert clipped == [2]
    others = sum(share for member, share in arrived.items() if member != 2)
    assert abs(norm(total - others) - 2.0 * typical) < 1e-3 * typical


def test_a_share_larger_than_its_own_claim_is_cut_to_the_claim() -> None:
    arrived = shares(4)
    fractions = [0.25] * 4
    claimed = np.array([norm(arrived[m]) / 0.25 for m in range(4)])
    arrived[1] = arrived[1] * np.float32(3)  # 3 × what it claimed: cut to the claim, not to 2 × median
    total, clipped = clipped_sum(arrived, fractions, claims.limits(claimed, fractions, clip=2.0, bits=8))
    assert clipped == [1]
    others = sum(share for member, share in arrived.items() if member != 1)
    assert abs(norm(total - others) / 0.25 - claimed[1] * claims.SLACK[8]) < 1e-3 * claimed[1]


def test_norms_are_weighed_by_each_members_share_and_overflow_counts_as_zero() -> None:
    arrived = shares(3)
    arrived[0] = arrived[0] * np.float32(3)  # it processed 3× the tokens: a 3× share is its due
    fractions = [0.6, 0.2, 0.2]
    _, clipped = clipped_sum(arrived, fractions, honest_limits(arrived, fractions, 2.0))
    assert clipped == []
    limits = honest_limits(arrived, fractions, 2.0)
    arrived[1] = np.full(1000, 3e38, np.float32)  # finite, but its float32 norm would be inf
    total, clipped = clipped_sum(arrived, fractions, limits)
    assert np.isfinite(total).all() and 1 in clipped


def test_a_member_of_weight_zero_counts_for_nothing() -> None:
    arrived = shares(3)
    arrived[2] = arrived[2] * np.float32(1e6)  # a "joiner" that sends values anyway
    fractions = [0.5, 0.5, 0.0]
    total, _ = clipped_sum(arrived, fractions, honest_limits(arrived, fractions, 2.0))
    assert np.array_equal(total, arrived[0] + arrived[1])


def test_an_honest_sum_is_within_the_bound_and_an_inflated_one_is_not() -> None:
    rng = np.random.default_rng(1)
    for aligned in (False, True):  # orthogonal shares, and the triangle inequality's worst case
        base = rng.standard_normal(4096).astype(np.float32)
        values = [base if aligned else rng.standard_normal(4096).astype(np.float32) for _ in range(4)]
        values[3] = values[3] * np.float32(100)  # one poisoner, claiming its true norm
        fractions = [0.25] * 4
        claimed = np.array([norm(v) for v in values])
        limits = claims.limits(claimed, fractions, clip=1.0, bits=8)
        total, _ = clipped_sum({m: v * np.float32(0.25) for m, v in enumerate(values)}, fractions, limits)
        bound = claims.result_bound(claimed, fractions, clip=1.0, bits=8)
        assert norm(total) <= bound
        unclipped = sum(v * np.float32(0.25) for v in values)
        assert norm(unclipped) > 10 * bound


def correlated(count: int, length: int = 20_000, shared: float = 0.5, seed: int = 2) -> list[np.ndarray]:
    """Pseudo-gradients of members that learned the same thing in part: a common direction plus
    each one's own noise (cosine `shared` between two of them)."""
    rng = np.random.default_rng(seed)
    common = rng.standard_normal(length)
    return [
        (np.sqrt(shared) * common + np.sqrt(1 - shared) * rng.standard_normal(length)).astype(np.float32)
        for _ in range(count)
    ]


def owners_sum(
    values: list[np.ndarray], *, reweighted: bool, clip: float = 1.0
) -> tuple[np.ndarray, list[int]]:
    """What an owner makes of equal-weight members' values, each claiming its true norm."""
    fractions = [1 / len(values)] * len(values)
    limits = claims.limits(np.array([norm(v) for v in values]), fractions, clip=clip, bits=8)
    arrived = {m: v * np.float32(fractions[m]) for m, v in enumerate(values)}
    summed = robust_sum(arrived, fractions, limits, reweighted=reweighted)
    return summed.total, summed.left_out


@pytest.mark.parametrize("count", [1, 2, 3, 4, 5, 8, 9, 12])
def test_the_coordinate_median_is_numpys(count: int) -> None:
    rows = np.random.default_rng(count).standard_normal((count, 1001)).astype(np.float32)
    assert np.array_equal(coordinate_median(rows), np.median(rows, axis=0).astype(np.float32))


@pytest.mark.parametrize("count", [3, 4, 7])
def test_honest_shares_keep_about_their_mean_under_the_reweighted_mean(count: int) -> None:
    for shared in (0.0, 0.5):
        values = correlated(count, shared=shared)
        mean = np.mean(values, axis=0)
        total, left_out = owners_sum(values, reweighted=True, clip=2.0)
        assert norm(total - mean) <= 0.03 * norm(mean), shared
        assert left_out == []


@pytest.mark.parametrize(("count", "poisoners"), [(3, 1), (4, 1), (7, 2)])
def test_a_share_turned_against_the_others_is_held_near_their_centre(count: int, poisoners: int) -> None:
    """The negation of a member's own pseudo-gradient, at its honest norm: norm clipping cannot
    tell it from an honest share; the reweighted mean leaves it out."""
    values = correlated(count, shared=0.7)
    honest = np.mean(values[: count - poisoners], axis=0)
    for member in range(count - poisoners, count):
        values[member] = -values[member]
    clipped, _ = owners_sum(values, reweighted=False)
    reweighted, left_out = owners_sum(values, reweighted=True)

    def along(total: np.ndarray) -> float:
        return float(np.dot(total, honest) / np.dot(honest, honest))

    assert along(clipped) < 0.6  # the mean's pull: (count − 2 × poisoners) / count
    assert along(reweighted) > 0.9
    assert norm(reweighted - honest) < 0.25 * norm(clipped - honest)
    assert set(left_out) == set(range(count - poisoners, count))  # and the node says whom


@pytest.mark.parametrize("attack", ["opposite", "random", "zero", "against"])
def test_shares_that_disagree_with_the_last_result_are_left_out(attack: str) -> None:
    """The reference is the last result the owner took: honest pseudo-gradients agree with it alike
    (here cosine about 0.5), a negated one, a random one, zeros and the last result turned around
    do not, and lose their weight; the honest ones keep theirs whole."""
    rng = np.random.default_rng(7)
    length, count = 20_000, 4
    last = rng.standard_normal(length).astype(np.float32)
    values = [(0.6 * last + rng.standard_normal(length)).astype(np.float32) for _ in range(count)]
    honest = np.mean(values[:-1], axis=0)
    poisoned = {
        "opposite": -values[-1],
        "random": rng.standard_normal(length).astype(np.float32)
        * np.float32(norm(values[-1]) / np.sqrt(length)),
        "zero": np.zeros(length, np.float32),
        "against": -last * np.float32(norm(values[-1]) / norm(last)),
    }[attack]
    fractions = [1 / count] * count
    arrived = {m: v * np.float32(1 / count) for m, v in enumerate([*values[:-1], poisoned])}
    limits = claims.limits(np.array([norm(v) for v in [*values[:-1], poisoned]]), fractions, clip=1.0, bits=8)
    summed = robust_sum(arrived, fractions, limits, reweighted=True, reference=last)
    assert summed.left_out == [count - 1]
    assert norm(summed.total - honest) <= 0.02 * norm(honest)  # the honest members' mean, whole
    honest_only = {m: v * np.float32(1 / count) for m, v in enumerate(values)}
    limits = claims.limits(np.array([norm(v) for v in values]), fractions, clip=2.0, bits=8)
    summed = robust_sum(honest_only, fractions, limits, reweighted=True, reference=last)
    assert summed.left_out == [] and norm(summed.total - np.mean(values, axis=0)) <= 1e-5 * norm(honest)


def test_a_reference_that_says_nothing_falls_back_to_the_median() -> None:
    values = correlated(4, shared=0.7)
    fractions = [0.25] * 4
    limits = claims.limits(np.array([norm(v) for v in values]), fractions, clip=2.0, bits=8)
    arrived = {m: v * np.float32(0.25) for m, v in enumerate(values)}
    around_median = robust_sum(arrived, fractions, limits, reweighted=True).total
    for reference in (np.zeros_like(values[0]), -np.mean(values, axis=0)):  # nothing, or turned away
        total = robust_sum(arrived, fractions, limits, reweighted=True, reference=reference).total
        assert np.array_equal(total, around_median)


def test_reweighted_results_stay_within_the_bound_every_member_checks() -> None:
    rng = np.random.default_rng(5)
    for trial in range(40):
        count = int(rng.integers(3, 9))
        values = [
            rng.standard_normal(512).astype(np.float32) * np.float32(rng.uniform(0.1, 10))
            for _ in range(count)
        ]
        if trial % 2:  # aligned poisoners: the worst case for the centre's norm
            values[1:3] = [values[0] * np.float32(50), values[0] * np.float32(50)]
        fractions = list(rng.dirichlet(np.ones(count)))
        claimed = np.array([norm(v) for v in values])
        limits = claims.limits(claimed, fractions, clip=1.0, bits=8)
        arrived = {m: v * np.float32(fractions[m]) for m, v in enumerate(values)}
        total = robust_sum(arrived, fractions, limits, reweighted=True).total
        assert np.isfinite(total).all()
        assert (
            norm(total)
            <= claims.result_bound(claimed, fractions, clip=1.0, bits=8) / claims.SLACK[8] * 1.0001
        )


def test_the_reweighted_mean_needs_three_weighted_members_and_ignores_weight_zero() -> None:
    arrived = shares(3)
    arrived[2] = arrived[2] * np.float32(1e6)  # a "joiner" that sends values anyway
    fractions = [0.5, 0.5, 0.0]
    limits = honest_limits(arrived, fractions, 2.0)
    summed = robust_sum(arrived, fractions, limits, reweighted=True)
    assert np.array_equal(summed.total, clipped_sum(arrived, fractions, limits)[0])
    arrived = shares(4)
    arrived[3] = np.full(1000, 3e38, np.float32)  # finite, its norm overflows: counts as zeros
    summed = robust_sum(arrived, [0.25] * 4, honest_limits(arrived, [0.25] * 4, 2.0), reweighted=True)
    assert np.isfinite(summed.total).all()


def test_claims_round_trip_and_anything_else_is_refused(tmp_path: Path) -> None:
    alice = load_or_create_identity(tmp_path / "alice")
    bob = load_or_create_identity(tmp_path / "bob")
    norms = np.array([1.5, 0.0, 3.25])
    blob = claims.sign_claims(alice, 7, digest=DIGEST, segment=2, norms=norms)
    assert len(blob) == claims.claim_bytes(3)
    assert np.array_equal(
        claims.read_claims(blob, alice.public_key, step=7, digest=DIGEST, segment=2, chunks=3), norms
    )
    wrong = {
        "another signer": (blob, bob.public_key, 7, DIGEST, 2, 3),
        "another step": (blob, alice.public_key, 8, DIGEST, 2, 3),
        "another membership": (blob, alice.public_key, 7, bytes(32), 2, 3),
        "another segment": (blob, alice.public_key, 7, DIGEST, 1, 3),
        "another chunk count": (blob, alice.public_key, 7, DIGEST, 2, 4),
        "a flipped norm bit": (
            blob[:20] + bytes([blob[20] ^ 1]) + blob[21:],
            alice.public_key,
            7,
            DIGEST,
            2,
            3,
        ),
        "truncated": (blob[:-1], alice.public_key, 7, DIGEST, 2, 3),
    }
    for case, (data, signer, step, digest, segment, chunks) in wrong.items():
        with pytest.raises(FrameError):
            claims.read_claims(data, signer, step=step, digest=digest, segment=segment, chunks=chunks)
            pytest.fail(case)
    for bad in (np.array([1.0, -1.0, 0.0]), np.array([1.0, np.inf, 0.0])):
        # signed, but no norm is negative or infinite
        signed = claims.sign_claims(alice, 7, digest=DIGEST, segment=2, norms=bad)
        with pytest.raises(FrameError, match="negative or non-finite"):
            claims.read_claims(signed, alice.public_key, step=7, digest=DIGEST, segment=2, chunks=3)
    bundle = blob + claims.sign_claims(bob, 7, digest=DIGEST, segment=2, norms=norms * 2)
    read = claims.read_bundle(
        bundle, [alice.public_key, bob.public_key], step=7, digest=DIGEST, segment=2, chunks=3
    )
    assert np.array_equal(read, np.stack([norms, norms * 2]))
    with pytest.raises(FrameError):  # in another order, each claim meets the wrong key
        claims.read_bundle(
            bundle, [bob.public_key, alice.public_key], step=7, digest=DIGEST, segment=2, chunks=3
        )
