"""Over the internet lab (internet.py, router.py): long round trips and lost packets.

The protocol, not the speed. Drill nodes: every step done by every node with one result, no
attempt retried, nobody named; and the lab really is a long lossy path (packets were lost, no
all-reduce beat the path's one-way delays, and the round trips the nodes measured on their lanes
are at least the paths'). A joiner's checkpoint download whose source leaves halfway: resumed from
another holder where it stopped.
"""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from p2ptrain.ckpt.format import checkpoint_name
from p2ptrain.ckpt.manifest import build_manifest
from p2ptrain.procs import ChildProcesses
from tests.support.drills import assert_agreement, drill_args, finish
from tests.support.helpers import LocalSwarm, cli, wait_until
from tests.support.internet import InternetLab, links, running_lab

NODES = 3
DELAY_MS = [50, 50, 60, 75]
"""One-way delay to the core of the bootstrap peer's host and the nodes': round trips of 220–270 ms
between nodes."""
LOSS_PCT = 1.0


@pytest.fixture
def lab() -> Iterator[InternetLab]:
    paths = links(NODES + 1, delay_ms=DELAY_MS, loss_pct=[LOSS_PCT], up_mbit=[20], down_mbit=[50])
    with running_lab(paths, seed=1) as network:
        yield network


def start_lab_drill(swarm: LocalSwarm, lab: InternetLab, steps: int, nodes: int) -> list[str]:
    """A bootstrap peer on the lab's host 0 and `nodes` drill nodes on hosts 1, 2, …; their names."""
    swarm.start_bootstrap(listen=f"/ip4/{lab.address(0)}/tcp/0", prefix=lab.prefix(0))
    names = [f"node{index}" for index in range(nodes)]
    for index, name in enumerate(names, start=1):
        host = lab.address(index)
        flags = [*drill_args(steps, nodes), "--size", "50000", "--set", f"node.data_host={host}"]
        swarm.start_node(
            name, None, *flags, command="drill", prefix=lab.prefix(index), listen=f"/ip4/{host}/tcp/0"
        )
    return names


@pytest.mark.procs
def test_drill_over_long_lossy_paths(lab: InternetLab, swarm: LocalSwarm) -> None:
    steps = 3
    names = start_lab_drill(swarm, lab, steps, NODES)
    logs = finish(swarm, names)
    assert_agreement(logs, range(steps))
    # the fewest one-way delays of the shortest path an all-reduce can take: an open run's robust
    # aggregation takes the butterfly (one hop straight to each owner, n − 1 round the all-gather's
    # ring); the ring takes 2(n − 1)
    ring_delays = NODES * (DELAY_MS[1] + DELAY_MS[2]) / 1000
    host_of = {log[0]["node"]: index for index, log in enumerate(logs.values(), start=1)}
    for name, log in logs.items():
        assert [entry["attempts"] for entry in log] == [1] * steps, log
        assert all(entry["allreduce_s"] >= ring_delays for entry in log), log
        assert "naming" not in swarm.log(name)
        # the round trips a node measured (the kernel's, on the lanes it sent on) are the paths'
        for entry in log:
            assert entry["round_trips"], entry
            for peer, measured in entry["round_trips"].items():
                assert measured >= 0.95 * lab.round_trip_s(host_of[entry["node"]], host_of[peer]), entry
    swarm.stop()
    lab.stop()
    assert sum(host["lost"] for host in lab.counts.values()) > 0, lab.counts


LONG_DELAY_MS = [50, 200, 200]
"""The bootstrap's host and two nodes': 800 ms round trips between the nodes (a geostationary
satellite hop, or a home uplink whose queue fills under the all-reduce)."""


@pytest.fixture
def long_lab() -> Iterator[InternetLab]:
    with running_lab(links(3, delay_ms=LONG_DELAY_MS), seed=2) as network:
        yield network


@pytest.mark.procs
def test_a_long_path_gets_a_longer_deadline_and_the_status_shows_it(
    long_lab: InternetLab, swarm: LocalSwarm
) -> None:
    """The first step's deadline is comm.failure_timeout (5 s, no path measured yet); every later
    one is 8 round trips of the path the nodes measured (6.4 s and up, under the cap of 20 s); and
    `p2ptrain status` shows each node's round trip to the other, as the node measured it."""
    steps, nodes = 4, 2
    names = start_lab_drill(swarm, long_lab, steps, nodes)
    path_s = long_lab.round_trip_s(1, 2)
    status: list[dict] = []

    def shown() -> bool:
        """The nodes' rows with paths in them: their ready records for step 1 on carry them."""
        done = cli(
            "status",
            "--peer",
            swarm.bootstrap_addr,
            "--config",
            "debug",
            "--json",
            "--once",
            prefix=long_lab.prefix(0),
        )
        assert done.returncode == 0, done.stderr
        status[:] = [row for row in json.loads(done.stdout)["nodes"] if row["paths"]]
        return len(status) == nodes

    wait_until(shown, timeout=120)
    for row in status:
        (path,) = row["paths"]
        assert path["rtt_ms"] >= 0.95 * 1000 * path_s, row
    logs = finish(swarm, names)
    assert_agreement(logs, range(steps))
    for log in logs.values():
        assert log[0]["failure_timeout"] == 5.0, log[0]
        for entry in log[1:]:
            assert 0.95 * 8 * path_s <= entry["failure_timeout"] <= 20.0, entry


CKPT_STEP = 7
PARAMS_BYTES = 12 << 20
"""θ_outer of the checkpoint the joiner downloads."""
SERVE_MBPS = 12.0
"""The first holder serves at most this (node.serve_mbps), under its 20 Mbit/s uplink, so its
kernel holds little unsent: uncapped, a killed holder's kernel still sent the 4–6 MB its socket
had queued, which could have been the rest of the file."""


def holder_checkpoint(root: Path, node: int, params: bytes) -> Path:
    """A holder's checkpoints folder with step CKPT_STEP: the shared files alike on every holder,
    its own file (AdamW state, here 5,000 bytes of its index) its own."""
    folder = root / "checkpoints" / checkpoint_name(CKPT_STEP)
    folder.mkdir(parents=True)
    (folder / "params.safetensors").write_bytes(params)
    (folder / "outer.safetensors").write_bytes(params[:1000])
    (folder / "inner.safetensors").write_bytes(bytes([node]) * 5000)
    return root / "checkpoints"


@pytest.mark.procs
def test_a_checkpoint_download_survives_its_source_leaving_over_a_lossy_path(tmp_path: Path) -> None:
    """A joiner downloads a checkpoint from a holder 230 ms away over paths that lose 1 % of their
    packets; the holder (serving at most 12 Mbit/s) is SIGKILLed a third of the way through
    θ_outer. The rest comes from the other holder (270 ms away) by Range, from the byte the joiner
    had: no restart from zero, and the files in place are the holders' own, verified."""
    paths = links(3, delay_ms=[40, 60, 75], loss_pct=[1.0], up_mbit=[20], down_mbit=[50])
    params = os.urandom(PARAMS_BYTES)
    children = ChildProcesses()
    with running_lab(paths, seed=2) as lab:
        try:
            urls = []
            for node in (0, 1):
                checkpoints = holder_checkpoint(tmp_path / f"holder{node}", node, params)
                url_file = tmp_path / f"holder{node}.url"
                serve = ["serve", "--checkpoints", str(checkpoints), "--step", str(CKPT_STEP)]
                serve += ["--host", lab.address(node), "--url-file", str(url_file)]
                serve += ["--mbps", str(SERVE_MBPS if node == 0 else 0.0)]
                children.spawn(
                    f"holder{node}",
                    [*lab.prefix(node), sys.executable, "-m", "tests.support.ckpt_procs", *serve],
                    log_path=tmp_path / f"holder{node}.log",
                )
                wait_until(url_file.exists, timeout=60, what=f"holder{node}'s sidecar")
                urls.append(url_file.read_text())
            digest = build_manifest(
                tmp_path / "holder0" / "checkpoints" / checkpoint_name(CKPT_STEP), CKPT_STEP
            ).digest
            dest, out = tmp_path / "joiner", tmp_path / "fetched.json"
            fetch = ["fetch", "--digest", digest, "--holders", ",".join(urls), "--step", str(CKPT_STEP)]
            fetch += ["--dest", str(dest), "--out", str(out)]
            children.spawn(
                "joiner",
                [*lab.prefix(2), sys.executable, "-m", "tests.support.ckpt_procs", *fetch],
                log_path=tmp_path / "joiner.log",
            )
            partial = dest / f".{checkpoint_name(CKPT_STEP)}.download" / "params.safetensors"

            def a_third_in() -> bool:
                return partial.exists() and partial.stat().st_size >= PARAMS_BYTES // 3

            wait_until(a_third_in, timeout=120, interval=0.02, what="a third of θ_outer from holder0")
            had = partial.stat().st_size
            children.signal("holder0", signal.SIGKILL)
            assert children.wait("joiner", timeout=180) == 0, (tmp_path / "joiner.log").read_text()
        finally:
            children.stop_all()
    log = (tmp_path / "joiner.log").read_text()
    folder = Path(json.loads(out.read_text())["folder"])
    assert (folder / "params.safetensors").read_bytes() == params
    resumed = [
        int(at) for at in re.findall(rf"resuming params.safetensors from {urls[1]} at byte (\d+)", log)
    ]
    assert resumed and resumed[0] >= had, log  # from where it was, not from zero
    assert "params.safetensors from " + urls[0] in log  # it had come from the holder that left
    assert sum(host["lost"] for host in lab.counts.values()) > 0, lab.counts
