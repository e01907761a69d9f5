"""Robust aggregation against dishonest members, each a real process running modified code (ring_procs.lie):
an owner that does not clip, a member that claims less than it sends, a member that changes what it
passes on. Every member checks what it gets against the signed claims and signatures (claims.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from p2ptrain.config import CommConfig
from tests.support.ring_procs import BUDGET, relative_error, run_ring, weighted_mean

pytestmark = pytest.mark.procs
"""Every test here starts processes."""

N, LENGTH = 4, 100_003  # 2 chunks a segment at 64 KiB chunks


@pytest.mark.parametrize("connections", [1, 2])
def test_an_owner_that_does_not_clip_is_named_by_every_other_member_and_nothing_is_applied(
    tmp_path: Path, connections: int
) -> None:
    """Member 2 sends 100 × its values and sums its own segment without clipping: the others' checks
    of that segment against the bound from the claims it forwarded fail, naming it; nobody applies
    anything (a result is saved only on success)."""
    comm = CommConfig(chunk_bytes=1 << 16, robust="reweighted", clip=1.0, connections=connections)
    outcomes, results, _ = run_ring(tmp_path, N, LENGTH, comm=comm, faults={2: ("lying_owner", 100)})
    honest = [0, 1, 3]
    assert all(not outcomes[i].ok for i in honest), outcomes
    assert all(outcomes[i].named == 2 for i in honest), outcomes
    assert all("above the clip rule's bound" in outcomes[i].error for i in honest), outcomes
    assert set(results) <= {2}, "no honest member applied the result"


def test_a_member_that_claims_less_than_it_sends_is_cut_to_its_claim(tmp_path: Path) -> None:
    """Member 3 sends 100 × its values but claims their honest norm: with clip 2 its share would
    count as 2 typical ones; cut to its own claim it counts as about one, and everyone agrees."""
    comm = CommConfig(chunk_bytes=1 << 16, robust="clip", clip=2.0)
    outcomes, results, inputs = run_ring(tmp_path, N, LENGTH, comm=comm, faults={3: ("low_claims", 100)})
    assert all(outcome.ok for outcome in outcomes.values()), outcomes
    assert all(
        np.array_equal(results[0].view(np.uint32), other.view(np.uint32)) for other in results.values()
    )
    assert relative_error(results[0], weighted_mean(inputs, [1.0] * N)) <= 0.05


def test_a_member_that_changes_a_chunk_it_passes_on_is_named_by_the_next(tmp_path: Path) -> None:
    """Member 1 flips a byte of every all-gather chunk it forwards: member 2 finds the owner's
    signature broken and names member 1; no member holds a changed result."""
    comm = CommConfig(chunk_bytes=1 << 16, robust="reweighted", clip=1.0)
    outcomes, results, inputs = run_ring(tmp_path, N, LENGTH, comm=comm, faults={1: ("tamper_forward", 0)})
    assert not outcomes[2].ok and outcomes[2].named == 1, outcomes
    assert "does not carry its owner's signature" in outcomes[2].error
    exact = weighted_mean(inputs, [1.0] * N)
    assert all(relative_error(result, exact) <= BUDGET for result in results.values())
