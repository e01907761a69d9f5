"""The Llama-style model: shapes, parameter counts, the configs, and that it learns."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from p2ptrain.config import CONFIG_DIR, load_config, parameter_count, validate_shape
from p2ptrain.train.model import Transformer
from p2ptrain.train.optim import lr_factor
from p2ptrain.train.trainer import RankContext, Trainer
from tests.support.helpers import LIGHT_SETTINGS


def test_forward_shapes_and_causality() -> None:
    config = load_config("debug").model
    model = Transformer(config)
    tokens = torch.randint(0, config.vocab_size, (2, 16))
    logits = model(tokens)
    assert logits.shape == (2, 16, config.vocab_size)
    # changing the last token must not change the logits of earlier positions
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % config.vocab_size
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1])
    targets = torch.randint(0, config.vocab_size, (2, 16))
    loss = float(model(tokens, targets).detach())
    assert abs(loss - math.log(config.vocab_size)) < 1.0  # near-uniform at initialisation


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_formula_matches_the_model(tied: bool) -> None:
    config = load_config("debug", overrides=[f"model.tie_embeddings={str(tied).lower()}"]).model
    assert parameter_count(config) == sum(p.numel() for p in Transformer(config).parameters())


@pytest.mark.parametrize(
    ("name", "low", "high"),
    [
        ("debug", 0.5e6, 1.5e6),
        ("20m", 15e6, 30e6),
        ("150m", 100e6, 200e6),
        ("1b", 0.9e9, 1.3e9),
        ("7b", 6e9, 7.5e9),
        ("10b", 9.5e9, 11e9),
    ],
)
def test_bundled_configs_have_their_size(name: str, low: float, high: float) -> None:
    config = load_config(CONFIG_DIR / f"{name}.toml")
    validate_shape(config.model)
    assert low <= parameter_count(config.model) <= high


def test_bad_shapes_name_the_field() -> None:
    with pytest.raises(ValueError, match="n_kv_heads"):
        validate_shape(load_config("debug", overrides=["model.n_kv_heads=3"]).model)
    with pytest.raises(ValueError, match=r"model\.dim"):
        validate_shape(load_config("debug", overrides=["model.dim=130"]).model)


def test_same_seed_same_initial_model() -> None:
    config = load_config("debug").model
    torch.manual_seed(3)
    first = torch.cat([p.flatten() for p in Transformer(config).parameters()])
    torch.manual_seed(3)
    second = torch.cat([p.flatten() for p in Transformer(config).parameters()])
    assert torch.equal(first, second)


def test_schedule_warms_up_then_decays() -> None:
    assert lr_factor(0, 10, 100) == pytest.approx(0.1)
    assert lr_factor(9, 10, 100) == pytest.approx(1.0)
    assert lr_factor(55, 10, 100) == pytest.approx(0.55)
    assert lr_factor(100, 10, 100) == pytest.approx(0.1)


@pytest.mark.procs
def test_loss_decreases_on_the_debug_config(tmp_path: Path) -> None:
    torch.set_num_threads(1)  # one pytest worker per core: two threads each oversubscribe them
    config = load_config("debug", overrides=[*LIGHT_SETTINGS, "train.max_steps=40", 'checkpoint.staging=""'])
    trainer = Trainer(config, node_key=b"n" * 32, work_dir=tmp_path, ctx=RankContext())
    first = trainer.inner_step_once()
    trainer.run()
    assert trainer.outer_step == 4
    assert trainer.last_loss < first - 1.0, (first, trainer.last_loss)


def test_time_box_ends_the_inner_phase_early(tmp_path: Path) -> None:
    config = load_config(
        "debug", overrides=["train.inner_steps=1000", "train.max_steps=1000", "train.time_box=0.3"]
    )
    trainer = Trainer(config, node_key=b"t" * 32, work_dir=tmp_path, ctx=RankContext())
    tokens, _ = trainer.inner_phase()
    steps = tokens // trainer.tokens_per_step
    assert 1 <= steps < 1000 and steps == trainer.inner_step


def test_activation_checkpointing_gives_the_same_gradients() -> None:
    config = load_config("debug").model
    tokens = torch.randint(0, config.vocab_size, (2, 32))
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = Transformer(config, activation_checkpointing=checkpointing)
        model(tokens, tokens).backward()
        flat = []
        for p in model.parameters():
            assert p.grad is not None
            flat.append(p.grad.flatten())
        grads.append(torch.cat(flat))
    torch.testing.assert_close(grads[0], grads[1])
