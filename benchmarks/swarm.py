"""Does coordination eat the compute? A whole swarm on 127.0.0.1, measured from its own metrics.

    python -m benchmarks.swarm --json [--nodes 3] [--steps 10] [--kill-at 4]

Runs `p2ptrain demo` (bootstrap peer + nodes training the debug config with int8 DiLoCo; one node
SIGKILLed after --kill-at outer steps, a new one joining) and reads every node's metrics.jsonl:

- compute_util: time in inner steps / wall time between a node's first and last record, averaged
  over the nodes that ran from the start;
- outer_overhead_s: median over nodes and steps of the wall time between a step's last inner step
  and its outer step's completion (gather, election, all-reduce, Nesterov step, load);
- join_s: the joiner's start → member of an outer step (it contributes from the next);
- recover_s: SIGKILL → the survivors' next completed outer step.
Targets: outer_overhead_s ≤ 1 s on loopback; recover_s ≤ heartbeat_timeout + 5 s.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import parser, report
from p2ptrain.config import load_config
from p2ptrain.demo import run_demo
from p2ptrain.train.metrics import read_metrics


def node_figures(records: list[dict[str, Any]], tokens_per_step: int) -> tuple[float, list[float]]:
    """(compute utilisation, outer overheads) of one node's metrics."""
    inner = [r for r in records if r["kind"] == "inner"]
    outer = [r for r in records if r["kind"] == "outer"]
    if len(inner) < 2 or not outer:
        return float("nan"), []
    busy = sum(tokens_per_step / r["tokens_per_s"] for r in inner if r["tokens_per_s"])
    wall = max(r["time"] for r in records) - min(r["time"] for r in inner) + busy / len(inner)
    overheads = []
    for record in outer:
        before = [r["time"] for r in inner if r["outer_step"] == record["step"]]
        if before:
            overheads.append(record["time"] - max(before))
    return busy / wall, overheads


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--nodes", type=int, default=3)
    cli.add_argument("--steps", type=int, default=10)
    cli.add_argument("--kill-at", type=int, default=4)
    cli.add_argument("--bandwidth", type=float, default=0.0, metavar="MBIT")
    args = cli.parse_args()
    if args.bandwidth:
        print("benchmarks.swarm: --bandwidth (tc-limited namespaces) is not implemented yet", file=sys.stderr)
        sys.exit(2)
    debug = load_config("debug")
    tokens_per_step = debug.train.batch_size * debug.model.seq_len
    with tempfile.TemporaryDirectory() as work:
        summary = run_demo(
            Path(work), nodes=args.nodes, steps=args.steps, kill_at=args.kill_at, quiet=args.json
        )
        names = [f"node{i}" for i in range(args.nodes)]
        records = {name: read_metrics(Path(work) / name / "metrics.jsonl") for name in names}
    starters = [name for name in names if name != summary["killed"]]
    utils, overheads = [], []
    for name in starters:
        util, node_overheads = node_figures(records[name], tokens_per_step)
        utils.append(util)
        overheads += node_overheads
    recover_s = None
    if summary["killed_at"]:
        killed_at = summary["killed_at"]
        after = [
            min(
                (r["time"] for r in records[name] if r["kind"] == "outer" and r["time"] > killed_at),
                default=None,
            )
            for name in starters
        ]
        if all(after):
            recover_s = round(max(after) - summary["killed_at"], 2)
    report(
        {
            "ok": summary["ok"],
            "nodes": args.nodes,
            "outer_steps": summary["outer_steps"],
            "compute_util": round(statistics.mean(utils), 3),
            "outer_overhead_s": round(statistics.median(overheads), 3),
            "join_s": summary["join_s"],
            "recover_s": recover_s,
            "params_hash_agree": summary["params_hash_agree"],
            "seconds": summary["seconds"],
        },
        args.json,
    )


if __name__ == "__main__":
    main()
