"""The sparse error-feedback codec (codec/sparse.py) and its gather (reduce/gather.py): the kernels
against their NumPy oracle, the accumulator, and member processes on 127.0.0.1 (real sockets)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from p2ptrain.comm.codec import sparse
from p2ptrain.comm.codec.quant import NonFiniteError, PayloadError
from p2ptrain.comm.reduce.gather import agreement_scores, kept_by_size
from p2ptrain.comm.reduce.schedule import Schedule
from p2ptrain.comm.robust.clipping import kept_by_cosine
from p2ptrain.config import CommConfig, load_config
from tests.support.ring_procs import run_ring, shares_of

CODE = sparse.SparseCode()
SPARSE = CommConfig(codec="sparse", chunk_bytes=1 << 12)
"""Frames of 32 Ki values: a 200k-value vector takes several per segment."""


def vectors(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


@pytest.mark.parametrize(
    ("n", "chunk", "k"),
    [
        (10_000, 4096, 64),
        (3 * 4096, 4096, 64),
        (100, 16, 5),
        (33, 16, 16),
        (1, 16, 3),
        (5000, 256, 1),
        (70_000, 65536, 100),
    ],
)
def test_kernels_match_the_numpy_oracle(n: int, chunk: int, k: int) -> None:
    code = sparse.SparseCode(chunk=chunk, k=k)
    values = vectors(n)
    values[::7] = values[0]  # ties at the threshold: the lower index first, in both
    values[1::11] = 0.0
    payload = sparse.encode(values, code)
    assert bytes(payload) == sparse.reference_encode(values, code)
    assert len(payload) == code.payload_size(n)
    decoded = sparse.reference_decode(payload, n, code)
    acc = np.zeros(n, np.float32)
    sparse.decode_add(payload, acc, code)
    assert np.array_equal(acc, decoded)
    assert sparse.squared_norm(payload, n, code) == pytest.approx(float(np.dot(decoded, decoded)), rel=1e-6)
    kept = np.count_nonzero(decoded)
    assert kept <= sum(min(k, n - start) for start in range(0, n, chunk))


@pytest.mark.parametrize(("members", "chunk", "k"), [(3, 64, 8), (4, 64, 8), (5, 16, 16), (8, 4096, 64)])
def test_the_gram_kernel_matches_its_oracle(members: int, chunk: int, k: int) -> None:
    code = sparse.SparseCode(chunk=chunk, k=k)
    n = 37 * chunk + chunk // 3
    common = vectors(n, seed=99)
    shares = [sparse.encode(common + vectors(n, seed=member), code) for member in range(members)]
    gram = sparse.gram(shares, n, code)
    expected = sparse.reference_gram(shares, n, code)
    assert all(row == pytest.approx(want, rel=1e-9) for row, want in zip(gram, expected, strict=True))
    assert all(
        gram[a][b] == gram[b][a] > 0 for a in range(members) for b in range(members)
    )  # shared direction
    assert gram[0][0] == pytest.approx(sparse.squared_norm(shares[0], n, code), rel=1e-12)


def test_agreement_scores_weigh_a_poisoner_at_nothing_whatever_it_sends() -> None:
    """Shares that agree a little (cosine 0.2 before top-k), and one or two poisoners among them: the
    opposite of an honest share, a random direction, zeros, and two colluders sending one vector."""
    n, rng = 1 << 18, np.random.default_rng(5)
    common = rng.standard_normal(n).astype(np.float32)
    for members, bad in ((3, 1), (7, 2)):
        honest = [
            common + np.float32(2) * rng.standard_normal(n).astype(np.float32) for _ in range(members - bad)
        ]
        for attack in ("opposite", "random", "zero", "colluding"):
            poison = {
                "opposite": [-vector for vector in honest[:bad]],
                "random": [rng.standard_normal(n).astype(np.float32) for _ in range(bad)],
                "zero": [np.zeros(n, np.float32) for _ in range(bad)],
                "colluding": [-honest[0]] * bad,
            }[attack]
            shares = [sparse.encode(vector, CODE) for vector in honest + poison]
            kept = kept_by_cosine(agreement_scores(sparse.gram(shares, n, CODE)))
            assert kept is not None and kept[: members - bad] == [1.0] * (members - bad), (
                members,
                attack,
                kept,
            )
            assert max(kept[members - bad :]) < 0.3, (members, attack, kept)


def test_a_share_far_smaller_than_the_others_keeps_weight_in_proportion_to_its_size() -> None:
    """A member sending next to nothing with its full token count (what is left of its accumulator
    once it adds nothing) would shrink every step by its weight: under half the median norm, it
    keeps that much of its weight in proportion; typical shares keep theirs; a malformed one stays."""
    kept = kept_by_size([1.0, 1.0, 0.5, 1.0, 0.0], [1.0, 0.6, 1.2, 0.1, None], typical=1.0)
    assert kept == pytest.approx([1.0, 1.0, 0.5, 0.2, 0.0])


def test_the_default_code_is_under_a_quarter_bit_per_value_and_keeps_the_largest() -> None:
    values = vectors(1 << 20)
    payload = sparse.encode(values, CODE)
    assert CODE.bits_per_value(values.size) == pytest.approx(0.234, abs=0.001)
    decoded = sparse.reference_decode(payload, values.size, CODE)
    chunk = np.abs(values[:4096])
    kept = np.flatnonzero(decoded[:4096])
    assert kept.size == 64 and chunk[kept].min() >= np.sort(chunk)[-64]
    assert np.all(np.sign(decoded[kept]) == np.sign(values[kept]))
    # what the two levels keep of the kept values: a 2-bit code's error, not a lost direction
    cosine = np.dot(decoded, values) / np.linalg.norm(decoded) / np.linalg.norm(values)
    assert cosine > 0.2


def test_non_finite_values_are_never_encoded() -> None:
    values = vectors(10_000)
    values[5000] = np.inf
    with pytest.raises(NonFiniteError):
        sparse.encode(values, CODE)


@pytest.mark.parametrize("damage", ["repeated index", "index past the end", "negative level", "short"])
def test_a_malformed_payload_is_refused_before_anything_decodes_it(damage: str) -> None:
    n = 10_000
    payload = sparse.encode(vectors(n), CODE)
    if damage == "repeated index":
        payload[8:11] = b"\x00\x00\x00"
    elif damage == "index past the end":  # the last chunk holds 10000 - 8192 values; 4095 is past it
        last = CODE.offset(8192)
        payload[last + 8 + 94 : last + 8 + 96] = b"\xff\xff"
    elif damage == "negative level":
        payload[3] |= 0x80
    else:
        payload = payload[:-1]
    with pytest.raises(PayloadError):
        sparse.squared_norm(payload, n, CODE)


def test_error_feedback_keeps_what_was_not_sent_and_sends_one_share_per_step() -> None:
    feedback = sparse.ErrorFeedback(code=CODE, decay=0.5)
    first, second = vectors(50_000, 1), vectors(50_000, 2)
    share = feedback.share(0, first)
    assert feedback.share(0, second) is share  # a retried attempt sends the same share
    feedback.sent(0)
    feedback.sent(0)  # once only
    assert feedback.error is not None
    sent = sparse.reference_decode(share, first.size, CODE)
    assert np.array_equal(feedback.error, first - sent)
    share = feedback.share(1, second)
    expected = (first - sent) * np.float32(0.5) + second
    assert np.array_equal(feedback.error, expected)
    assert bytes(share) == sparse.reference_encode(expected, CODE)
    # a step given up leaves its delta in the accumulator; a NaN delta changes nothing
    before = feedback.error.copy()
    bad = second.copy()
    bad[7] = np.nan
    with pytest.raises(NonFiniteError):
        feedback.share(2, bad)
    assert np.array_equal(feedback.error, before)


def test_error_feedback_is_saved_and_only_a_sound_one_is_taken_back(tmp_path: Path) -> None:
    feedback = sparse.ErrorFeedback(code=CODE, decay=0.9)
    feedback.share(3, vectors(20_000))
    feedback.sent(3)
    feedback.save(tmp_path / "feedback.npy")
    restored = sparse.ErrorFeedback(code=CODE, decay=0.9)
    assert restored.load(tmp_path / "feedback.npy", 20_000) is None
    assert restored.error is not None and feedback.error is not None
    assert np.array_equal(restored.error, feedback.error)
    assert "wanted float32 (10000,)" in str(restored.load(tmp_path / "feedback.npy", 10_000))
    np.save(tmp_path / "nan.npy", np.full(20_000, np.nan, np.float32))
    assert restored.load(tmp_path / "nan.npy", 20_000) == "not finite"
    (tmp_path / "junk.npy").write_bytes(b"junk")
    assert "unreadable" in str(restored.load(tmp_path / "junk.npy", 20_000))
    assert np.array_equal(restored.error, feedback.error)  # a refused file changes nothing


def test_the_sparse_codec_gathers_and_takes_sparseloco_s_outer_step() -> None:
    schedule = Schedule.of(index=0, n=4, length=1_000_000, comm=SPARSE)
    assert schedule.topology == "gather" and schedule.out_peers() == [1, 2, 3] == schedule.in_peers()
    assert all(start % 4096 == 0 for chunks in schedule.chunks for start, _ in chunks)
    assert not schedule.robust  # no claims: every member computes the robust sum itself
    config = load_config("debug", overrides=['comm.codec="sparse"'])
    assert (config.outer.momentum, config.outer.lr) == (0.0, 1.0)
    config = load_config("debug", overrides=['comm.codec="sparse"', "outer.momentum=0.5"])
    assert config.outer.momentum == 0.5


def expected_mean(
    inputs: list[np.ndarray],
    weights: list[float],
    *,
    clipped: bool = False,
    left_out: int = -1,
    scales: list[float] | None = None,
) -> np.ndarray:
    """The gather's result as every member computes it: Σ f_i · decode(share_i), in member order, fp32;
    `clipped`: each share scaled down to the median of the non-zero shares' norms where above it
    (comm.clip 1); `left_out`: that member's weight handed to the others; `scales`: what each
    member multiplied its input by before it encoded it (run_ring's "scale" fault)."""
    scales = scales or [1.0] * len(inputs)
    decoded = [
        sparse.reference_decode(sparse.reference_encode(values * np.float32(scale), CODE), values.size, CODE)
        for values, scale in zip(inputs, scales, strict=True)
    ]
    norms = [float(np.linalg.norm(values.astype(np.float64))) for values in decoded]
    limit = float(np.median([size for size in norms if size > 0])) if clipped else math.inf
    fractions = [float(np.float32(fraction)) for fraction in shares_of(weights)]
    handed = sum(fractions) / sum(f for member, f in enumerate(fractions) if member != left_out)
    result = np.zeros_like(inputs[0])
    for member, (fraction, values, size) in enumerate(zip(fractions, decoded, norms, strict=True)):
        if member != left_out and size > 0:
            result += np.float32(fraction * min(1.0, limit / size) * handed) * values
    return result


@pytest.mark.procs
@pytest.mark.parametrize("n", [2, 4])
def test_every_member_takes_the_same_mean_of_the_decoded_shares(tmp_path: Path, n: int) -> None:
    weights = [float(i + 1) for i in range(n)]
    length = 200_003
    outcomes, results, inputs = run_ring(tmp_path, n, length, weights=weights, comm=SPARSE)
    assert all(outcome.ok for outcome in outcomes.values()) and len(results) == n, outcomes
    first = results[0]
    assert all(np.array_equal(first.view(np.uint32), other.view(np.uint32)) for other in results.values())
    assert np.allclose(first, expected_mean(inputs, weights), rtol=0, atol=1e-6)
    # each member uploads its share once to each of the others: under a quarter bit per value each
    share = CODE.payload_size(length)
    assert all(outcome.bytes_sent == (n - 1) * share for outcome in outcomes.values())
    assert 8 * share / length < 0.25


@pytest.mark.procs
def test_a_malformed_share_is_left_out_by_every_member_alike(tmp_path: Path) -> None:
    outcomes, results, inputs = run_ring(
        tmp_path, 4, 100_000, comm=SPARSE, faults={3: ("malformed_share", 0)}
    )
    assert all(outcome.ok for outcome in outcomes.values()) and len(results) == 4, outcomes
    assert all(np.array_equal(results[0], other) for other in results.values())
    honest = expected_mean(inputs[:3], [1.0] * 3) * np.float32(3 / 4)  # its quarter of the weight: 0
    assert np.allclose(results[0], honest, rtol=0, atol=1e-6)


@pytest.mark.procs
def test_a_share_a_hundred_times_the_others_counts_as_one_typical_member(tmp_path: Path) -> None:
    comm = SPARSE.model_copy(update={"robust": "clip"})
    outcomes, results, _ = run_ring(tmp_path, 4, 100_000, comm=comm, faults={3: ("scale", 100)})
    assert all(outcome.ok for outcome in outcomes.values()) and len(results) == 4, outcomes
    assert all(np.array_equal(results[0], other) for other in results.values())
    assert all(outcome.clipped == {3: 1} for outcome in outcomes.values()), outcomes
    honest = np.linalg.norm(sparse.reference_decode(sparse.encode(vectors(100_000), CODE), 100_000, CODE))
    assert np.linalg.norm(results[0]) < 1.5 * honest


@pytest.mark.procs
@pytest.mark.parametrize("scale", [1, -1, 0])
def test_a_share_turned_against_the_others_or_empty_counts_for_nothing_and_honest_ones_keep_theirs(
    tmp_path: Path, scale: int
) -> None:
    """An open run's rule (reweighted) over inputs that share a direction, as pseudo-gradients do:
    member 3 sends the opposite of its own at its own norm (-1), where the norm clip holds nothing,
    or zeros with its full weight (0). Every member weighs it at nothing by its cosine with the
    shares' coordinate-wise median and hands its weight to the three others, alike; with every
    member honest (1), nobody is left out."""
    comm = SPARSE.model_copy(update={"robust": "reweighted"})
    faults = {3: ("scale", scale)} if scale != 1 else {}
    outcomes, results, inputs = run_ring(tmp_path, 4, 100_000, comm=comm, faults=faults, correlated=True)
    assert all(outcome.ok for outcome in outcomes.values()) and len(results) == 4, outcomes
    assert all(
        np.array_equal(results[0].view(np.uint32), other.view(np.uint32)) for other in results.values()
    )
    if scale != 1:
        expected = expected_mean(inputs, [1.0] * 4, clipped=True, left_out=3, scales=[1, 1, 1, scale])
        assert all(outcome.left_out == {3: 1} for outcome in outcomes.values()), outcomes
    else:
        expected = expected_mean(inputs, [1.0] * 4, clipped=True)
        assert all(not outcome.left_out and not outcome.clipped for outcome in outcomes.values()), outcomes
    assert np.allclose(results[0], expected, rtol=0, atol=1e-6)


@pytest.mark.procs
def test_a_share_a_tenth_of_the_others_keeps_weight_for_what_it_holds_and_the_step_does_not_shrink(
    tmp_path: Path,
) -> None:
    """Member 3 sends a tenth of its share (in the others' direction) with its full token count,
    as what is left of an accumulator that adds nothing would be: the direction rule keeps it, the
    size rule gives it a fifth of its weight (SMALL × a tenth) and hands the rest to the others, so
    the step keeps the honest members' size where the plain mean would shrink it by almost a
    quarter. Every member alike, and every member reports it left out (under half its weight)."""
    comm = SPARSE.model_copy(update={"robust": "reweighted"})
    outcomes, results, inputs = run_ring(
        tmp_path, 4, 100_000, comm=comm, faults={3: ("scale", 0.1)}, correlated=True
    )
    assert all(outcome.ok for outcome in outcomes.values()) and len(results) == 4, outcomes
    assert all(
        np.array_equal(results[0].view(np.uint32), other.view(np.uint32)) for other in results.values()
    )
    assert all(outcome.left_out == {3: 1} for outcome in outcomes.values()), outcomes
    honest = float(np.linalg.norm(expected_mean(inputs[:3], [1.0] * 3, clipped=True)))
    plain = float(np.linalg.norm(expected_mean(inputs, [1.0] * 4, scales=[1, 1, 1, 0.1])))
    assert plain < 0.85 * honest  # what the size rule is for
    assert 0.9 * honest < float(np.linalg.norm(results[0])) < 1.1 * honest


@pytest.mark.procs
@pytest.mark.parametrize("fault", ["equivocate", "equivocate_unsigned"])
def test_a_member_sending_one_member_another_share_fails_the_attempt_for_all_and_is_named(
    tmp_path: Path, fault: str
) -> None:
    """Equivocation: member 0 sends member 2 another share than the others. Signed as the honest
    one, member 2 names it at once; signed too, member 2 and member 3 (2's successor) find two
    shares signed by 0 in the testimonies of the barrier and name it. No member takes a result."""
    outcomes, results, _ = run_ring(tmp_path, 4, 100_000, comm=SPARSE, faults={0: (fault, 2)})
    assert not results, outcomes
    assert len(outcomes) == 4 and not any(outcome.ok for outcome in outcomes.values()), outcomes
    named = {index: outcome.named for index, outcome in outcomes.items()}
    assert named[2] == 0 and set(named.values()) <= {0, -1}, outcomes
    if fault == "equivocate":
        assert named[3] == 0 and "signed two different shares" in outcomes[2].error, outcomes
    else:
        assert "not the one it signed" in outcomes[2].error, outcomes


@pytest.mark.procs
def test_a_testimony_that_does_not_hold_up_names_the_member_that_gave_it(tmp_path: Path) -> None:
    """Member 1 shows its successor (2) share hashes with junk signatures: only member 1 could have
    written on its lane, so member 2 names it, and no honest member takes a result (the liar may:
    member 2 had sent its own holder's signature before it read member 1's frame, barrier.py)."""
    outcomes, results, _ = run_ring(tmp_path, 4, 100_000, comm=SPARSE, faults={1: ("bad_testimony", 0)})
    assert set(results) <= {1} and len(outcomes) == 4, outcomes
    assert not any(outcomes[honest].ok for honest in (0, 2, 3)), outcomes
    assert outcomes[2].named == 1 and "did not sign" in outcomes[2].error, outcomes
    assert {outcome.named for outcome in outcomes.values()} <= {1, -1}, outcomes


@pytest.mark.procs
@pytest.mark.parametrize("frames", [2, 24])
def test_a_member_killed_mid_gather_or_once_it_holds_every_share_leaves_nobody_a_result(
    tmp_path: Path, frames: int
) -> None:
    """Killed after 2 of the 24 frames it receives (3 peers × 4 segments × 2 frames), or after the
    last: the survivors fail within the failure bound of each other, and none takes a result."""
    comm = SPARSE.model_copy(update={"failure_timeout": 5.0})
    outcomes, results, _ = run_ring(tmp_path, 4, 200_000, comm=comm, faults={1: ("kill", frames)})
    assert sorted(outcomes) == [0, 2, 3] and results == {}, outcomes
    assert not any(outcome.ok for outcome in outcomes.values())
    failed = [outcome.failed_at for outcome in outcomes.values()]
    assert max(failed) - min(failed) < 5.0


@pytest.mark.procs
def test_members_behind_nat_gather_through_dials_and_relays(tmp_path: Path) -> None:
    outcomes, results, inputs = run_ring(tmp_path, 4, 100_000, comm=SPARSE, behind_nat=frozenset({1, 3}))
    assert all(outcome.ok for outcome in outcomes.values()) and len(results) == 4, outcomes
    assert all(np.array_equal(results[0], other) for other in results.values())
    assert np.allclose(results[0], expected_mean(inputs, [1.0] * 4), rtol=0, atol=1e-6)
    assert sum(outcome.relayed for outcome in outcomes.values()) > 0
