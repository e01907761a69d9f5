"""Drill nodes over the internet lab (internet.py, router.py): long round trips and lost packets.

The protocol, not the speed: every step done by every node with one result, no attempt retried,
nobody named; and the lab really is a long lossy path (packets were lost, no all-reduce beat the
path's one-way delays, and the round trips the nodes measured on their lanes are at least the
paths').
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.drills import assert_agreement, drill_args, finish
from tests.support.helpers import LocalSwarm
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


@pytest.mark.procs
def test_drill_over_long_lossy_paths(lab: InternetLab, swarm: LocalSwarm) -> None:
    steps = 3
    swarm.start_bootstrap(listen=f"/ip4/{lab.address(0)}/tcp/0", prefix=lab.prefix(0))
    names = [f"node{index}" for index in range(NODES)]
    for index, name in enumerate(names, start=1):
        host = lab.address(index)
        flags = [*drill_args(steps, NODES), "--size", "50000", "--set", f"node.data_host={host}"]
        swarm.start_node(
            name, None, *flags, command="drill", prefix=lab.prefix(index), listen=f"/ip4/{host}/tcp/0"
        )
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
