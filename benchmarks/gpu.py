"""The prepared GPU check: two training nodes share this machine's GPU(s) and train the 150m config
with overlap on, through the real swarm (bootstrap peer, DHT, int8 all-reduce over loopback).

    python -m benchmarks.gpu --json [--config 150m] [--steps 4] [--inner 20] [--nproc N]
                                    [--overlap true|false] [--set KEY=VALUE ...] [--timeout 280]
                                    [--beside-blocking] [--logs DIR]

Each node is `p2ptrain join` with its ranks on the GPU(s) (FSDP2 over N local GPUs with NCCL when N > 1,
bf16 autocast as the config says). It reads every node's metrics.jsonl and reports:

- inner_step_s: median seconds of one inner step (both nodes share the GPU, so about half its speed);
- mfu: median model FLOPs utilisation of the inner steps (the trainer's own figure: 6·N·tokens plus
  attention, over the GPU's bf16 peak); gpu_peak_gib: the most GPU memory a rank had allocated
  (each node's log gives the estimate it was sized by, "memory: about … per rank");
- sync_s: median seconds of the agents' syncs (election + all-reduce); outer_wait_s: median seconds
  per phase the training loop spent outside inner steps (the sync when blocking, plus the outer
  step's own work: Δ off the GPU, S's step and hash on the CPU, the weights back; with overlap that
  work wherever in the phase the result was taken); taken_after_steps: median inner steps of the
  next phase a result was taken after (overlap);
- with --beside-blocking, the same run with overlap off under "blocking", and hidden_fraction =
  (blocking outer_wait_s − outer_wait_s) / blocking sync_s: near 1 when overlap hides the sync;
- params_hash_agree: both nodes held the same S (θ_outer's hash) after every outer step.

Ends within 5 minutes on one H100/H200 (one run took under a minute on an H200; --timeout bounds
each run: it stops every process it started and reports what it has). On a machine without a GPU it
runs the same on the CPU (use `--config debug` there: it checks the script, its figures mean
nothing). docs/results/2026-12-gpu.md holds the figures of its runs on a GPU.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import parser, report, start_bootstrap, unwind_on_sigterm
from p2ptrain.config import load_config
from p2ptrain.errors import ConfigError
from p2ptrain.procs import ChildProcesses
from p2ptrain.train.metrics import read_metrics

NODES = ("a", "b")


def node_command(root: Path, name: str, peer: str, args: Any, shard: int, overlap: str) -> list[str]:
    settings = [
        f"train.inner_steps={args.inner}",
        f"train.max_steps={args.inner * args.steps}",
        f"outer.overlap.enabled={overlap}",
        f"data.shard={shard}",
        "swarm.wait_nodes=2",
        'node.data_host="127.0.0.1"',
        "checkpoint.interval=0",
        *args.set,
    ]
    command = [sys.executable, "-m", "p2ptrain", "join", "--peer", peer, "--config", args.config]
    command += ["--work-dir", str(root / name), "--listen", "/ip4/127.0.0.1/tcp/0"]
    if args.nproc:
        command += ["--nproc", str(args.nproc)]
    for setting in settings:
        command += ["--set", setting]
    return command


def figures(records: dict[str, list[dict[str, Any]]], tokens_per_step: int) -> dict[str, Any]:
    """The report's figures from both nodes' metrics (see the module docstring)."""
    outer = {name: [r for r in records[name] if r["kind"] == "outer"] for name in NODES}
    step_s: list[float] = []
    waits: list[float] = []
    mfu: list[float] = []
    peak: list[float] = []
    for name in NODES:
        inner = [r for r in records[name] if r["kind"] == "inner" and r.get("tokens_per_s")]
        step_s += [tokens_per_step / r["tokens_per_s"] for r in inner]
        mfu += [r["mfu"] for r in inner if "mfu" in r]
        peak += [r["gpu_peak_gib"] for r in inner if "gpu_peak_gib" in r]
        # per phase, the loop's time outside inner steps: the wait before it, and with the result
        # taken mid-phase (outer.overlap.take_on_arrival, overlap_steps) that step's work too
        loop_s: dict[int, float] = {}
        for before, after in itertools.pairwise(inner):
            gap = after["time"] - tokens_per_step / after["tokens_per_s"] - before["time"]
            if after["outer_step"] == before["outer_step"] + 1:  # the loop between two phases
                loop_s[after["outer_step"]] = gap
            elif after["outer_step"] in loop_s:
                loop_s[after["outer_step"]] += gap
        waits += loop_s.values()
    syncs = [r["sync_s"] for name in NODES for r in outer[name] if r.get("sync_s")]
    taken = [r["taken_after_steps"] for name in NODES for r in outer[name] if "taken_after_steps" in r]
    hashes = [{r["step"]: r["params_hash"] for r in outer[name]} for name in NODES]
    common = set(hashes[0]) & set(hashes[1])
    sync_s = statistics.median(syncs) if syncs else None
    wait_s = statistics.median(waits) if waits else None
    return {
        "outer_steps": min(len(outer[name]) for name in NODES),
        "inner_step_s": round(statistics.median(step_s), 4) if step_s else None,
        "mfu": round(statistics.median(mfu), 4) if mfu else None,
        "gpu_peak_gib": max(peak) if peak else None,
        "sync_s": round(sync_s, 3) if sync_s is not None else None,
        "outer_wait_s": round(wait_s, 3) if wait_s is not None else None,
        "taken_after_steps": statistics.median(taken) if taken else None,
        "params_hash_agree": bool(common) and all(hashes[0][step] == hashes[1][step] for step in common),
    }


def hidden_fraction(overlapped: dict[str, Any], blocking: dict[str, Any]) -> float | None:
    """The share of the blocking run's sync that overlap took off the training loop: the loop's
    time outside inner steps also holds work that is not the sync (Δ off the GPU, S's step and hash
    on the CPU, the weights back), so it is compared with the same time without overlap."""
    waits = overlapped["outer_wait_s"], blocking["outer_wait_s"]
    if None in waits or not blocking["sync_s"]:
        return None
    return round((waits[1] - waits[0]) / blocking["sync_s"], 3)


def keep_logs(root: Path, into: Path) -> None:
    """Every process's log and each node's metrics.jsonl, flat in `into` (the work dir is temporary)."""
    into.mkdir(parents=True, exist_ok=True)
    for log in root.glob("*.log"):
        shutil.copy(log, into / log.name)
    for name in NODES:
        if (root / name / "metrics.jsonl").exists():
            shutil.copy(root / name / "metrics.jsonl", into / f"{name}-metrics.jsonl")


Metrics = dict[str, list[dict[str, Any]]]
"""Each node's metrics.jsonl records, by node name."""


def run_swarm(args: Any, overlap: str, logs: Path | None) -> tuple[bool, Metrics, dict[str, str]]:
    """Bootstrap peer plus both nodes until they finish or --timeout: (finished, metrics, log tails)."""
    started = time.monotonic()
    children = ChildProcesses()
    with tempfile.TemporaryDirectory(prefix="p2ptrain-gpu-") as tmp:
        root = Path(tmp)
        finished = False
        try:
            peer = start_bootstrap(children, root, "gpu")
            for shard, name in enumerate(NODES):
                env = {**os.environ, "OMP_NUM_THREADS": "4"}
                command = node_command(root, name, peer, args, shard, overlap)
                children.spawn(name, command, log_path=root / f"{name}.log", env=env)
            deadline = started + args.timeout
            while time.monotonic() < deadline and not finished:
                codes = [children.wait(name, 1.0) for name in NODES]
                finished = all(code is not None for code in codes)
        finally:
            children.stop_all()
        metrics = {name: read_metrics(root / name / "metrics.jsonl") for name in NODES}
        tails = {name: (root / f"{name}.log").read_text(errors="replace")[-600:] for name in NODES}
        if logs is not None:
            keep_logs(root, logs)
    return finished, metrics, tails


def main() -> None:
    cli = parser(__doc__.splitlines()[0])
    cli.add_argument("--config", default="150m", help="model config (default %(default)s)")
    cli.add_argument("--steps", type=int, default=4, help="outer steps (default %(default)s)")
    cli.add_argument("--inner", type=int, default=20, help="inner steps per outer step (default %(default)s)")
    cli.add_argument("--nproc", type=int, default=0, help="ranks per node (default: one per visible GPU)")
    cli.add_argument("--overlap", choices=["true", "false"], default="true")
    cli.add_argument(
        "--beside-blocking",
        action="store_true",
        help="then the same with overlap off, and the sync time hidden measured side by side",
    )
    cli.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    cli.add_argument("--timeout", type=float, default=280.0, help="stop each run after S seconds")
    cli.add_argument("--logs", type=Path, help="copy every process's log and each node's metrics here")
    args = cli.parse_args()
    unwind_on_sigterm()
    if args.steps < 2 or args.inner < 1 or args.nproc < 0 or args.timeout <= 0:
        cli.error("--steps must be at least 2, --inner at least 1, --nproc and --timeout not negative")
    try:
        config = load_config(args.config, overrides=args.set)
    except ConfigError as exc:
        cli.error(str(exc))
    import torch  # after the arguments: a typo answers at once

    tokens_per_step = config.train.batch_size * config.model.seq_len
    started = time.monotonic()
    finished, metrics, tails = run_swarm(args, args.overlap, args.logs)
    result = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "config": args.config,
        "overlap": args.overlap == "true",
        "finished": finished,
        **figures(metrics, tokens_per_step),
    }
    result["ok"] = finished and result["params_hash_agree"] and result["outer_steps"] == args.steps
    if args.beside_blocking:
        finished, metrics, blocking_tails = run_swarm(args, "false", None)
        blocking = figures(metrics, tokens_per_step)
        result["blocking"] = blocking
        result["hidden_fraction"] = hidden_fraction(result, blocking)
        result["ok"] = result["ok"] and finished and blocking["params_hash_agree"]
        tails |= {f"blocking {name}": tail for name, tail in blocking_tails.items()}
    result["seconds"] = round(time.monotonic() - started, 1)
    if not result["ok"]:
        result["logs"] = tails
    report(result, args.json)
    if not args.json:
        print(json.dumps(result["ok"]))


if __name__ == "__main__":
    main()
