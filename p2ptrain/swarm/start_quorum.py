"""`swarm.wait_nodes`: a run starts once that many nodes are there, and takes its first step with them.

Two waits, because a node's record is in the DHT seconds before its ranks train: they import torch,
and a node behind NAT probes its reachability first. Before its ranks start, a node waits for
`wait_nodes` records (`wait_for_nodes`). Before its first outer step it waits again, until that
many nodes are in the steps at that step or past it (`wait_for_first_step`): counting records
alone, the fastest nodes of a fresh run took their first steps while a slower one was still
`joining`, which nobody's election waits for, and it replayed them instead of contributing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import TextIO

from p2ptrain.config import Config
from p2ptrain.deadline import pause
from p2ptrain.errors import UserError
from p2ptrain.swarm.election import IN_STEPS
from p2ptrain.swarm.membership import SwarmView, finished_run, live
from p2ptrain.swarm.records import Heartbeat, NodeState

log = logging.getLogger(__name__)


async def wait_for_nodes(
    config: Config, view: SwarmView, *, stop: asyncio.Event, out: TextIO, count: int
) -> None:
    """Return once `count` live nodes are in the swarm table (UserError after election_timeout)."""
    if count <= 1:
        return
    print(f"waiting for {count} nodes to join", file=out, flush=True)
    deadline = time.monotonic() + config.swarm.election_timeout
    while len(live(await view.read())) < count and not stop.is_set():
        if time.monotonic() > deadline:
            waited = f"fewer than {count} nodes joined within {config.swarm.election_timeout:.0f} s"
            raise UserError(
                f"{waited}: {run_over(config.run.id, view.finished)}" if view.finished else waited
            )
        await pause_a_beat(config, stop)


def run_over(run_id: str, finished: Mapping[bytes, int]) -> str:
    """What to tell a node that came after the nodes of `finished` (node → its last outer step)
    ended the run and left. Only the wording of a wait that failed anyway: a stranger's lying
    "finished" record cannot end a node's wait this way."""
    return (
        f"run {run_id!r} is over: {len(finished)} node(s) finished it after {max(finished.values())} "
        "outer steps and left, and none is left to offer its checkpoint (a new run needs another run.id)"
    )


def at_or_past(beat: Heartbeat, step: int) -> bool:
    """The node is in the steps at `step` or a later one, or finished the run."""
    return (beat.state in IN_STEPS and beat.outer_step >= step) or finished_run(beat)


async def wait_for_first_step(
    config: Config, view: SwarmView, *, stop: asyncio.Event, step: int, me: bytes
) -> None:
    """Before this node's first outer step `step` of a run that starts: wait until `wait_nodes`
    nodes (this one included) are at that step or past it, while any node is still starting.

    Returns at once in a run already past `step` (a node restarting from its own checkpoint), and
    after election_timeout at the latest: a node that never gets its ranks going (out of memory,
    killed) delays the first step, it does not stop the run."""
    count = config.swarm.wait_nodes
    deadline = time.monotonic() + config.swarm.election_timeout
    while count > 1 and not stop.is_set():
        others = [beat for beat in live(await view.read()) if beat.node_key != me]
        there = 1 + sum(at_or_past(beat, step) for beat in others)
        starting = sum(beat.state is NodeState.JOINING for beat in others)
        in_progress = any(at_or_past(beat, step + 1) for beat in others)
        if there >= count or not starting or in_progress:
            return
        if time.monotonic() > deadline:
            log.warning(
                "outer step %d: %d of %d nodes, %d still starting: going on", step, there, count, starting
            )
            return
        await pause_a_beat(config, stop)


async def pause_a_beat(config: Config, stop: asyncio.Event) -> None:
    """Half a heartbeat interval between two reads of the swarm, or less if `stop` is set."""
    await pause(stop, config.swarm.heartbeat_interval / 2)
