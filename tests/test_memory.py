"""Micro-batches, the chunked loss, the memory estimate and out-of-memory said plainly."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch.autograd.graph import saved_tensors_hooks

from p2ptrain.config import load_config
from p2ptrain.train.memory import (
    SAFETY,
    balanced_micro_batch,
    choose_micro_batch,
    estimate,
    saved_per_token_layer,
)
from p2ptrain.train.model import Block, rotary_tables, summed_cross_entropy
from p2ptrain.train.out_of_memory import is_out_of_memory
from p2ptrain.train.trainer import RankContext, Trainer
from tests.support.helpers import assert_one_line_error, cli


def saved_bytes(config_name: str, seq: int) -> int:
    """Bytes autograd saves for one block's backward at `seq` tokens (parameters not counted)."""
    model = load_config(config_name).model
    block = Block(model)
    params = {param.untyped_storage().data_ptr() for param in block.parameters()}
    x = torch.randn(1, seq, model.dim, requires_grad=True)
    cos, sin = rotary_tables(model.dim // model.n_heads, seq, model.rope_theta)
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        block(x, cos, sin)
    return sum(storages.values())


@pytest.mark.parametrize("config_name", ["debug", "150m"])
def test_the_activation_count_is_what_autograd_keeps(config_name: str) -> None:
    # per token: the difference between two lengths drops what does not grow with the sequence
    per_token = (saved_bytes(config_name, 128) - saved_bytes(config_name, 64)) / 64
    model = load_config(config_name).model
    rotary_tables_per_token = 2 * 4 * (model.dim // model.n_heads)  # cos and sin rows, shared by layers
    assert per_token - rotary_tables_per_token == saved_per_token_layer(model, half=False)


@pytest.mark.procs
def test_micro_batches_give_the_one_batch_update(tmp_path: Path) -> None:
    torch.set_num_threads(1)  # one pytest worker per core: two threads each oversubscribe them
    params: dict[int, tuple[torch.Tensor, list[float]]] = {}
    for micro in (8, 3, 1):  # 3: passes of 3, 3 and 2 sequences
        overrides = ["train.max_steps=2", f"train.micro_batch={micro}", 'checkpoint.staging=""']
        config = load_config("debug", overrides=overrides)
        trainer = Trainer(config, node_key=b"m" * 32, work_dir=tmp_path / str(micro), ctx=RankContext())
        assert trainer.micro_batch == micro
        initial = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        losses = [trainer.inner_step_once() for _ in range(2)]
        params[micro] = (torch.cat([p.detach().flatten() for p in trainer.model.parameters()]), losses)
    whole, whole_losses = params[8]
    assert not torch.allclose(whole, initial)  # the steps did move the weights
    for micro in (3, 1):
        split, losses = params[micro]
        assert losses == pytest.approx(whole_losses, rel=1e-5)
        torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-6)


def test_the_chunked_loss_is_the_whole_loss() -> None:
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(3, 40, 16, generator=generator, requires_grad=True)
    weight = torch.randn(500, 16, generator=generator, requires_grad=True)
    targets = torch.randint(0, 500, (3, 40), generator=generator)
    results = []
    for chunk in (0, 7, 120):
        loss = summed_cross_entropy(hidden, weight, targets, chunk=chunk)
        hidden_grad, weight_grad = torch.autograd.grad(loss, (hidden, weight))
        results.append((loss.detach(), hidden_grad, weight_grad))
    for loss, hidden_grad, weight_grad in results[1:]:
        torch.testing.assert_close(loss, results[0][0])
        torch.testing.assert_close(hidden_grad, results[0][1])
        torch.testing.assert_close(weight_grad, results[0][2])


def test_auto_takes_the_fewest_passes_that_fit() -> None:
    config = load_config("20m", overrides=["train.batch_size=8"])
    needs = {micro: estimate(config, micro).device for micro in range(1, 9)}
    assert all(needs[micro] < needs[micro + 1] for micro in range(1, 8))
    assert choose_micro_batch(config, int(needs[8] / SAFETY) + 1) == 8
    assert choose_micro_batch(config, int(needs[5] / SAFETY) + 1) == 4  # 2 passes of 4, not 5 + 3
    assert choose_micro_batch(config, int(needs[3] / SAFETY) + 1) == 3  # 3 + 3 + 2
    assert choose_micro_batch(config, 1 << 20) == 1  # nothing fits: the smallest, and a warning
    assert (
        choose_micro_batch(
            config.model_copy(update={"train": config.train.model_copy(update={"micro_batch": 2})}), 1 << 20
        )
        == 2
    )
    assert [balanced_micro_batch(32, largest) for largest in (32, 31, 16, 11, 1)] == [32, 16, 16, 11, 1]


def test_an_allocator_refusal_counts_as_out_of_memory() -> None:
    with pytest.raises(RuntimeError) as refused:
        torch.empty(1 << 60, dtype=torch.uint8)  # more than any address space
    assert is_out_of_memory(refused.value)
    assert not is_out_of_memory(RuntimeError("shape mismatch"))


@pytest.mark.procs
def test_a_rank_that_cannot_allocate_says_it_ran_out_of_memory(tmp_path: Path) -> None:
    # 2^40 × 128 fp32 embedding weights: more than any address space, refused on every machine
    huge = ["--set", "model.vocab_size=1099511627776", "--set", "train.micro_batch=8"]
    result = cli("join", "--config", "debug", "--work-dir", str(tmp_path), *huge, timeout=90)
    assert_one_line_error(
        result, "rank 0: ran out of memory (it asked for 512.00 TiB more", "lower train.micro_batch (it was 8"
    )


@pytest.fixture
def memory_cgroup() -> Iterator[Path]:
    """A memory cgroup of 1.5 GiB made for the test (v1 or v2), removed afterwards."""
    roots = [Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")]
    folder = None
    for root in roots:
        limit_file = "memory.limit_in_bytes" if root.name == "memory" else "memory.max"
        candidate = root / f"p2ptrain-test-{os.getpid()}"
        try:
            candidate.mkdir()
        except OSError:
            continue
        try:
            (candidate / limit_file).write_text(str(1536 << 20))
            folder = candidate
            break
        except OSError:
            candidate.rmdir()
    if folder is None:
        pytest.skip("no writable memory cgroup here (needs root and cgroup v1 or v2 with memory)")
    try:
        yield folder
    finally:
        for pid in (folder / "cgroup.procs").read_text().split():
            os.kill(int(pid), signal.SIGKILL)
        for _ in range(100):
            try:
                folder.rmdir()
                break
            except OSError:
                os.sched_yield()


@pytest.mark.procs
def test_oom_killed_rank_is_said_plainly_and_auto_fits_the_limit(tmp_path: Path, memory_cgroup: Path) -> None:
    inside = ("sh", "-c", f'echo $$ > {memory_cgroup}/cgroup.procs && exec "$@"', "sh")
    # about 0.2 GiB of activations per sequence (a 4096-wide feed-forward over 1024 tokens): 8 in one
    # pass need ~2 GiB, the cgroup has 1.5. A 64-wide model keeps the arithmetic per byte small.
    shape = [
        "model.dim=64",
        "model.n_layers=2",
        "model.ffn_dim=4096",
        "model.seq_len=1024",
        "train.batch_size=8",
        "train.inner_steps=1",
        "train.max_steps=1",
    ]
    settings = [item for pair in shape for item in ("--set", pair)]
    base = ["join", "--config", "debug", *settings]
    killed = cli(
        *base, "--work-dir", str(tmp_path / "a"), "--set", "train.micro_batch=8", timeout=120, prefix=inside
    )
    said = (
        "rank 0 ran out of memory: the kernel's OOM killer ended it",
        "1.50 GiB is the memory this node may use",
    )
    assert_one_line_error(killed, *said, "lower train.micro_batch (it was 8")
    fitted = cli(*base, "--work-dir", str(tmp_path / "b"), timeout=180, prefix=inside)
    assert fitted.returncode == 0, fitted.stderr
    chosen = re.search(r"memory: about [0-9.]+ GiB per rank at micro-batch (\d+) of 8", fitted.stdout)
    assert chosen and 1 <= int(chosen.group(1)) < 8, fitted.stdout
