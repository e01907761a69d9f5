"""Checkpoints: exact resume, atomic writes, pruning, and refusal of unusable folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from p2ptrain.ckpt.format import INNER_FILE, CheckpointError, checkpoint_places, latest_checkpoint
from p2ptrain.config import load_config
from p2ptrain.node.checkpoint_copies import flush_leftovers
from p2ptrain.train import checkpoint as checkpoint_module
from p2ptrain.train import trainer as trainer_module
from p2ptrain.train.checkpoint import load_state
from p2ptrain.train.optim import InnerAdamW, TorchAdamW
from p2ptrain.train.trainer import RankContext, Trainer
from tests.support.helpers import LIGHT_SETTINGS


@pytest.mark.procs
@pytest.mark.parametrize(
    ("overlap", "merge_after", "on_arrival"),
    [(False, 0, False), (True, 0, False), (True, 3, False), (True, 0, True)],
)
def test_n_steps_straight_equal_half_then_resume_then_half(
    tmp_path: Path, overlap: bool, merge_after: int, on_arrival: bool
) -> None:
    """With outer.overlap a checkpoint of S holds the step this node had handed over (its Δ) and
    where the next inner phase started: the resumed node hands it over again and goes on from there
    (with outer.overlap.steps it takes the pending step that many inner steps in, as straight; on
    arrival, after one: a node's own link has the answer at once)."""
    torch.set_num_threads(1)
    config = load_config(
        "debug",
        overrides=[
            *LIGHT_SETTINGS,
            "train.max_steps=40",
            "checkpoint.keep=3",
            'checkpoint.staging=""',
            f"outer.overlap.enabled={str(overlap).lower()}",
            f"outer.overlap.steps={merge_after}",
            f"outer.overlap.take_on_arrival={str(on_arrival).lower()}",
        ],
    )
    straight = Trainer(config, node_key=b"k" * 32, work_dir=tmp_path / "straight", ctx=RankContext())
    straight.run()
    folder = tmp_path / "straight" / "checkpoints"
    # every outer step saved, the newest 3 kept, nothing half-written left behind
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002", "step-00000003", "step-00000004"]
    assert latest_checkpoint(folder) == folder / "step-00000004"

    resumed = Trainer(
        config,
        node_key=b"k" * 32,
        work_dir=tmp_path / "resumed",
        ctx=RankContext(),
        resume=folder / "step-00000002",
    )
    # with overlap, S of step 2 is taken at the end of phase 2 (its Δ pending), one phase later
    assert (resumed.outer_step, resumed.inner_step) == (2, 30 if overlap else 20)
    if overlap:
        pending = json.loads((folder / "step-00000002" / "meta.json").read_text())["pending"]
        assert pending["step"] == 2 and pending["tokens"] > 0
    resumed.run()
    assert resumed.outer.params_hash() == straight.outer.params_hash()
    assert torch.equal(resumed.outer.momentum_buffer, straight.outer.momentum_buffer)
    meta = json.loads((folder / "step-00000004" / "meta.json").read_text())
    assert meta["outer_step"] == 4 and meta["inner_step"] == 40
    assert meta["data_position"]["streams"][0]["files_done"] >= 0


@pytest.mark.parametrize("fused", [True, False])
def test_the_gpu_optimizer_path_saves_and_restores_its_moments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fused: bool
) -> None:
    """The GPU ranks' torch.optim.AdamW (fused; foreach too), run here on CPU: its moments and step
    count go into the checkpoint and come back, so a node resumed from one goes on exactly as one
    that ran straight; and a CPU node's plain AdamW loads the same moments from it."""
    torch.set_num_threads(1)
    monkeypatch.setattr(
        trainer_module,
        "inner_optimizer",
        lambda model, config, device: TorchAdamW(model, config, fused=fused),
    )
    overrides = [*LIGHT_SETTINGS, "train.max_steps=8", "train.inner_steps=2", "checkpoint.keep=4"]
    config = load_config("debug", overrides=[*overrides, 'checkpoint.staging=""'])
    straight = Trainer(config, node_key=b"k" * 32, work_dir=tmp_path / "straight", ctx=RankContext())
    straight.run()
    assert isinstance(straight.optimizer, TorchAdamW)
    saved = tmp_path / "straight" / "checkpoints" / "step-00000002"
    _, state, _ = load_state(saved, straight.layout)
    resumed = Trainer(
        config, node_key=b"k" * 32, work_dir=tmp_path / "resumed", ctx=RankContext(), resume=saved
    )
    assert isinstance(resumed.optimizer, TorchAdamW) and resumed.optimizer.steps_taken == 4
    _assert_moments_are(resumed, state)
    resumed.run()
    assert resumed.outer.params_hash() == straight.outer.params_hash()
    monkeypatch.undo()
    plain = Trainer(config, node_key=b"k" * 32, work_dir=tmp_path / "plain", ctx=RankContext(), resume=saved)
    assert isinstance(plain.optimizer, InnerAdamW) and plain.optimizer.steps_taken == 4
    _assert_moments_are(plain, state)


def _assert_moments_are(trainer: Trainer, state: dict[str, torch.Tensor]) -> None:
    """The trainer's AdamW moments are the checkpoint's (`state`: its state vectors)."""
    for key, tensors in trainer.adam_moments().items():
        gathered = trainer.layout.new_flat()
        trainer.layout.gather_tensors(tensors, gathered)
        assert torch.equal(gathered, state[f"adam_{key}"]), key


def test_unusable_checkpoints_are_refused(tmp_path: Path) -> None:
    config = load_config(
        "debug", overrides=["train.max_steps=1", "train.inner_steps=1", 'checkpoint.staging=""']
    )
    trainer = Trainer(config, node_key=b"k" * 32, work_dir=tmp_path / "node", ctx=RankContext())
    trainer.run()
    saved = latest_checkpoint(tmp_path / "node" / "checkpoints")
    assert saved is not None
    other = Trainer(
        load_config("debug", overrides=["model.n_layers=2"]),
        node_key=b"k" * 32,
        work_dir=tmp_path / "o",
        ctx=RankContext(),
    )
    with pytest.raises(CheckpointError, match="another model"):
        load_state(saved, other.layout)
    (saved / INNER_FILE).write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="unreadable state file"):
        load_state(saved, trainer.layout)
    (saved / INNER_FILE).unlink()
    with pytest.raises(CheckpointError, match="can be exported but not resumed"):
        load_state(saved, trainer.layout)
    with pytest.raises(CheckpointError, match="not a p2ptrain checkpoint"):
        load_state(tmp_path, trainer.layout)


def test_staged_checkpoints_stay_in_ram_until_flushed_to_disk(tmp_path: Path) -> None:
    ram = tmp_path / "ram" / "checkpoints"
    overrides = ["train.max_steps=3", "train.inner_steps=1", f'checkpoint.staging="{ram}"']
    config = load_config("debug", overrides=[*overrides, f'checkpoint.dir="{tmp_path / "disk"}"'])
    Trainer(config, node_key=b"s" * 32, work_dir=tmp_path / "node", ctx=RankContext()).run()
    places = checkpoint_places(config, "node")
    assert places.staging == ram
    assert sorted(p.name for p in ram.iterdir()) == ["step-00000002", "step-00000003"]  # newest two
    assert not (tmp_path / "disk").exists()  # the agent copies; here nobody did: as after a SIGKILL
    assert places.latest() == ram / "step-00000003"
    flush_leftovers(places, keep=3)
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["step-00000002", "step-00000003"]
    assert not ram.exists()
    assert places.latest() == tmp_path / "disk" / "step-00000003"


def test_a_failed_write_never_becomes_the_latest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = load_config(
        "debug", overrides=["train.max_steps=2", "train.inner_steps=1", 'checkpoint.staging=""']
    )
    real_save = save_file

    def crash_in_step_2(
        tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str] | None = None
    ) -> None:
        if "step-00000002" in path and path.endswith(INNER_FILE):
            raise OSError("disk full")
        real_save(tensors, path, metadata)

    monkeypatch.setattr(checkpoint_module, "save_file", crash_in_step_2)
    trainer = Trainer(config, node_key=b"f" * 32, work_dir=tmp_path, ctx=RankContext())
    with pytest.raises(OSError, match="disk full"):
        trainer.run()  # the writer thread's error surfaces on the training thread
    folder = tmp_path / "checkpoints"
    assert latest_checkpoint(folder) == folder / "step-00000001"
    assert not (folder / "step-00000002").exists()
