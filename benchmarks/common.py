"""Timing helpers shared by the benchmarks."""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from p2ptrain.comm.reduce.gather import sparse_code
from p2ptrain.config import CommConfig
from p2ptrain.procs import ChildProcesses


def unwind_on_sigterm() -> None:
    """SIGTERM unwinds like Ctrl+C: the benchmark's `finally` blocks stop the processes it started
    and delete its network namespaces (without this, a killed benchmark left its nodes running)."""
    signal.signal(signal.SIGTERM, _unwind)


def _unwind(*_: object) -> None:
    # once: a second SIGTERM (`timeout` passes its own on to the child that pkill also reached) would
    # interrupt the cleanup the first one started, and leave the nodes and namespaces behind
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(143)


def payload_bytes(values: int, members: int, *, bits: int, block: int) -> float:
    """Bytes one member sends in an all-reduce of `values` among `members` (ring or butterfly alike):
    2(n − 1)/n of the vector, `bits` per value plus 8 bytes of block parameters per `block` values."""
    return 2 * (members - 1) / members * values * (bits / 8 + 8 / block)


def sync_bytes(values: int, members: int, comm: CommConfig) -> float:
    """Bytes one member sends in one sync under `comm`'s codec: the dense all-reduce's
    (`payload_bytes`), or under the sparse codec its share to each of the n − 1 others."""
    if comm.codec == "sparse":
        return (members - 1) * sparse_code(comm).payload_size(values)
    return payload_bytes(values, members, bits=comm.bits, block=comm.quant_block)


def sync_hops(members: int, comm: CommConfig) -> int:
    """One-way delays a sync takes at the least: the ring's 2(n − 1) (reduce-scatter and all-gather),
    or the sparse gather's one for its data and n − 1 for the completion barrier's sets."""
    return members if comm.codec == "sparse" else 2 * (members - 1)


def median_seconds(function: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median wall time of `function()` over `repeats` runs, after `warmup` untimed runs."""
    for _ in range(warmup):
        function()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", action="store_true", help="print only the JSON result line")
    return parser


def report(result: dict[str, Any], as_json: bool) -> None:
    if not as_json:
        for key, value in result.items():
            print(f"{key:>22}: {value}")
    print(json.dumps(result))


def wait_for_file(path: Path, timeout: float, benchmark: str) -> str:
    """The text of `path` once a process has written it (an address file); exits after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.1)
    raise SystemExit(f"benchmarks.{benchmark}: error: {path.name} did not appear within {timeout:.0f} s")


def start_bootstrap(
    children: ChildProcesses,
    root: Path,
    benchmark: str,
    *,
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
) -> str:
    """A bootstrap peer on `host` (run under `prefix`, e.g. `ip netns exec NS`) under `root`; its
    multiaddress."""
    address = root / "bootstrap.addr"
    children.spawn(
        "bootstrap",
        [
            *prefix,
            *(sys.executable, "-m", "p2ptrain", "bootstrap", "--listen", f"/ip4/{host}/tcp/0"),
            *("--identity", str(root / "bootstrap"), "--address-file", str(address)),
        ],
        log_path=root / "bootstrap.log",
    )
    return wait_for_file(address, 60, benchmark)


def drill_command(
    root: Path,
    name: str,
    *,
    peer: str,
    steps: int,
    nodes: int,
    size: int,
    extra: list[str],
    host: str = "127.0.0.1",
    prefix: Sequence[str] = (),
    inner: float = 0.3,
) -> list[str]:
    """`p2ptrain drill` for a node on `host` (run under `prefix`) that waits for `nodes` nodes,
    inner phases of up to `inner` seconds, vectors of `size` values."""
    where = ["--work-dir", str(root / name), "--listen", f"/ip4/{host}/tcp/0"]
    drill = ["--steps", str(steps), "--nodes", str(nodes), "--inner", str(inner), "--size", str(size)]
    peer_and_config = ["--peer", peer, "--config", "debug"]
    data_host = ["--set", f"node.data_host={host}"]
    command = [sys.executable, "-m", "p2ptrain", "drill", *peer_and_config, *where, *drill, *data_host]
    return [*prefix, *command, *extra]
