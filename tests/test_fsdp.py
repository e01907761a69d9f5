"""FSDP2 over 1, 2 and 3 local CPU ranks (real gloo groups): the canonical layout and the inner loop."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.support.fsdp_procs import run_world


@pytest.mark.procs
def test_canonical_layout_round_trip_for_world_sizes_1_2_3(tmp_path: Path) -> None:
    results = {world: run_world(world, "layout", tmp_path / f"layout-{world}.pt") for world in (1, 2, 3)}
    reference = results[1]
    for world, result in results.items():
        # the same initial model, gathered into the same vector, whatever the sharding
        assert result["digest"] == reference["digest"], world
        assert torch.equal(result["initial"], reference["initial"]), world
        # a vector scattered into the shards comes back out bit for bit
        assert torch.equal(result["again"], result["target"]), world
    assert not torch.equal(reference["initial"], reference["target"])


@pytest.mark.procs
def test_two_rank_fsdp_training_matches_one_rank(tmp_path: Path) -> None:
    """3 outer steps of H=2 on the same data: the sharded node ends where the unsharded one does,
    although its ranks take their share in micro-batches (2 + 1 sequences) and compute the loss in
    chunks of 12 tokens (the unsharded one in one pass and one piece)."""
    overrides = ["train.inner_steps=2", "train.max_steps=6"]
    one = run_world(1, "train", tmp_path / "one.pt", [*overrides, "train.loss_chunk=0"])
    two = run_world(
        2, "train", tmp_path / "two.pt", [*overrides, "train.micro_batch=2", "train.loss_chunk=12"]
    )
    assert one["params"].shape == two["params"].shape
    torch.testing.assert_close(two["params"], one["params"], rtol=1e-4, atol=2e-5)
    assert abs(one["loss"] - two["loss"]) < 1e-3


@pytest.mark.procs
def test_a_two_rank_checkpoint_resumes_on_one_rank(tmp_path: Path) -> None:
    overrides = ["train.inner_steps=2", "train.max_steps=6"]
    two = run_world(2, "train", tmp_path / "two.pt", overrides)
    middle = tmp_path / "work-2" / "checkpoints" / "step-00000001"
    one = run_world(1, "train", tmp_path / "one.pt", overrides, resume=middle)
    torch.testing.assert_close(one["params"], two["params"], rtol=1e-4, atol=2e-5)
