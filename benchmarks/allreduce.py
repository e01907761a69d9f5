"""The int8 ring all-reduce against torch.distributed gloo (fp32), 3 member processes.

    python -m benchmarks.allreduce --json [--mib 64] [--rounds 5] [--bandwidth MBIT] [--connections M]
                                   [--chunk-kib K] [--members N] [--codec sparse]
                                   [--bits 4] [--topology butterfly] [--robust reweighted]
                                   [--delay MS,...] [--loss PCT,...] [--up MBIT,...] [--down MBIT,...]

Every member holds its own N(0,1) fp32 vector. A gloo barrier starts each round; a round's time is
the slowest member's, and the figures are medians over the rounds (each round's own time is in
`int8_ring_rounds_s` and `gloo_fp32_rounds_s`). `rel_err` is the ring's relative
L2 error against the exact fp32 mean. Without --bandwidth the members talk over 127.0.0.1; with it,
each runs in its own network namespace whose uplink tc limits to MBIT, and `link_util` = (ideal wire
time of the int8 ring at that bandwidth) / (measured time). --connections M gives the ring M
parallel TCP connections per neighbour (comm.connections), --chunk-kib the pipelining unit
(comm.chunk_bytes, in KiB of fp32); --bits 4 sends 4-bit codes (comm.bits;
the `int8_ring_*` figures are then those of the 4-bit ring). --topology picks ring or butterfly
(comm.topology; auto: the ring at 3 members); --robust clip|reweighted runs robust aggregation
(comm.robust, with --clip X its comm.clip, default 1: the butterfly, signed norm claims, signed
results, every member's check; the reweighted mean at the owners, weighing shares by their
agreement with the round before's result from the first timed round on), to set beside
`--topology butterfly`. --members N runs N member processes; --codec sparse the sparse codec's
gather instead (comm.codec; the `int8_ring_*` figures are then its, `rel_err` against the exact
mean, which a top-k code is far from by design). Every run reports the bytes each member sent per
all-reduce (`sent_bytes_per_member`, `sent_bits_per_value`) beside the dense int8 ring's at that
member count (`dense_ring_bytes_per_member`); with the sparse codec `ideal_ring_s` and
`link_util` take the bytes it sent; and the largest member process's peak resident memory
after its all-reduces, before gloo's, above what it held before its vectors existed
(`peak_rss_mib`, and per value: the member's own input and result vectors, 8 bytes a value,
included, as a node's agent holds them). --no-gloo skips gloo's rounds (on a slow link they
take minutes for a large vector).

With any of --delay, --jitter, --loss, --up or --down (benchmarks/paths.py) the members run in the
internet lab instead (one namespace each, joined by a userspace router with those paths; --bandwidth
then sets the rates not given), and the result adds physical_s — the int8 ring's bytes over the
slowest uplink plus 2(n − 1) one-way delays of the slowest path — and ring_vs_physical.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.common import parser, payload_bytes, report, unwind_on_sigterm
from benchmarks.paths import add_path_flags, check_path_flags, lab_figures, lab_for, wants_lab
from p2ptrain.config import Aggregation, Codec, Topology
from p2ptrain.memory_limits import current_rss, peak_rss
from p2ptrain.procs import free_port

WORLD = 3
"""Member processes unless --members says otherwise."""
BLOCK = 256


def _data(rank: int, length: int) -> np.ndarray:
    return np.random.default_rng(rank).standard_normal(length).astype(np.float32)


def worker(
    rank: int,
    host: str,
    *,
    master: str,
    length: int,
    rounds: int,
    out: Path,
    connections: int = 1,
    chunk_bytes: int = 4 << 20,
    bits: int = 8,
    topology: Topology = "auto",
    robust: Aggregation = "off",
    clip: float = 1.0,
    codec: Codec = "dense",
    world: int = WORLD,
    gloo: bool = True,
) -> None:
    """One member of `world`: `rounds` ring all-reduces, then `rounds` gloo all-reduces, timings
    (and the bytes it sent per all-reduce) to `out`."""
    import torch
    import torch.distributed as dist

    from p2ptrain.comm.net.members import Member
    from p2ptrain.comm.net.server import DataPlaneServer
    from p2ptrain.comm.reduce.allreduce import all_reduce
    from p2ptrain.config import CommConfig
    from p2ptrain.identity import load_or_create_identity

    dist.init_process_group("gloo", init_method=f"tcp://{master}", rank=rank, world_size=world)
    before = current_rss() or 0  # the interpreter, torch, the process group: not the all-reduce's
    data = _data(rank, length)

    async def ring_rounds() -> tuple[list[float], np.ndarray, int]:
        identity = load_or_create_identity(out.parent / f"id{rank}")
        comm = CommConfig(
            quant_block=BLOCK,
            failure_timeout=120,
            connections=connections,
            chunk_bytes=chunk_bytes,
            bits=bits,
            topology=topology,
            robust=robust,
            clip=clip,
            codec=codec,
        )
        server = DataPlaneServer(identity=identity, comm=comm, setup_timeout=60)
        listen_host, port = await server.start(host)
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, (identity.public_key, listen_host, port))
        members = [
            Member(key=key, host=member_host, port=member_port) for key, member_host, member_port in everyone
        ]
        buffer, times, sent = data.copy(), [], 0
        reference: np.ndarray | None = None  # the last result, kept as OuterSync keeps it
        for step in range(rounds + 1):
            np.copyto(buffer, data)
            await asyncio.get_running_loop().run_in_executor(None, dist.barrier)  # keep the loop free
            started = time.perf_counter()
            stats = await all_reduce(server, step=step, members=members, buffer=buffer, reference=reference)
            times.append(time.perf_counter() - started)
            sent = stats.bytes_sent
            if robust == "reweighted" and codec == "dense":  # the sparse gather needs none
                reference = buffer.copy()
        await server.close()
        return times[1:], buffer, sent

    ring_times, result, sent = asyncio.run(ring_rounds())
    peak = (peak_rss("self") or 0) - before  # before gloo's own copy of the vector
    tensor, gloo_times = torch.from_numpy(data.copy() if gloo else data[:0].copy()), []
    for _ in range(rounds + 1 if gloo else 0):
        tensor.copy_(torch.from_numpy(data))
        dist.barrier()
        started = time.perf_counter()
        dist.all_reduce(tensor)
        gloo_times.append(time.perf_counter() - started)
    everyone_times: list[Any] = [None] * world
    dist.all_gather_object(everyone_times, (ring_times, gloo_times[1:], sent, peak))
    dist.destroy_process_group()
    if rank == 0:
        np.save(out.parent / "ring.npy", result)
        out.write_text(json.dumps(everyone_times))


def _run_members(commands: list[list[str]], root: Path, timeout: float) -> list[Any]:
    logs = [open(root / f"member{rank}.log", "w") for rank in range(len(commands))]  # noqa: SIM115
    processes = [
        subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).resolve().parent.parent
        )
        for command, log in zip(commands, logs, strict=True)
    ]
    try:
        deadline = time.monotonic() + timeout
        for process in processes:
            process.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
                process.wait()
        for log in logs:
            log.close()
    failed = [rank for rank, process in enumerate(processes) if process.returncode != 0]
    if failed:
        # the first to fail is usually the one whose log does not blame a peer
        said = {rank: (root / f"member{rank}.log").read_text()[-3000:] for rank in failed}
        culprit = next((rank for rank in failed if "closed by peer" not in said[rank]), failed[0])
        raise RuntimeError(f"member {culprit} failed:\n{said[culprit]}")
    return json.loads((root / "times.json").read_text())


def run(
    mib: int,
    rounds: int,
    *,
    bandwidth: float | None,
    connections: int = 1,
    chunk_bytes: int = 4 << 20,
    bits: int = 8,
    topology: Topology = "auto",
    robust: Aggregation = "off",
    clip: float = 1.0,
    codec: Codec = "dense",
    world: int = WORLD,
    gloo: bool = True,
    paths: argparse.Namespace | None = None,
) -> dict[str, Any]:
    """`paths`: the lab's flags, to run over the internet lab instead of tc-limited links."""
    length = (mib << 20) // 4
    narrowest: tuple[float, float] | None = None  # (lowest uplink Mbit/s, longest one-way delay s)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        out = root / "times.json"

        def command(rank: int, host: str, master: str) -> list[str]:
            return [
                sys.executable,
                "-m",
                "benchmarks.allreduce",
                "--worker",
                str(rank),
                "--host",
                host,
                "--master",
                master,
                "--length",
                str(length),
                "--rounds",
                str(rounds),
                "--out",
                str(out),
                "--connections",
                str(connections),
                "--chunk-kib",
                str(chunk_bytes >> 10),
                "--bits",
                str(bits),
                "--topology",
                topology,
                "--robust",
                robust,
                "--clip",
                str(clip),
                "--codec",
                codec,
                "--members",
                str(world),
                *([] if gloo else ["--no-gloo"]),
            ]

        timeout = 120 + rounds * (4 * length * 8 / (bandwidth * 1e6) * 2 if bandwidth else 5)
        if paths is not None:
            with lab_for(paths, world, bootstrap=False, rate=bandwidth) as lab:
                master = f"{lab.address(0)}:29517"
                commands = [
                    [
                        *lab.prefix(rank),
                        "env",
                        "GLOO_SOCKET_IFNAME=tun0",
                        *command(rank, lab.address(rank), master),
                    ]
                    for rank in range(world)
                ]
                times = _run_members(commands, root, timeout)
            one_way = max(lab.round_trip_s(a, b) / 2 for a in range(world) for b in range(world) if a != b)
            narrowest = (min(link.up_mbit for link in lab.links), one_way)
        elif bandwidth is None:
            master = f"127.0.0.1:{free_port()}"
            times = _run_members([command(rank, "127.0.0.1", master) for rank in range(world)], root, timeout)
        else:
            from benchmarks.netns import limited_network

            with limited_network(world, bandwidth) as network:
                master = f"{network.addresses[0]}:29517"
                commands = [
                    network.command(rank, command(rank, network.addresses[rank], master))
                    for rank in range(world)
                ]
                times = _run_members(commands, root, timeout)
        result = np.load(root / "ring.npy")
    exact = np.zeros(length)
    for rank in range(world):  # one member's vector at a time: 150M values take 1.2 GB in float64
        exact += _data(rank, length)
    exact /= world

    def slowest(index: int) -> list[float]:
        """Per round, the slowest member's seconds: a round is over when its last member is done."""
        return [max(member[index][i] for member in times) for i in range(rounds)]

    ring_rounds, gloo_rounds = slowest(0), slowest(1) if gloo else []
    ring_s = statistics.median(ring_rounds)
    gloo_s = statistics.median(gloo_rounds) if gloo else math.nan
    summary: dict[str, Any] = {
        "members": world,
        "mib": mib,
        "connections": connections,
        "chunk_kib": chunk_bytes >> 10,
        "bits": bits,
        "topology": topology,
        "robust": robust,
        "clip": clip,
        "codec": codec,
        "rounds": rounds,
        "int8_ring_s": round(ring_s, 4),
        "gloo_fp32_s": round(gloo_s, 4) if gloo else None,
        "ring_vs_gloo": round(ring_s / gloo_s, 3) if gloo else None,
        "rel_err": round(float(np.linalg.norm(result - exact) / np.linalg.norm(exact)), 5),
        "int8_ring_rounds_s": [round(seconds, 4) for seconds in ring_rounds],
        "gloo_fp32_rounds_s": [round(seconds, 4) for seconds in gloo_rounds],
        "sent_bytes_per_member": max(member[2] for member in times),
        "sent_bits_per_value": round(8 * max(member[2] for member in times) / length, 4),
        "dense_ring_bytes_per_member": round(payload_bytes(length, world, bits=8, block=BLOCK)),
        "peak_rss_mib": round(max(member[3] for member in times) / 2**20),
        "peak_rss_bytes_per_value": round(max(member[3] for member in times) / length, 2),
    }
    wire_bytes = payload_bytes(length, world, bits=bits, block=BLOCK)
    if codec == "sparse":
        wire_bytes = summary["sent_bytes_per_member"]
    if narrowest is not None and paths is not None:
        physical_s = wire_bytes * 8 / (narrowest[0] * 1e6) + 2 * (world - 1) * narrowest[1]
        summary.update(
            lab_figures(paths),
            physical_s=round(physical_s, 4),
            ring_vs_physical=round(ring_s / physical_s, 3),
        )
    elif bandwidth is not None:
        ideal_s = wire_bytes * 8 / (bandwidth * 1e6)
        summary.update(
            bandwidth_mbit=bandwidth,
            ideal_ring_s=round(ideal_s, 4),
            link_util=round(ideal_s / ring_s, 3),
            speedup_vs_gloo=round(gloo_s / ring_s, 2) if gloo else None,
        )
    return summary


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--mib", type=int, default=64, help="fp32 buffer size per member (MiB)")
    arguments.add_argument("--rounds", type=int, default=5, help="timed rounds (after one warm-up)")
    arguments.add_argument(
        "--bandwidth", type=float, metavar="MBIT", help="limit each member's uplink to MBIT"
    )
    arguments.add_argument(
        "--connections", type=int, default=1, metavar="M", help="TCP connections per ring neighbour"
    )
    arguments.add_argument(
        "--chunk-kib", type=int, default=4096, metavar="K", help="comm.chunk_bytes in KiB (fp32)"
    )
    arguments.add_argument("--bits", type=int, choices=[8, 4], default=8, help="code width (comm.bits)")
    arguments.add_argument(
        "--topology", choices=["auto", "ring", "butterfly"], default="auto", help="comm.topology"
    )
    arguments.add_argument(
        "--robust", choices=["off", "clip", "reweighted"], default="off", help="comm.robust (default off)"
    )
    arguments.add_argument("--clip", type=float, default=1.0, help="comm.clip under --robust (default 1)")
    arguments.add_argument(
        "--codec", choices=["dense", "sparse"], default="dense", help="comm.codec (sparse: the gather)"
    )
    arguments.add_argument("--members", type=int, default=WORLD, help="member processes (default 3)")
    arguments.add_argument("--no-gloo", action="store_true", help="skip gloo's fp32 rounds (slow links)")
    add_path_flags(arguments)
    arguments.add_argument("--worker", type=int, help=argparse_hidden())
    arguments.add_argument("--host", help=argparse_hidden())
    arguments.add_argument("--master", help=argparse_hidden())
    arguments.add_argument("--length", type=int, help=argparse_hidden())
    arguments.add_argument("--out", help=argparse_hidden())
    args = arguments.parse_args()
    check_path_flags(arguments, args)
    if args.chunk_kib < 4:
        arguments.error("--chunk-kib must be at least 4")
    if not 1 <= args.connections <= 16:
        arguments.error("--connections must be within 1..16")
    if not 2 <= args.members <= 16:
        arguments.error("--members must be within 2..16")
    if not 0 < args.clip <= 1000:
        arguments.error("--clip must be above 0 and at most 1000")
    if args.worker is not None:
        worker(
            args.worker,
            args.host,
            master=args.master,
            length=args.length,
            rounds=args.rounds,
            out=Path(args.out),
            connections=args.connections,
            chunk_bytes=args.chunk_kib << 10,
            bits=args.bits,
            topology=args.topology,
            robust=args.robust,
            clip=args.clip,
            codec=args.codec,
            world=args.members,
            gloo=not args.no_gloo,
        )
        return
    unwind_on_sigterm()
    if (args.bandwidth is not None or wants_lab(args)) and os.geteuid() != 0:
        reason = "--bandwidth and the lab's flags need root for network namespaces"
        report({"skipped": True, "reason": reason}, args.json)
        return
    try:
        summary = run(
            args.mib,
            args.rounds,
            bandwidth=args.bandwidth,
            connections=args.connections,
            chunk_bytes=args.chunk_kib << 10,
            bits=args.bits,
            topology=args.topology,
            robust=args.robust,
            clip=args.clip,
            codec=args.codec,
            world=args.members,
            gloo=not args.no_gloo,
            paths=args if wants_lab(args) else None,
        )
    except Exception as exc:
        from benchmarks.netns import NamespacesUnavailable

        if isinstance(exc, NamespacesUnavailable):
            report({"skipped": True, "reason": f"network namespaces not permitted here: {exc}"}, args.json)
            return
        raise
    report(summary, args.json)


def argparse_hidden() -> str:
    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
