"""How a node's cost per outer step grows with the swarm: drill swarms here, simulated to 1000.

    python -m benchmarks.scale --json [--drill 2,4,8,16] [--steps 10] [--plot scale.png]
                                      [--simulate 100,300,1000] [--repeats 5] [--set KEY=VALUE]

Drill swarms (`--drill`, '' for none): real swarms of n drill nodes on 127.0.0.1, their figures
per n and a fitted exponent per figure (cost ∝ n^k): see benchmarks/scale_drill.py.

Simulation (`--simulate`, '' for none), no network: n synthetic nodes with real Ed25519 keys
publish signed "ready" records (each with a data address, a token count and up to 16 measured slow
links, as real records carry), and this process runs, per n, what a node runs on them in one
election poll:

- decode_cold_s: decoding and verifying every record (msgpack + Ed25519), as a node's first read;
- decode_s: the same in steady state: a node reads about four times per heartbeat, so a quarter
  of the records are new since its last read and the rest were verified then (`VerifiedRecords`);
- judge_s: liveness (`SwarmView.judge`);
- decide_s: the election itself (`decide`: ready and expected sets, evidence, measured links, ring
  order, keeping nodes behind NAT apart), one tenth of them behind NAT;
- digest_s: the membership digest; schedule_s: the butterfly schedule and who dials whom.
Each figure is the median of --repeats runs; `election_s` is their sum (one poll). A node polls
about four times a second while it waits. Target: election_s ≤ 0.1 s at 1000 nodes on one core.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from benchmarks.common import parser, report, unwind_on_sigterm
from benchmarks.scale_drill import exponents, plot, run_swarm
from p2ptrain.comm.net.members import membership_digest
from p2ptrain.comm.reduce.connect import LanePlan
from p2ptrain.comm.reduce.schedule import Schedule
from p2ptrain.config import CommConfig
from p2ptrain.identity import NodeIdentity
from p2ptrain.swarm.dht import SwarmDHT
from p2ptrain.swarm.election import LINK_PREFIX_HEX, LINKS_FIELD, Election, decide
from p2ptrain.swarm.membership import SwarmView, VerifiedRecords, decode_all
from p2ptrain.swarm.records import Heartbeat, NodeState
from p2ptrain.untrusted import ThrottledLog

STEP = 42
RUN = "scale"


def synthetic_records(n: int, seed: int = 0, seq: int = 1) -> dict[bytes, bytes]:
    """n signed ready records for STEP (subkey → value); a tenth behind NAT; each naming up to 16
    slow links. The same `seed` gives the same nodes; another `seq` their next records."""
    rng = random.Random(seed)
    identities = [
        NodeIdentity(Ed25519PrivateKey.from_private_bytes(rng.randbytes(32)), Path("synthetic"))
        for _ in range(n)
    ]
    prefixes = [identity.public_key.hex()[:LINK_PREFIX_HEX] for identity in identities]
    values = {}
    for index, identity in enumerate(identities):
        links = {prefix: rng.randint(1_000_000, 50_000_000) for prefix in rng.sample(prefixes, min(16, n))}
        beat = Heartbeat(
            run_id=RUN,
            node_key=identity.public_key,
            seq=seq,
            timestamp=time.time(),
            expiration=time.time() + 60,
            state=NodeState.READY,
            outer_step=STEP,
            data_addr=f"10.{index // 65536}.{index // 256 % 256}.{index % 256}:7000",
            ckpt_addr=f"http://10.0.{index // 256}.{index % 256}:7001",
            tokens=rng.randint(1, 4096),
            config_digest="c" * 16,
            data_reach="closed" if index % 10 == 0 else "open",
            extra={LINKS_FIELD: links},
        )
        values[identity.public_key] = beat.sign(identity)
    return values


def median_time(work: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        started = time.perf_counter()
        result = work()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


@dataclass(frozen=True)
class Value:
    """What the DHT hands the reader for one subkey."""

    value: bytes


def one_size(n: int, repeats: int) -> dict[str, Any]:
    first, second = synthetic_records(n), synthetic_records(n, seq=2)
    refusals = ThrottledLog(logging.getLogger(__name__))
    reads = [(key, Value(value)) for key, value in first.items()]
    decode_cold_s, beats = median_time(
        lambda: decode_all(reads, RUN, refusals=refusals, verified=VerifiedRecords()), repeats
    )
    # a quarter of the nodes published their next record since the last read
    changed = set(list(first)[: n // 4])
    later = [(key, Value(second[key] if key in changed else value)) for key, value in first.items()]

    def steady() -> list[Heartbeat]:
        verified = VerifiedRecords()
        decode_all(reads, RUN, refusals=refusals, verified=verified)
        started = time.perf_counter()
        result = decode_all(later, RUN, refusals=refusals, verified=verified)
        steady_times.append(time.perf_counter() - started)
        return result

    steady_times: list[float] = []
    for _ in range(repeats):
        steady()
    decode_s = statistics.median(steady_times)
    view = SwarmView(cast(SwarmDHT, None), RUN, timeout=6.0)  # judge() never reads the DHT
    judge_s, live = median_time(lambda: view.judge(beats), repeats)
    decide_s, election = median_time(lambda: decide(live, STEP, deadline_passed=True), repeats)
    assert isinstance(election, Election) and election.members, "every node is ready: an election"
    digest_s, _ = median_time(lambda: membership_digest(STEP, election.members), repeats)
    comm = CommConfig(topology="butterfly")

    def schedule() -> LanePlan:
        plan = Schedule.of(index=0, n=len(election.members), length=1 << 20, comm=comm)
        return LanePlan.of(election.members, plan)

    schedule_s, _ = median_time(schedule, repeats)
    figures = {"decode_s": decode_s, "judge_s": judge_s, "decide_s": decide_s, "digest_s": digest_s}
    figures["schedule_s"] = schedule_s
    row: dict[str, Any] = {"n": n, "members": len(election.members), "decode_cold_s": round(decode_cold_s, 5)}
    row.update({key: round(value, 5) for key, value in figures.items()})
    row["election_s"] = round(sum(figures.values()), 4)
    return row


def main() -> None:
    cli = parser(__doc__)
    cli.add_argument(
        "--drill", default="2,4,8,16", help="drill swarm sizes run on this machine ('' for none)"
    )
    cli.add_argument("--steps", type=int, default=10, help="outer steps per drill swarm")
    cli.add_argument("--simulate", default="100,300,1000", help="simulated swarm sizes ('' for none)")
    cli.add_argument("--repeats", type=int, default=5)
    cli.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="for the drill nodes")
    cli.add_argument("--plot", default="", metavar="PNG", help="plot the drill figures against n")
    cli.add_argument("--keep", default="", metavar="DIR", help="keep the drill nodes' logs in DIR")
    args = cli.parse_args()
    unwind_on_sigterm()
    drilled_sizes, simulated_sizes = (
        _sizes(cli, "--drill", args.drill),
        _sizes(cli, "--simulate", args.simulate),
    )
    if args.repeats < 1 or args.steps < 3:
        cli.error("--repeats must be ≥ 1 and --steps ≥ 3")
    result: dict[str, Any] = {}
    if drilled_sizes:
        settings = [item for pair in args.set for item in ("--set", pair)]
        drilled = []
        for n in drilled_sizes:
            drilled.append(
                run_swarm(n, args.steps, settings=settings, keep=Path(args.keep) if args.keep else None)
            )
            if not args.json:
                print(json.dumps(drilled[-1]), file=sys.stderr, flush=True)
        result["drilled"] = drilled
        result["exponents"] = exponents(drilled)
        if args.plot:
            plot(drilled, Path(args.plot))
    if simulated_sizes:
        rows = [one_size(n, args.repeats) for n in simulated_sizes]
        largest = rows[-1]
        result["simulated"] = rows
        result["election_s_at_largest"] = largest["election_s"]
        result["target_s"] = 0.1
        result["ok"] = largest["n"] < 1000 or largest["election_s"] <= 0.1
    report(result, args.json)


def _sizes(cli: argparse.ArgumentParser, flag: str, text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        cli.error(f"{flag} takes comma-separated node counts, got {text!r}")
    if sizes and min(sizes) < 2:
        cli.error(f"{flag} needs sizes ≥ 2")
    return sizes


if __name__ == "__main__":
    main()
