"""Drill swarms of n nodes on 127.0.0.1 and what each node spends per outer step (benchmarks.scale).

Per n: a bootstrap peer and n drill nodes (`p2ptrain drill --steps STEPS`, small vectors, inner
phases of up to 0.3 s) that wait for each other, then take STEPS outer steps. From each node's
drill.jsonl and its process tree, per n (medians over nodes and steps):

- overhead_s: one outer step's sync (ready → election → all-reduce done), the inner phase excluded;
- election_s: this node's ready record → the members of the completing attempt decided (it
  includes waiting for the others' inner phases);
- decided_after_last_ready_s: the members decided, minus the moment the last member was ready
  (before its record was stored or pushed; wall clocks of one machine): what the control plane
  (stores, pushes, DHT propagation, polling) costs a step;
- allreduce_s: the all-reduce itself;
- dht_bytes_per_node_s, dht_calls_per_node_s: the payload bytes this node's own DHT stores and gets
  moved, and their number, per second (SwarmDHT.traffic; the DHT's replication comes on top);
- connections_per_node_step: data-plane connections a node opens or accepts per step;
- rss_mib_per_node: resident memory of a node's process tree (agent, DHT child, p2pd), its peak
  over the run's samples;
- steps_given_up: node-steps given up (left out, timed out, the swarm past them), all nodes;
- steps_with_two_results: steps whose completed all-reduces differ between nodes (a fork: the
  swarm must never have one).
"""

from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import drill_command, start_bootstrap
from p2ptrain.memory_limits import current_rss
from p2ptrain.procs import ChildProcesses, descendants

FIGURES = (
    "overhead_s",
    "election_s",
    "decided_after_last_ready_s",
    "allreduce_s",
    "dht_bytes_per_node_s",
    "dht_calls_per_node_s",
    "connections_per_node_step",
    "rss_mib_per_node",
)


def _tree_rss(pid: int) -> int:
    return sum(current_rss(member) or 0 for member in [pid, *descendants(pid)])


def run_swarm(n: int, steps: int, *, settings: list[str], keep: Path | None = None) -> dict[str, Any]:
    """One drill swarm of n nodes; its row of figures (the nodes' logs kept under `keep`)."""
    children = ChildProcesses()
    peaks: dict[str, int] = {}
    with tempfile.TemporaryDirectory(prefix=f"p2ptrain-scale-{n}-") as tmp:
        root = Path(tmp) if keep is None else keep / f"n{n}"
        root.mkdir(parents=True, exist_ok=True)
        try:
            peer = start_bootstrap(children, root, "scale")
            names = [f"node{index}" for index in range(n)]
            for name in names:
                children.spawn(
                    name,
                    drill_command(root, name, peer=peer, steps=steps, nodes=n, size=1 << 16, extra=settings),
                    log_path=root / f"{name}.log",
                )
            deadline = time.monotonic() + 120 + 30 * steps
            while any(children.children[name].poll() is None for name in names):
                if time.monotonic() > deadline:
                    raise SystemExit(f"benchmarks.scale: error: the {n}-node swarm did not finish in time")
                for name in names:
                    proc = children.children[name]
                    if proc.poll() is None:
                        peaks[name] = max(peaks.get(name, 0), _tree_rss(proc.pid))
                time.sleep(1.0)
            failed = [name for name in names if children.children[name].returncode != 0]
            if failed:
                log = (root / f"{failed[0]}.log").read_text(errors="replace")[-2000:]
                raise SystemExit(f"benchmarks.scale: error: {failed[0]} of {n} exited non-zero\n{log}")
            logs = {name: _lines(root / name / "drill.jsonl") for name in names}
        finally:
            children.stop_all()
    return _row(n, logs, peaks)


def _lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _row(n: int, logs: dict[str, list[dict[str, Any]]], peaks: dict[str, int]) -> dict[str, Any]:
    done = {name: [line for line in lines if "given_up" not in line] for name, lines in logs.items()}
    every = [line for lines in done.values() for line in lines]
    per_node: dict[str, list[float]] = {"dht_bytes": [], "dht_calls": [], "connections": []}
    for lines in done.values():
        if len(lines) < 2:
            continue
        first, last = lines[0], lines[-1]
        span = max(1e-9, last["time"] - first["time"])
        moved = (last["dht"][0] + last["dht"][1]) - (first["dht"][0] + first["dht"][1])
        per_node["dht_bytes"].append(moved / span)
        per_node["dht_calls"].append((last["dht"][2] - first["dht"][2]) / span)
        # every connection is dialed by one node and accepted by another: twice the accepted ones
        per_node["connections"].append(
            2 * (last["lanes_accepted"] - first["lanes_accepted"]) / (len(lines) - 1)
        )
    first_hash: dict[int, str] = {}
    for line in every:
        first_hash.setdefault(line["step"], line["hash"])
    last_ready: dict[int, float] = {}
    for line in every:
        last_ready[line["step"]] = max(last_ready.get(line["step"], 0.0), line["ready_time"])
    lags = [line["ready_time"] + line["election_s"] - last_ready[line["step"]] for line in every]
    return {
        "n": n,
        "steps_done": min(len(lines) for lines in done.values()),
        "steps_given_up": sum(len(logs[name]) - len(done[name]) for name in logs),
        "steps_with_two_results": len(
            {line["step"] for line in every if line["hash"] != first_hash[line["step"]]}
        ),
        "members": statistics.median(len(line["members"]) for line in every),
        "overhead_s": _median(line["sync_s"] for line in every),
        "election_s": _median(line["election_s"] for line in every),
        "decided_after_last_ready_s": _median(max(0.0, lag) for lag in lags),
        "allreduce_s": _median(line["allreduce_s"] for line in every),
        "dht_bytes_per_node_s": _median(per_node["dht_bytes"]),
        "dht_calls_per_node_s": _median(per_node["dht_calls"]),
        "connections_per_node_step": _median(per_node["connections"]),
        "rss_mib_per_node": _median(peak / (1 << 20) for peak in peaks.values()),
    }


def _median(values: Any) -> float:
    found = list(values)
    return round(statistics.median(found), 4) if found else math.nan


def exponents(rows: list[dict[str, Any]]) -> dict[str, float]:
    """k of figure ∝ n^k, a least-squares line through (log n, log figure), per figure."""
    fitted = {}
    for figure in FIGURES:
        points = [(math.log(row["n"]), math.log(row[figure])) for row in rows if row[figure] > 0]
        if len(points) < 2:
            continue
        mean_x = sum(x for x, _ in points) / len(points)
        mean_y = sum(y for _, y in points) / len(points)
        spread = sum((x - mean_x) ** 2 for x, _ in points)
        if spread > 0:
            fitted[figure] = round(sum((x - mean_x) * (y - mean_y) for x, y in points) / spread, 3)
    return fitted


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """One log-log panel per figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    figure, axes = plt.subplots(2, 4, figsize=(16, 7))
    sizes = [row["n"] for row in rows]
    for axis, name in zip(axes.flat, FIGURES, strict=False):
        axis.loglog(sizes, [row[name] for row in rows], marker="o")
        axis.set_title(name)
        axis.set_xlabel("nodes")
        axis.set_xticks(sizes, [str(size) for size in sizes])
        axis.xaxis.set_minor_formatter(NullFormatter())
    figure.tight_layout()
    figure.savefig(path)
