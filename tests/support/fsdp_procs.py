"""Worker processes for the FSDP2 tests: real gloo process groups of 1 to 3 local ranks on 127.0.0.1."""

from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from p2ptrain.config import load_config
from p2ptrain.procs import free_port
from p2ptrain.train.layout import CanonicalLayout
from p2ptrain.train.rank import exit_without_teardown
from p2ptrain.train.trainer import RankContext, Trainer, build_model

TINY = [
    "model.dim=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=160",
    "model.seq_len=32",
    "train.batch_size=6",
    "train.warmup_steps=2",
    'checkpoint.staging=""',
]


def _worker(
    rank: int, world: int, port: int, mode: str, out: str, overrides: list[str], resume: str | None
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    group = None
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        group = dist.group.WORLD
    ctx = RankContext(rank=rank, world_size=world, device=torch.device("cpu"), cpu_group=group)
    config = load_config("debug", overrides=TINY + overrides)
    try:
        if mode == "layout":
            model = build_model(config, ctx)
            layout = CanonicalLayout.of(model)
            initial = layout.new_flat() if rank == 0 else None
            layout.gather(model, initial)
            target = torch.randn(layout.numel, generator=torch.Generator().manual_seed(7))
            layout.scatter(model, target)
            again = layout.new_flat() if rank == 0 else None
            layout.gather(model, again)
            result: dict[str, torch.Tensor | float | str | None] = {
                "initial": initial,
                "target": target,
                "again": again,
                "digest": layout.digest(),
            }
        else:
            work = Path(out).parent / f"work-{world}{'-resumed' if resume else ''}"
            trainer = Trainer(
                config, node_key=b"k" * 32, work_dir=work, ctx=ctx, resume=Path(resume) if resume else None
            )
            trainer.run()
            result = {"params": trainer.outer.params if rank == 0 else None, "loss": trainer.last_loss}
        if rank == 0:
            torch.save(result, out)
        if dist.is_initialized():
            dist.barrier()
    except BaseException:
        if dist.is_initialized():
            dist.destroy_process_group()
        raise
    exit_without_teardown(0)  # gloo's teardown can SIGABRT a finished rank (see the function)


def run_world(
    world: int,
    mode: str,
    out: Path,
    overrides: list[str] = (),  # type: ignore[assignment]
    resume: Path | None = None,
) -> dict:
    """Run `mode` ("layout" or "train") on `world` local ranks; returns rank 0's result."""
    args = (world, free_port(), mode, str(out), list(overrides), str(resume) if resume else None)
    spawn(_worker, args=args, nprocs=world, join=True)
    return torch.load(out, weights_only=False)
