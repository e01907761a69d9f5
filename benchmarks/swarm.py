"""Does coordination eat the compute? A whole swarm on 127.0.0.1, measured from its own metrics.

    python -m benchmarks.swarm --json [--nodes 3] [--steps 10] [--kill-at 4] [--freeze] [--bandwidth MBIT]
                                      [--nat K] [--set KEY=VALUE ...] [--beside-default]
                                      [--delay MS,...] [--loss PCT,...] [--up MBIT,...] [--down MBIT,...]

Runs `p2ptrain demo` (bootstrap peer + nodes training the debug config with int8 DiLoCo; one node
SIGKILLed after --kill-at outer steps — SIGSTOPped with --freeze — and a new one joining) and
reads every node's metrics.jsonl:

- compute_util: time in inner steps / wall time between a node's first and last record, averaged
  over the nodes that ran from the start;
- outer_overhead_s: median over nodes and steps of the wall time the training loop spent between
  two inner phases (from the last inner step of one to the start of the first of the next: gather,
  election, all-reduce, Nesterov step, load; with outer.overlap only the wait for the previous
  step's sync and the local work);
- taken_after_steps (with outer.overlap): median over nodes and steps of the inner steps of the
  next phase after which a step's result was taken (τ; on arrival, what the sync took; H: the
  phase's end);
- join_s: the joiner's start → member of an outer step (it contributes from the next);
- recover_s: SIGKILL → the survivors' next completed outer step;
- recover_stall_s: what the fault cost the survivors: the wall time of their first outer step
  completed after it, minus the inner compute inside that step (the slowest survivor's).
Targets: outer_overhead_s ≤ 1 s on loopback; recover_s ≤ heartbeat_timeout + 5 s; recover_stall_s
≤ 1.5 s for a SIGKILL (its data port refuses: a crash is noticed at once), ≤ heartbeat_timeout +
1 s for a SIGSTOP (a frozen node's port still accepts: it goes by the heartbeat timeout).

With --bandwidth MBIT every process (the bootstrap peer, each node, the joiner) runs in its own
network namespace whose uplink tc limits to MBIT (benchmarks/netns.py; needs root), and the result
adds ideal_wire_s — the int8 all-reduce's bytes per member at MBIT — and the target
outer_overhead_s ≤ 1.2 × ideal_wire_s + 1 s. Where namespaces are not permitted it says so and
exits 0 with "skipped": true.

With --nat K (and --bandwidth) the first K nodes sit behind NAT routers of their own (nftables
masquerade, inbound dropped; --nodes defaults to 2K so the ring has room to keep them apart): the
swarm runs twice, all public, then with the K behind NAT, and the result gives both runs' figures
side by side ("public" and "nat"), with the fraction of outer steps in which the nodes behind NAT
were members, the bytes the public nodes relayed between two of them (relay_bytes: an edge between
two nodes behind NAT goes through a reachable member, comm/relay.py), and the ratio of the two
outer overheads. At least one node must be public (--nodes ≥ K + 1).

With any of --delay, --jitter, --loss, --up or --down (benchmarks/paths.py) every process runs on a
host of the internet lab instead: a namespace of its own behind a userspace router that gives its
path that delay, jitter, loss and those rates (--bandwidth sets the rates not given).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import itertools
import os
import statistics
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import parser, payload_bytes, report, unwind_on_sigterm
from benchmarks.paths import add_path_flags, check_path_flags, lab_figures, lab_for, wants_lab
from p2ptrain.config import load_config, parameter_count
from p2ptrain.demo import Host, Placement, run_demo
from p2ptrain.errors import ConfigError
from p2ptrain.train.metrics import read_metrics


def node_figures(records: list[dict[str, Any]], tokens_per_step: int) -> tuple[float, list[float]]:
    """(compute utilisation, outer overheads) of one node's metrics. An outer overhead is the time
    the training loop spent between two inner phases: from the last inner step of phase N to the
    start of the first of phase N + 1 (with outer.overlap the sync itself runs during phase N + 1,
    and only what the loop waited for shows)."""
    inner = [r for r in records if r["kind"] == "inner"]
    outer = [r for r in records if r["kind"] == "outer"]
    if len(inner) < 2 or not outer:
        return float("nan"), []
    busy = sum(tokens_per_step / r["tokens_per_s"] for r in inner if r["tokens_per_s"])
    wall = max(r["time"] for r in records) - min(r["time"] for r in inner) + busy / len(inner)
    overheads = []
    for before, after in itertools.pairwise(inner):
        if after["outer_step"] == before["outer_step"] + 1 and after["tokens_per_s"]:
            overheads.append(after["time"] - tokens_per_step / after["tokens_per_s"] - before["time"])
    return busy / wall, overheads


def stall_after(records: list[dict[str, Any]], moment: float, tokens_per_step: int) -> float | None:
    """Wall time of the first outer step completed after `moment`, minus its inner compute."""
    outer = sorted((r for r in records if r["kind"] == "outer"), key=lambda r: r["time"])
    after = [i for i, r in enumerate(outer) if r["time"] > moment]
    if not after or after[0] == 0:
        return None
    step, previous = outer[after[0]], outer[after[0] - 1]
    inner = [r for r in records if r["kind"] == "inner" and previous["time"] < r["time"] <= step["time"]]
    compute = sum(tokens_per_step / r["tokens_per_s"] for r in inner if r["tokens_per_s"])
    return step["time"] - previous["time"] - compute


def ideal_wire_s(parameters: int, members: int, *, block: int, mbit: float) -> float:
    """Seconds the int8 all-reduce needs on each member's uplink: 2(n−1)/n of the vector, 1 byte per
    value plus 8 bytes of block parameters per `block` values."""
    return payload_bytes(parameters, members, bits=8, block=block) * 8 / (mbit * 1e6)


@contextlib.contextmanager
def work_folder(keep: Path | None) -> Iterator[str]:
    """A temporary folder, or `keep` (made fresh, left behind for a look at the nodes' logs)."""
    if keep is None:
        with tempfile.TemporaryDirectory() as work:
            yield work
        return
    keep.mkdir(parents=True, exist_ok=True)
    yield str(keep)


@contextlib.contextmanager
def placement(
    nodes: int, mbit: float, nat: int = 0, paths: argparse.Namespace | None = None
) -> Iterator[Placement]:
    """Loopback for everyone, or (with `mbit`) one tc-limited namespace per process, node0 … node{nat-1}
    behind NAT routers, or (with `paths`) one host of the internet lab per process."""
    names = ["bootstrap", *(f"node{index}" for index in range(nodes + 1))]  # the joiner is the last
    if paths is not None:
        with lab_for(paths, len(names), rate=mbit or None) as lab:
            hosts = {name: Host(lab.address(i), lab.prefix(i)) for i, name in enumerate(names)}
            yield hosts.__getitem__
        return
    if not mbit:
        yield lambda name: Host()
        return
    from benchmarks.netns import limited_network

    with limited_network(len(names), mbit, behind_nat=range(1, nat + 1)) as network:
        hosts = {name: Host(network.addresses[i], tuple(network.prefix(i))) for i, name in enumerate(names)}
        yield hosts.__getitem__


def run(
    nodes: int,
    steps: int,
    *,
    kill_at: int,
    freeze: bool,
    mbit: float,
    quiet: bool,
    nat: int = 0,
    settings: Sequence[str] = (),
    keep: Path | None = None,
    paths: argparse.Namespace | None = None,
) -> dict[str, Any]:
    debug = load_config("debug", overrides=settings)
    tokens_per_step = debug.train.batch_size * debug.model.seq_len
    with work_folder(keep) as work, placement(nodes, mbit, nat, paths) as place:
        summary = run_demo(
            Path(work),
            nodes=nodes,
            steps=steps,
            kill_at=kill_at,
            freeze=freeze,
            quiet=quiet,
            place=place,
            settings=settings,
        )
        names = [f"node{i}" for i in range(nodes)]
        records = {name: read_metrics(Path(work) / name / "metrics.jsonl") for name in names}
    hidden = [outer for name in names[:nat] for outer in records[name] if outer["kind"] == "outer"]
    starters = [name for name in names if name != summary["killed"]]
    utils, overheads = [], []
    for name in starters:
        util, node_overheads = node_figures(records[name], tokens_per_step)
        utils.append(util)
        overheads += node_overheads
    recover_s = recover_stall_s = None
    if summary["killed_at"]:
        killed_at = summary["killed_at"]
        after = [
            min(
                (r["time"] for r in records[name] if r["kind"] == "outer" and r["time"] > killed_at),
                default=None,
            )
            for name in starters
        ]
        firsts = [first for first in after if first is not None]
        if firsts and len(firsts) == len(after):
            recover_s = round(max(firsts) - killed_at, 2)
        stalls = [stall_after(records[name], killed_at, tokens_per_step) for name in starters]
        if stalls and all(stall is not None for stall in stalls):
            recover_stall_s = round(max(s for s in stalls if s is not None), 2)
    result = {
        "ok": summary["ok"],
        "nodes": nodes,
        "outer_steps": summary["outer_steps"],
        "compute_util": round(statistics.mean(utils), 3),
        "outer_overhead_s": round(statistics.median(overheads), 3),
        "join_s": summary["join_s"],
        "fault": "SIGSTOP" if freeze else "SIGKILL",
        "recover_s": recover_s,
        "recover_stall_s": recover_stall_s,
        "params_hash_agree": summary["params_hash_agree"],
        "seconds": summary["seconds"],
    }
    taken = [r["taken_after_steps"] for n in starters for r in records[n] if "taken_after_steps" in r]
    if taken:
        result["taken_after_steps"] = statistics.median(taken)
    if nat:
        # outer records of the nodes behind NAT: `members` > 1 means they took part with the others
        with_others = [outer for outer in hidden if outer.get("members", 0) > 1]
        result["nat_member_fraction"] = round(len(with_others) / max(1, result["outer_steps"] * nat), 3)
        relayed = [max((r.get("relayed_bytes", 0) for r in records[name]), default=0) for name in records]
        result["relay_bytes"] = sum(relayed)
    if paths is not None:
        result.update(lab_figures(paths))
    if mbit:
        parameters = parameter_count(debug.model)
        ideal = ideal_wire_s(parameters, nodes, block=debug.comm.quant_block, mbit=mbit)
        result.update(
            bandwidth_mbit=mbit,
            ideal_wire_s=round(ideal, 3),
            outer_overhead_target_s=round(1.2 * ideal + 1, 3),
        )
    return result


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument("--nodes", type=int, default=None, help="default 3, or 2K with --nat K")
    cli.add_argument("--steps", type=int, default=10)
    cli.add_argument("--kill-at", type=int, default=4)
    cli.add_argument("--freeze", action="store_true", help="SIGSTOP the node instead of SIGKILL")
    cli.add_argument(
        "--bandwidth", type=float, default=0.0, metavar="MBIT", help="limit every process's uplink to MBIT"
    )
    cli.add_argument("--nat", type=int, default=0, metavar="K", help="put the first K nodes behind NAT")
    cli.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override for every node"
    )
    cli.add_argument("--keep", metavar="DIR", help="leave the (last) run's nodes' folders and logs in DIR")
    cli.add_argument(
        "--beside-default",
        action="store_true",
        help="with --set: run the default settings first, and give both results side by side",
    )
    add_path_flags(cli)
    args = cli.parse_args()
    check_path_flags(cli, args)
    if wants_lab(args) and args.nat:
        cli.error("--nat cannot be combined with the lab's flags yet (the lab has no NAT routers)")
    if args.bandwidth < 0:
        cli.error("--bandwidth must be a positive number of Mbit/s")
    if args.nat < 0 or (args.nat and not args.bandwidth):
        cli.error("--nat K needs K ≥ 0 and --bandwidth (the NAT routers are network namespaces)")
    nodes = args.nodes if args.nodes is not None else max(3, 2 * args.nat)
    if args.nat and nodes < args.nat + 1:
        cli.error(f"--nat {args.nat} needs --nodes ≥ {args.nat + 1} (a reachable node to relay through)")
    unwind_on_sigterm()
    if (args.bandwidth or wants_lab(args)) and os.geteuid() != 0:
        reason = "--bandwidth and the lab's flags need root for network namespaces"
        report({"skipped": True, "reason": reason}, args.json)
        return
    from benchmarks.netns import NamespacesUnavailable

    try:
        config_error = None
        try:
            load_config("debug", overrides=args.set)
        except ConfigError as exc:
            config_error = str(exc)
        if config_error:
            cli.error(config_error)
        keep = Path(args.keep) if args.keep else None
        beside = args.set and args.beside_default
        # one swarm of this command line: the runs below differ only in what they add
        swarm = functools.partial(
            run,
            nodes,
            args.steps,
            kill_at=args.kill_at,
            freeze=args.freeze,
            mbit=args.bandwidth,
            quiet=args.json,
            paths=args if wants_lab(args) else None,
        )
        default = swarm() if beside else None
        result = swarm(settings=args.set, keep=keep)
        if default is not None:
            report(
                {
                    "ok": default["ok"] and result["ok"],
                    "settings": args.set,
                    "default": default,
                    "with_settings": result,
                    "compute_util_ratio": round(result["compute_util"] / default["compute_util"], 3),
                },
                args.json,
            )
            return
        if args.nat:
            behind = swarm(nat=args.nat, settings=args.set)
            ratio = (
                behind["outer_overhead_s"] / result["outer_overhead_s"]
                if result["outer_overhead_s"]
                else None
            )
            result = {
                "ok": result["ok"] and behind["ok"],
                "nat": args.nat,
                "public": result,
                "behind_nat": behind,
                "outer_overhead_ratio": round(ratio, 3) if ratio is not None else None,
            }
    except NamespacesUnavailable as exc:
        report({"skipped": True, "reason": f"network namespaces not permitted here: {exc}"}, args.json)
        return
    report(result, args.json)


if __name__ == "__main__":
    main()
