"""Shared helpers for tests that start real p2ptrain processes on 127.0.0.1."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

from p2ptrain.procs import ChildProcesses
from p2ptrain.train.metrics import read_metrics

LOOPBACK = "/ip4/127.0.0.1/tcp/0"
LIGHT_SETTINGS = ("model.seq_len=64", "train.batch_size=4")
"""What the tests' training nodes take per inner step: 4 sequences of 64 tokens of the debug model,
not its 8 of 256. A multi-process test checks the protocol (steps, members, hashes, faults), not the
model, and at 8 × 256 the ranks' arithmetic was most of the suite's CPU time."""
LIGHT = tuple(flag for setting in LIGHT_SETTINGS for flag in ("--set", setting))
"""LIGHT_SETTINGS as command-line flags."""
SOCKET_DIR = Path("/tmp")


def cli(
    *args: str,
    timeout: float = 60,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    prefix: tuple[str, ...] = (),
) -> subprocess.CompletedProcess[str]:
    """Run `python -m p2ptrain ARGS` (under a wrapper `prefix`) to completion and capture its output."""
    full_env = {key: value for key, value in os.environ.items() if key != "PEER"}
    full_env.update(env or {})
    return subprocess.run(
        [*prefix, sys.executable, "-m", "p2ptrain", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )


def wait_until(
    predicate: Callable[[], bool], timeout: float, *, interval: float = 0.2, what: str = "condition"
) -> None:
    """Poll `predicate` (a check of external state, e.g. the DHT) until true; fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def read_address(path: Path, timeout: float = 30) -> str:
    wait_until(path.exists, timeout, what=f"{path}")
    return path.read_text().split()[0]


def socket_files() -> set[Path]:
    return set(SOCKET_DIR.glob("hivemind-p2p*.sock"))


def stale_sockets(before: set[Path], settle: float = 3.0) -> set[Path]:
    """p2pd sockets that appeared since `before` and that no live p2pd uses (after `settle` s).

    Other tests may run beside this one (pytest -n): their daemons' sockets are in use, and those of
    a daemon that just died are removed by its DHT process within a moment; a leaked socket stays."""
    from p2ptrain.procs import is_alive
    from p2ptrain.swarm.dht_process import p2pd_sockets

    deadline = time.monotonic() + settle
    while True:
        in_use = {
            Path(path)
            for entry in os.listdir("/proc")
            if entry.isdigit() and is_alive(int(entry))
            for path in p2pd_sockets(int(entry))
        }
        stale = {path for path in socket_files() - before if path not in in_use}
        if not stale or time.monotonic() >= deadline:
            return stale
        time.sleep(0.1)


def assert_one_line_error(result: subprocess.CompletedProcess[str], *needles: str) -> None:
    """A user error: non-zero exit, one `p2ptrain: error:` line on stderr, no traceback."""
    assert result.returncode != 0, result
    assert "Traceback" not in result.stderr, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("p2ptrain: error:")]
    assert len(errors) == 1, result.stderr
    for needle in needles:
        assert needle in errors[0], errors[0]


class LocalSwarm:
    """A bootstrap peer and nodes, each a real `p2ptrain` process, stopped by PID at the end."""

    def __init__(self, root: Path):
        self.root = root
        self.children = ChildProcesses()
        self.bootstrap_addr = ""

    def start_bootstrap(
        self,
        name: str = "bootstrap",
        identity: str = "bootstrap",
        *,
        listen: str = LOOPBACK,
        prefix: tuple[str, ...] = (),
        extra: tuple[str, ...] = (),
    ) -> str:
        address_file = self.root / f"{name}.addr"
        address_file.unlink(missing_ok=True)
        self.children.spawn(
            name,
            [
                *prefix,
                sys.executable,
                "-m",
                "p2ptrain",
                "bootstrap",
                "--listen",
                listen,
                "--identity",
                str(self.root / identity),
                "--address-file",
                str(address_file),
                *extra,
            ],
            log_path=self.root / f"{name}.log",
        )
        self.bootstrap_addr = read_address(address_file)
        return self.bootstrap_addr

    def start_node(
        self,
        name: str,
        peer: str | None = None,
        *extra: str,
        command: Literal["watch", "drill", "join"] = "watch",
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
        listen: str = LOOPBACK,
    ) -> Path:
        """A node agent: `p2ptrain watch` (heartbeat only), `drill` or `join` (training, on light
        batches); `prefix` runs it under a wrapper command (`prlimit --nofile=…`, `ip netns exec`,
        which exec it)."""
        address_file = self.root / f"{name}.addr"
        if command == "watch":
            extra = ("--table-every", "0", *extra)
        elif command == "join":
            extra = (*LIGHT, *extra)
        self.children.spawn(
            name,
            [
                *prefix,
                sys.executable,
                "-m",
                "p2ptrain",
                command,
                "--peer",
                peer or self.bootstrap_addr,
                "--config",
                "debug",
                "--work-dir",
                str(self.root / name),
                "--listen",
                listen,
                "--address-file",
                str(address_file),
                *extra,
            ],
            log_path=self.root / f"{name}.log",
            # several nodes share this machine's cores: one torch thread each, as `p2ptrain demo` does
            # (three nodes with two OpenMP threads each on two cores run their steps ~4x slower)
            env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        )
        return address_file

    def status(self, peer: str | None = None, once: bool = True, prefix: tuple[str, ...] = ()) -> dict:
        """`p2ptrain status --json`: one read of the records (`--once`), or the full watch."""
        flags = ["--once"] if once else []
        result = cli(
            "status",
            "--peer",
            peer or self.bootstrap_addr,
            "--config",
            "debug",
            "--json",
            *flags,
            timeout=60,
            prefix=prefix,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.strip().splitlines()[-1])

    def live_ids(self, peer: str | None = None) -> set[str]:
        return {node["id"] for node in self.status(peer)["nodes"] if node["state"] != "dead"}

    def log(self, name: str) -> str:
        return (self.root / f"{name}.log").read_text(errors="replace")

    def stop(self) -> list[int]:
        return self.children.stop_all()


# ---- what training nodes leave in their work directories ------------------------------------


def metrics(work_dir: Path, kind: str) -> list[dict]:
    return [record for record in read_metrics(work_dir / "metrics.jsonl") if record["kind"] == kind]


def stalls(work_dirs: list[Path]) -> dict[int, float]:
    """Per outer step: seconds from the last member's last inner step before the step ended (its
    own phase's; with outer.overlap the next phase's, during which it synced) to its end.

    Time a fast node spends waiting for slower ones to finish their inner steps is not a stall."""
    ready: dict[int, float] = {}
    done: dict[int, float] = {}
    for work_dir in work_dirs:
        inner = metrics(work_dir, "inner")
        for record in metrics(work_dir, "outer"):
            step = record["step"]
            if not any(r["outer_step"] == step for r in inner):
                continue  # a step taken without inner steps (caught up, replayed): no ready time
            last_inner = max(r["time"] for r in inner if r["time"] <= record["time"])
            ready[step] = max(ready.get(step, 0.0), last_inner)
            done[step] = max(done.get(step, 0.0), record["time"])
    return {step: done[step] - ready[step] for step in done}


def params_hash_of(checkpoint: Path) -> str:
    """sha256 of the checkpoint's θ_outer, as the trainer computes it after an outer step."""
    from p2ptrain.config import load_config
    from p2ptrain.train.checkpoint import load_state
    from p2ptrain.train.layout import CanonicalLayout
    from p2ptrain.train.model import Transformer

    layout = CanonicalLayout.of(Transformer(load_config("debug").model))
    flat, _, _ = load_state(checkpoint, layout)
    return hashlib.sha256(flat.numpy().tobytes()).hexdigest()


def data_port(swarm: LocalSwarm, name: str, timeout: float) -> int:
    """The data port a node says it listens on ("data plane on port N"), once it has said so."""
    pattern = re.compile(r"data plane on port (\d+)")
    wait_until(lambda: pattern.search(swarm.log(name)) is not None, timeout, what=f"{name}'s data plane")
    match = pattern.search(swarm.log(name))
    assert match, swarm.log(name)
    return int(match.group(1))


async def settle(condition: Callable[[], bool], what: str, seconds: float = 15.0) -> None:
    """Until the server has taken the connections in (bounded: a busy machine takes its time)."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(what)
        await asyncio.sleep(0.01)


async def discard(*tasks: asyncio.Task) -> None:
    """Cancel tasks and retrieve what they ended with. A task that failed before its cancel and was
    never awaited logs "Task exception was never retrieved" whenever the garbage collector finds it;
    under Python 3.11 that log's traceback formatting parses source with `ast`, and inside another
    `ast` parse (np.load's header, seen in a later test of the same worker) it raised SystemError."""
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def outer_records(work_dir: Path) -> list[dict]:
    return [record for record in read_metrics(work_dir / "metrics.jsonl") if record["kind"] == "outer"]
