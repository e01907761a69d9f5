"""The int8 ring all-reduce against torch.distributed gloo (fp32), 3 processes on 127.0.0.1.

    python -m benchmarks.allreduce --json [--mib 64] [--rounds 5]

Every process holds its own N(0,1) fp32 vector; the figures are medians over the rounds of the
slowest member's time (a barrier starts each round). `rel_err` is the ring's relative L2 error
against the exact fp32 mean.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import parser, report

WORLD = 3


def _data(rank: int, length: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(length).astype(np.float32)


def _worker(
    rank: int, length: int, rounds: int, root: str, port: int, queue: Any, barrier: Any, members_q: Any
) -> None:
    import torch
    import torch.distributed as dist

    from p2ptrain.comm.ring import DataPlaneServer, RingSettings, ring_all_reduce
    from p2ptrain.identity import load_or_create_identity

    torch.set_num_threads(1)
    data = _data(rank, length)

    async def ring_rounds() -> list[float]:
        identity = load_or_create_identity(Path(root) / f"id{rank}")
        server = DataPlaneServer(identity, RingSettings())
        host, listen_port = await server.start()
        queue.put(("address", rank, identity.public_key, host, listen_port))
        members = await asyncio.get_running_loop().run_in_executor(None, members_q.get)
        times = []
        buffer = data.copy()
        for step in range(rounds + 1):
            np.copyto(buffer, data)
            await asyncio.get_running_loop().run_in_executor(None, barrier.wait)
            started = time.perf_counter()
            await ring_all_reduce(server, step, members, buffer)
            times.append(time.perf_counter() - started)
        await server.close()
        if rank == 0:
            np.save(Path(root) / "ring.npy", buffer)
        return times[1:]

    ring_times = asyncio.run(ring_rounds())
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    tensor = torch.from_numpy(data.copy())
    gloo_times = []
    for _ in range(rounds + 1):
        tensor.copy_(torch.from_numpy(data))
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        gloo_times.append(time.perf_counter() - started)
    dist.destroy_process_group()
    queue.put(("times", rank, ring_times, gloo_times[1:]))


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run(mib: int, rounds: int) -> dict[str, Any]:
    from p2ptrain.comm.ring import RingMember

    length = (mib << 20) // 4
    context = mp.get_context("spawn")
    queue, members_q, barrier = (
        context.Queue(),
        [context.Queue() for _ in range(WORLD)],
        context.Barrier(WORLD),
    )
    port = _free_port()
    with tempfile.TemporaryDirectory() as root:
        processes = [
            context.Process(
                target=_worker, args=(rank, length, rounds, root, port, queue, barrier, members_q[rank])
            )
            for rank in range(WORLD)
        ]
        for process in processes:
            process.start()
        try:
            addresses = {}
            while len(addresses) < WORLD:
                _, rank, key, host, listen_port = queue.get(timeout=120)
                addresses[rank] = RingMember(key, host, listen_port)
            for inbox in members_q:
                inbox.put([addresses[rank] for rank in range(WORLD)])
            ring_times: list[list[float]] = []
            gloo_times: list[list[float]] = []
            for _ in range(WORLD):
                _, rank, ring, gloo = queue.get(timeout=600)
                ring_times.append(ring)
                gloo_times.append(gloo)
            result = np.load(Path(root) / "ring.npy")
        finally:
            for process in processes:
                process.join(timeout=30)
                if process.is_alive():
                    process.kill()
    exact = np.mean([_data(rank, length).astype(np.float64) for rank in range(WORLD)], axis=0)
    slowest = lambda per_rank: statistics.median(max(r[i] for r in per_rank) for i in range(rounds))  # noqa: E731
    ring_s, gloo_s = slowest(ring_times), slowest(gloo_times)
    return {
        "members": WORLD,
        "mib": mib,
        "rounds": rounds,
        "cpus": os.cpu_count(),
        "int8_ring_s": round(ring_s, 4),
        "gloo_fp32_s": round(gloo_s, 4),
        "ring_vs_gloo": round(ring_s / gloo_s, 2),
        "rel_err": round(float(np.linalg.norm(result - exact) / np.linalg.norm(exact)), 5),
    }


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--mib", type=int, default=64, help="fp32 buffer size per member (MiB)")
    arguments.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up)")
    arguments.add_argument(
        "--bandwidth", type=float, help="(not implemented yet) limit links to MBIT with tc"
    )
    args = arguments.parse_args()
    if args.bandwidth is not None:
        report(
            {"skipped": True, "reason": "--bandwidth (tc-limited network namespaces) is not implemented yet"},
            args.json,
        )
        return
    report(run(args.mib, args.rounds), args.json)


if __name__ == "__main__":
    main()
