"""Does a node that cannot take part slow the swarm down? Drill swarms on 127.0.0.1, side by side.

    python -m benchmarks.strangers --json [--steps 30] [--set KEY=VALUE ...]

Runs a bootstrap peer and 3 drill nodes (`p2ptrain drill`, 1 MiB vectors, inner phases of
up to 0.3 s) for --steps outer steps, once per case:

- `honest`: nobody else;
- `stranger_refused`: a fresh key publishes "ready for the current step" every 0.5 s with a data
  address nobody listens on (127.0.0.1:9) — tests/support/stranger.py;
- `stranger_silent`: the same with an address that accepts connections and never answers;
- `stranger_differs`: the same with an address that answers every hello "our views differ";
- `node_dead_address`: a fourth, real drill node that announces 127.0.0.1:9 (`node.data_announce`);
- `flood_own_address`: 500 idle TCP connections to node0's data port, reopened as fast as it closes
  them, from 127.0.0.1 — the very address its peers dial from, as a flooder behind the same home
  router or carrier-grade NAT would be (tests/support/flooder.py, on from before the first step;
  at nice 19, as it stands for another machine).

Per case: the step rate (steps per second of node0, first to last step), steps given up, steps
that needed more than one attempt, the longest sync; and `<case>_vs_honest`, the step rate over
the honest one. Target: ≥ 0.8 for every case. `--set` passes settings to the
honest nodes (e.g. `--set comm.failure_timeout=3`).
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.common import (
    drill_command,
    parser,
    report,
    start_bootstrap,
    unwind_on_sigterm,
    wait_for_file,
)
from p2ptrain.procs import ChildProcesses

NODES = 3
CASES = (
    "honest",
    "stranger_refused",
    "stranger_silent",
    "stranger_differs",
    "node_dead_address",
    "flood_own_address",
)
FLOOD_CONNECTIONS = 500


def join(root: Path, name: str, *, peer: str, steps: int, extra: list[str]) -> list[str]:
    return drill_command(root, name, peer=peer, steps=steps, nodes=NODES, size=1 << 18, extra=extra)


def run_case(case: str, steps: int, *, settings: list[str], keep: Path | None) -> dict[str, Any]:
    children = ChildProcesses()
    with tempfile.TemporaryDirectory(prefix=f"p2ptrain-{case}-") as tmp:
        root = Path(tmp) if keep is None else keep / case
        root.mkdir(parents=True, exist_ok=True)
        try:
            peer = start_bootstrap(children, root, "strangers")
            if case.startswith("stranger_"):
                mode = case.removeprefix("stranger_")
                children.spawn(
                    "stranger",
                    [
                        sys.executable,
                        "-m",
                        "tests.support.stranger",
                        "--peer",
                        peer,
                        "--mode",
                        mode,
                        "--address-file",
                        str(root / "stranger.key"),
                    ],
                    log_path=root / "stranger.log",
                )
                wait_for_file(root / "stranger.key", 60, "strangers")
            if case == "node_dead_address":
                dead = ["--set", 'node.data_announce="127.0.0.1:9"']
                children.spawn(
                    "dead", join(root, "dead", peer=peer, steps=steps, extra=dead), log_path=root / "dead.log"
                )
            for index in range(NODES):
                name = f"node{index}"
                children.spawn(
                    name,
                    join(root, name, peer=peer, steps=steps, extra=settings),
                    log_path=root / f"{name}.log",
                )
                if index == 0 and case == "flood_own_address":
                    flood(children, root, port=data_port(root / "node0.log", children))
            for index in range(NODES):
                code = children.wait(f"node{index}", timeout=60 + 20 * steps)
                if code != 0:
                    log = (root / f"node{index}.log").read_text(errors="replace")[-2000:]
                    raise SystemExit(
                        f"benchmarks.strangers: error: node{index} of {case} exited {code}\n{log}"
                    )
            lines = [json.loads(line) for line in (root / "node0" / "drill.jsonl").read_text().splitlines()]
        finally:
            children.stop_all()
    done = [line for line in lines if "given_up" not in line]
    span = lines[-1]["time"] - lines[0]["time"] if len(lines) > 1 else float("nan")
    return {
        "steps_per_s": round((len(lines) - 1) / span, 3) if span > 0 else float("nan"),
        "steps_given_up": len(lines) - len(done),
        "retried_steps": sum(1 for line in done if line.get("attempts", 1) > 1),
        "max_sync_s": max((line["sync_s"] for line in done), default=float("nan")),
    }


def data_port(log: Path, children: ChildProcesses, timeout: float = 120) -> int:
    """The data port node0 says it listens on ("data plane on port N")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace") if log.exists() else ""
        found = re.search(r"data plane on port (\d+)", text)
        if found:
            return int(found.group(1))
        if children.wait("node0", 0) is not None:
            raise SystemExit(f"benchmarks.strangers: error: node0 exited before its data plane was up\n{log}")
        time.sleep(0.2)
    raise SystemExit(f"benchmarks.strangers: error: node0 said no data port within {timeout:.0f} s")


def flood(children: ChildProcesses, root: Path, *, port: int) -> None:
    """The idle flood from the honest nodes' own address, on before node1 and node2 start. The
    flooder stands for another machine, so it runs at the lowest CPU priority (nice 19): it takes
    the cores the nodes leave, where at equal priority its reopening of connections took a share of
    the nodes' own CPU on a machine of 2 cores (docs/results/2026-12-swarm.md has both figures)."""
    command = ["nice", "-n", "19", sys.executable, "-m", "tests.support.flooder", "--mode", "idle"]
    command += ["--source", "127.0.0.1"]
    command += ["--count", str(FLOOD_CONNECTIONS), "--target", f"127.0.0.1:{port}"]
    children.spawn("flooder", command, log_path=root / "flooder.log")
    wait_for_file(root / "flooder.log", 60, "strangers")


def main() -> None:
    args = parser(__doc__.splitlines()[0])
    args.add_argument("--steps", type=int, default=30)
    args.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args.add_argument("--cases", default=",".join(CASES), help="comma-separated (default: all)")
    args.add_argument("--keep", default="", help="keep the nodes' logs in this folder")
    options = args.parse_args()
    unwind_on_sigterm()
    if options.steps < 5:
        raise SystemExit("benchmarks.strangers: error: --steps must be at least 5")
    settings = [item for pair in options.set for item in ("--set", pair)]
    result: dict[str, Any] = {"nodes": NODES, "steps": options.steps}
    cases = [case for case in options.cases.split(",") if case]
    unknown = sorted(set(cases) - set(CASES))
    if unknown or "honest" not in cases:
        raise SystemExit(
            f"benchmarks.strangers: error: --cases takes honest and any of {', '.join(CASES[1:])}"
        )
    keep = Path(options.keep) if options.keep else None
    for case in cases:
        figures = run_case(case, options.steps, settings=settings, keep=keep)
        result.update({f"{case}_{key}": value for key, value in figures.items()})
        if not options.json:
            print(f"{case}: {figures}", file=sys.stderr, flush=True)
    for case in cases[1:]:
        result[f"{case}_vs_honest"] = round(result[f"{case}_steps_per_s"] / result["honest_steps_per_s"], 3)
    report(result, options.json)


if __name__ == "__main__":
    main()
