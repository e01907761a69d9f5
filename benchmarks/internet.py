"""Drill nodes over an emulated internet: the sync against its physical limit, per outer step.

    python -m benchmarks.internet --json [--nodes 4] [--steps 6] [--size 8388608]
                                  [--delay MS,...] [--jitter MS,...] [--loss PCT,...]
                                  [--up MBIT,...] [--down MBIT,...] [--queue MS]
                                  [--set KEY=VALUE ...] [--declare-uplink] [--keep DIR]

A bootstrap peer and --nodes drill nodes (`p2ptrain drill`, vectors of --size values), each in a
network namespace of its own joined by the lab's userspace router (tests/support/internet.py,
router.py; needs root and /dev/net/tun). Per host: --delay its one-way delay to the core (a path's
round trip is twice the sum of its two hosts'), --jitter up to that much more per packet (a flow is
never reordered), --loss the percentage of the packets it sends that are lost, --up/--down its
rates, --queue what each of its queues holds (ms at its rate). A list gives node i its i-th value,
the last one repeated past its end; the bootstrap peer takes the first. --declare-uplink tells each
node its lab uplink (`comm.uplink_mbit` = its --up value), as a volunteer who ran a speed test would.

Per step (medians over the steps after the first, which opens the connections):
- allreduce_s: the slowest member's all-reduce (the members' own clocks: from its start to done);
- physical_s: the slowest member's payload bytes over its uplink (2(n−1)/n of the vector at the
  configured bits, plus 8 bytes of block parameters per block; under the sparse codec its share
  n − 1 times) + 2(n − 1) one-way delays of the slowest path among the members (the sparse
  gather: n, one for its data and n − 1 for the completion barrier); allreduce_ratio =
  allreduce_s / physical_s (target ≤ 1.3 at 0.5 % loss, ≤ 1.6 at 2 %);
- decided_after_last_ready_s: the last member's election done, minus the moment the last member was
  ready (wall clocks of one machine); election_rtts = that over the slowest pair's round trip
  (target ≤ 3);
- connect_s, transfer_s, barrier_s: the all-reduce's parts (dialing and handshakes, the frames, the
  completion barrier), each the slowest member's (a member's barrier_s includes waiting for the
  others' frames); barrier_after_last_frame_s: the last member to take the result, minus the last
  to have every frame (wall clocks of one machine): what the barrier itself costs;
- sync_s: a member's ready → all-reduce done (election included), the slowest member's;
- wire_overhead: bytes a member sent over its payload bytes (framing, seals, handshakes);
- lanes_rebound: lanes of the step that were kept from the step before and re-bound
  (comm.warm_lanes), the rest dialed afresh;
- measured_rtt_ratio: the round trips the members' kernels measured on their lanes over the paths'
  own (queueing behind the step's own bytes makes it > 1);
plus steps_given_up, steps_with_two_results (a fork: never), and the router's per-host counts of
packets sent, lost and dropped by a full queue, and its CPU time (router_cpu_s: near the run's
length, the router itself was the bottleneck). With --tcp-baseline (default), after the drill, in
the same lab: tcp_bulk_s, the time each node takes to send its payload bytes to the next over one
plain TCP connection, all at once (tcp_bulk_mbit: the rate that makes): what TCP itself gets out of
these paths, beside which the all-reduce's transfer_s can be read.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
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
    sync_bytes,
    sync_hops,
    unwind_on_sigterm,
)
from benchmarks.paths import add_path_flags, check_path_flags, lab_for
from p2ptrain.config import CommConfig, load_config
from p2ptrain.errors import ConfigError
from p2ptrain.procs import ChildProcesses

PHASES = ("connect_s", "transfer_s", "barrier_s")
"""The all-reduce's parts (ReduceStats), each the slowest member's."""


SINK = """
import socket, sys
server = socket.create_server(("0.0.0.0", 5001))
print("listening", flush=True)
connection, _ = server.accept()
while connection.recv(1 << 20):
    pass
"""
SOURCE = """
import socket, sys
connection = socket.create_connection((sys.argv[1], 5001))
block, left = bytes(1 << 20), int(sys.argv[2])
while left > 0:
    connection.sendall(block[: min(left, len(block))])
    left -= len(block)
connection.close()
"""


def tcp_bulk_s(lab: Any, hosts: list[int], nbytes: int) -> float:
    """Seconds for each of `hosts` to send `nbytes` over one plain TCP connection to the next one
    (all at once, the last to the first): what TCP itself makes of the lab's paths, beside which
    the all-reduce's transfer can be read."""
    sinks = [
        subprocess.Popen([*lab.prefix(host), sys.executable, "-c", SINK], stdout=subprocess.PIPE)
        for host in hosts
    ]
    try:
        for sink in sinks:
            assert sink.stdout is not None and sink.stdout.readline()
        started = time.monotonic()
        sources = [
            subprocess.Popen(
                [
                    *lab.prefix(host),
                    sys.executable,
                    "-c",
                    SOURCE,
                    lab.address(hosts[(i + 1) % len(hosts)]),
                    str(nbytes),
                ]
            )
            for i, host in enumerate(hosts)
        ]
        for process in [*sources, *sinks]:
            process.wait(timeout=600)
        return time.monotonic() - started
    finally:
        for sink in sinks:
            if sink.poll() is None:
                sink.kill()
                sink.wait()


def run(args: Any) -> dict[str, Any]:
    config = load_config("debug", overrides=args.set)
    children = ChildProcesses()
    names = [f"node{index}" for index in range(args.nodes)]
    with (
        tempfile.TemporaryDirectory(prefix="p2ptrain-internet-") as tmp,
        lab_for(args, args.nodes + 1) as lab,
    ):
        root = Path(args.keep) if args.keep else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        try:
            peer = start_bootstrap(children, root, "internet", host=lab.address(0), prefix=lab.prefix(0))
            for index, name in enumerate(names, start=1):
                settings = list(args.set)
                if args.declare_uplink:
                    settings.append(f"comm.uplink_mbit={lab.links[index].up_mbit}")
                command = drill_command(
                    root,
                    name,
                    peer=peer,
                    steps=args.steps,
                    nodes=args.nodes,
                    size=args.size,
                    extra=[flag for setting in settings for flag in ("--set", setting)],
                    host=lab.address(index),
                    prefix=lab.prefix(index),
                )
                children.spawn(name, command, log_path=root / f"{name}.log")
            deadline = time.monotonic() + args.timeout
            for name in names:
                code = children.wait(name, timeout=max(1.0, deadline - time.monotonic()))
                if code != 0:
                    log = (root / f"{name}.log").read_text(errors="replace")[-2000:]
                    raise SystemExit(f"benchmarks.internet: error: {name} exited {code}\n{log}")
            logs = {name: _lines(root / name / "drill.jsonl") for name in names}
        finally:
            children.stop_all()
        payload = sync_bytes(args.size, args.nodes, config.comm)
        tcp_s = tcp_bulk_s(lab, list(range(1, args.nodes + 1)), int(payload)) if args.tcp_baseline else None
    keys = {name: logs[name][0]["node"] for name in names if logs[name]}
    hosts = {key: index for index, key in enumerate(keys.values(), start=1)}
    result = figures(logs, lab=lab, hosts=hosts, size=args.size, comm=config.comm)
    result.update(
        nodes=args.nodes,
        size=args.size,
        delay_ms=args.delay,
        jitter_ms=args.jitter,
        loss_pct=args.loss,
        up_mbit=args.up,
        down_mbit=args.down,
        settings=args.set,
        declare_uplink=args.declare_uplink,
        router=lab.counts,
        router_cpu_s=lab.router_cpu_s,
    )
    if tcp_s is not None:
        result.update(tcp_bulk_s=round(tcp_s, 3), tcp_bulk_mbit=round(payload * 8 / tcp_s / 1e6, 1))
    return result


def _lines(path: Path) -> list[dict[str, Any]]:
    return (
        [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    )


def figures(
    logs: dict[str, list[dict[str, Any]]],
    *,
    lab: Any,
    hosts: dict[str, int],
    size: int,
    comm: CommConfig,
) -> dict[str, Any]:
    """The per-step figures (see the module docstring) from the nodes' drill logs."""
    steps: dict[int, list[dict[str, Any]]] = {}
    given_up = 0
    for lines in logs.values():
        before = 0  # the node's lanes re-bound so far (a running count)
        for line in lines:
            if "given_up" in line:
                given_up += 1
            else:
                line["rebound_here"] = line.get("lanes_rebound", 0) - before
                before = line.get("lanes_rebound", 0)
                steps.setdefault(line["step"], []).append(line)
    rows = []
    for step, entries in sorted(steps.items()):
        members = [hosts[key] for key in entries[0]["members"] if key in hosts]
        n = len(members)
        if n < 2:
            continue
        payload = sync_bytes(size, n, comm)
        uplink = max(payload * 8 / (lab.links[m].up_mbit * 1e6) for m in members)
        slowest_path = max(lab.round_trip_s(a, b) / 2 for a in members for b in members if a != b)
        physical = uplink + sync_hops(n, comm) * slowest_path
        last_ready = max(entry["ready_time"] for entry in entries)
        decided = max(entry["ready_time"] + entry["election_s"] for entry in entries)
        allreduce = max(entry["allreduce_s"] for entry in entries)
        began = [entry["ready_time"] + entry["election_s"] for entry in entries]
        frames_in = max(b + e["connect_s"] + e["transfer_s"] for b, e in zip(began, entries, strict=True))
        results = max(
            b + e["connect_s"] + e["transfer_s"] + e["barrier_s"] for b, e in zip(began, entries, strict=True)
        )
        rows.append(
            {
                "step": step,
                "members": n,
                "hashes": len({entry["hash"] for entry in entries}),
                "attempts": max(entry["attempts"] for entry in entries),
                "allreduce_s": allreduce,
                "physical_s": round(physical, 3),
                "allreduce_ratio": round(allreduce / physical, 3),
                "decided_after_last_ready_s": round(max(0.0, decided - last_ready), 3),
                "election_rtts": (  # none where the paths have no delay (--delay 0)
                    round(max(0.0, decided - last_ready) / (2 * slowest_path), 2)
                    if slowest_path > 0
                    else math.nan
                ),
                "sync_s": max(entry["sync_s"] for entry in entries),
                **{key: max(entry[key] for entry in entries) for key in PHASES},
                "barrier_after_last_frame_s": round(results - frames_in, 3),
                "wire_overhead": round(max(entry["bytes_sent"] for entry in entries) / payload, 3),
                "lanes_rebound": sum(entry["rebound_here"] for entry in entries) // 2,  # both ends count
                "measured_rtt_ratio": _rtt_ratio(entries, lab=lab, hosts=hosts),
            }
        )
    timed = rows[1:] or rows

    def median(key: str) -> float:
        return round(statistics.median(row[key] for row in timed), 3) if timed else math.nan

    return {
        "ok": bool(rows) and given_up == 0 and all(row["hashes"] == 1 for row in rows),
        "steps_done": len(rows),
        "steps_given_up": given_up,
        "steps_with_two_results": sum(row["hashes"] > 1 for row in rows),
        **{key: median(key) for key in ("allreduce_s", "physical_s", "allreduce_ratio")},
        **{key: median(key) for key in ("decided_after_last_ready_s", "election_rtts", "sync_s")},
        **{key: median(key) for key in (*PHASES, "barrier_after_last_frame_s")},
        "wire_overhead": median("wire_overhead"),
        "lanes_rebound": median("lanes_rebound"),
        "measured_rtt_ratio": median("measured_rtt_ratio"),
        "per_step": rows,
    }


def _rtt_ratio(entries: list[dict[str, Any]], *, lab: Any, hosts: dict[str, int]) -> float:
    """Median over the members' lanes of the round trip the kernel measured over the path's own."""
    ratios = [
        measured / lab.round_trip_s(hosts[entry["node"]], hosts[peer])
        for entry in entries
        for peer, measured in entry.get("round_trips", {}).items()
        if peer in hosts and lab.round_trip_s(hosts[entry["node"]], hosts[peer]) > 0
    ]
    return round(statistics.median(ratios), 3) if ratios else math.nan


def main() -> None:
    arguments = parser(__doc__)
    arguments.add_argument("--nodes", type=int, default=4)
    arguments.add_argument("--steps", type=int, default=6)
    arguments.add_argument("--size", type=int, default=1 << 23, help="values per drill vector")
    add_path_flags(arguments, delay="25,40,55,75", up="50", down="200")
    arguments.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    arguments.add_argument("--keep", metavar="DIR", help="leave the nodes' folders and logs in DIR")
    arguments.add_argument(
        "--declare-uplink", action="store_true", help="set each node's comm.uplink_mbit to its --up"
    )
    arguments.add_argument(
        "--tcp-baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="after the drill, time plain TCP moving each node's payload to its successor",
    )
    arguments.add_argument("--timeout", type=float, default=900.0, help="seconds before giving up")
    args = arguments.parse_args()
    check_path_flags(arguments, args)
    if args.nodes < 2 or args.steps < 1 or args.size < 1:
        arguments.error("--nodes ≥ 2, --steps ≥ 1 and --size ≥ 1")
    try:
        load_config("debug", overrides=args.set)
    except ConfigError as exc:
        arguments.error(str(exc))
    from tests.support.internet import missing

    reason = missing()
    if reason is not None:
        report({"skipped": True, "reason": reason}, args.json)
        return
    unwind_on_sigterm()
    report(run(args), args.json)


if __name__ == "__main__":
    main()
