"""Entry point of one trainer rank (`python -m p2ptrain.train.rank`), started by the node agent.

torchrun-style environment: RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; plus
P2PTRAIN_RANK_SPEC (a JSON file: resolved config, node key, work dir, shared buffer path),
P2PTRAIN_AGENT_PID (the rank dies with the agent) and, for rank 0, P2PTRAIN_CHANNEL_FD.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from p2ptrain.channel import ChannelError, RankChannel
from p2ptrain.ckpt.format import CheckpointError
from p2ptrain.config import Config
from p2ptrain.faults import shift_wall_clock
from p2ptrain.memory_limits import OUT_OF_MEMORY_EXIT
from p2ptrain.procs import set_parent_death_signal
from p2ptrain.train.agent_link import ChannelLink
from p2ptrain.train.out_of_memory import is_out_of_memory, raised_out_of_memory_line
from p2ptrain.train.trainer import RankContext, Trainer


def _context(rank: int, world_size: int) -> RankContext:
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
    cpu_group = None
    if world_size > 1:
        dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timedelta(minutes=10))
        cpu_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
    return RankContext(rank=rank, world_size=world_size, device=device, cpu_group=cpu_group)


def main() -> int:
    set_parent_death_signal(signal.SIGKILL)
    shift_wall_clock()  # the host's clock, as the agent sees it (a fault hook for tests)
    if os.getppid() != int(os.environ.get("P2PTRAIN_AGENT_PID", os.getppid())):
        return 1  # the agent died before the death signal was armed
    spec = json.loads(Path(os.environ["P2PTRAIN_RANK_SPEC"]).read_text())
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(int(spec["threads"]))
    config = Config.model_validate(spec["config"])
    ctx = _context(rank, world_size)
    link = None
    if rank == 0:
        sock = socket.socket(fileno=int(os.environ["P2PTRAIN_CHANNEL_FD"]))
        link = ChannelLink(RankChannel(sock), Path(spec["buffer_path"]))
    done = False
    trainer: Trainer | None = None
    try:
        resume = Path(spec["resume"]) if spec.get("resume") else None
        trainer = Trainer(
            config,
            node_key=bytes.fromhex(spec["node_key"]),
            work_dir=Path(spec["work_dir"]),
            ctx=ctx,
            link=link,
            resume=resume,
            own_data=not spec.get("skip_first_inner"),
        )
        trainer.run(skip_first_inner=bool(spec.get("skip_first_inner")))
        if dist.is_initialized():
            dist.barrier()  # every rank is done with the group
        done = True
    except ChannelError as exc:
        print(f"rank {rank}: {exc}; stopping", file=sys.stderr)
        return 1
    except CheckpointError as exc:
        print(f"rank {rank}: error: {exc}", file=sys.stderr)
        return 1
    except (RuntimeError, MemoryError) as exc:
        if not is_out_of_memory(exc):
            raise
        chosen = config.train.micro_batch
        micro = trainer.micro_batch if trainer is not None else chosen if isinstance(chosen, int) else 0
        line = raised_out_of_memory_line(
            rank, exc, config=config, micro_batch=micro, on_gpu=ctx.device.type == "cuda"
        )
        print(line, file=sys.stderr)
        return OUT_OF_MEMORY_EXIT
    finally:
        if not done and dist.is_initialized():
            dist.destroy_process_group()
    exit_without_teardown(0)


def exit_without_teardown(code: int) -> NoReturn:
    """Exit once all ranks passed the final barrier and every file is written and closed.

    Tearing gloo down (destroy_process_group, or the interpreter's own finalisation) can abort a
    rank with SIGABRT ("terminate called without an active exception") while gloo's threads are
    still winding down, seen on 2 cores under load; the work is done, so skip the teardown.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
