"""Watching a run: what a bootstrap peer and the nodes say about who joined, who left and why, a
training node's progress lines without a terminal, and `p2ptrain status` on an open or closed run."""

from __future__ import annotations

import json
import re
import signal
import time
from dataclasses import replace
from pathlib import Path

from p2ptrain.identity import create_key_file, load_key_file
from p2ptrain.swarm.records import Heartbeat, NodeState
from p2ptrain.swarm.roster import MAX_NAMED, MAX_NODES, STEPS_EVERY, Roster
from tests.support.helpers import LocalSwarm, cli, metrics, wait_until

RUN = "p2ptrain-debug"
DRILL = ["--set", 'node.data_host="127.0.0.1"', "--size", "50000", "--inner", "0.3"]
LEFT = re.compile(
    r"(?:node (\w{12}) left run '[^']*' \(([^;]+); \d+ live\)"  # one node
    r"|(\d+) nodes left run '[^']*' \(\d+ live\): (.*))"  # several: "a (why), b (why)"
)
ITEM = re.compile(r"(\w{12}) \(([^)]*)\)")


def departures(log: str) -> list[tuple[str, str]]:
    """(short node id, why) of every departure in a log, one-node lines and coalesced ones alike."""
    found = []
    for match in LEFT.finditer(log):
        if match.group(1):
            found.append((match.group(1), match.group(2)))
        else:
            found += ITEM.findall(match.group(4))
    return found


def joins(log: str) -> set[str]:
    """Short ids of the nodes a log says joined the run."""
    named = set(re.findall(rf"node (\w{{12}}) joined run '{RUN}'", log))
    for listed in re.findall(rf"\d+ nodes joined run '{RUN}' \(\d+ live\): ([^\n]*)", log):
        named.update(re.findall(r"\b(\w{12})\b", listed))
    return named


def drill_ids(swarm: LocalSwarm, name: str) -> str:
    """The short id of a drill node, from its first step's line."""
    path = swarm.root / name / "drill.jsonl"
    wait_until(lambda: path.exists() and path.read_text().strip() != "", 120, what=f"{name}'s first step")
    return json.loads(path.read_text().splitlines()[0])["node"][:12]


def test_the_bootstrap_and_a_node_say_who_joined_who_left_and_why(swarm: LocalSwarm) -> None:
    """Three nodes leave a drill of four: one by its deathrattle (SIGTERM), one crashed (SIGKILL:
    its port refuses, or it falls silent), one frozen (SIGSTOP: silent). The node left says each
    departure once with its reason; the bootstrap peer says who joined, who left, and how far the
    run got, at most one steps line per STEPS_EVERY seconds."""
    swarm.start_bootstrap()
    started = time.monotonic()
    names = [f"node{i}" for i in range(4)]
    for name in names:
        swarm.start_node(name, None, "--steps", "100000", "--nodes", "4", *DRILL, command="drill")
    ids = {name: drill_ids(swarm, name) for name in names}
    wait_until(lambda: joins(swarm.log("bootstrap")) >= set(ids.values()), 30, what="the bootstrap's joins")
    swarm.children.signal("node1", signal.SIGTERM)
    assert swarm.children.wait("node1", 10) == 0
    swarm.children.signal("node2", signal.SIGKILL)
    swarm.children.signal("node3", signal.SIGSTOP)
    gone = {ids["node1"], ids["node2"], ids["node3"]}

    def said(name: str) -> dict[str, str]:
        return dict(departures(swarm.log(name)))

    wait_until(lambda: set(said("node0")) >= gone, 60, what="node0's lines about the three departures")
    wait_until(lambda: set(said("bootstrap")) >= gone, 60, what="the bootstrap's lines about them")
    wait_until(lambda: "done by" in swarm.log("bootstrap"), 30, what="a steps line")
    swarm.children.signal("node3", signal.SIGKILL)
    for name in ("node0", "bootstrap"):
        reasons = said(name)
        assert reasons[ids["node1"]] == "deathrattle", (name, reasons)
        assert reasons[ids["node2"]].startswith(("crashed", "silent")), (name, reasons)
        assert reasons[ids["node3"]].startswith("silent"), (name, reasons)
        # one line per departure: each node left once
        keys = [key for key, _ in departures(swarm.log(name))]
        assert sorted(keys) == sorted(set(keys)), (name, keys)
    crashed = said("node0")[ids["node2"]]  # the bootstrap probes no port: silent there
    assert crashed.startswith("silent") or "refuses connections" in crashed, crashed
    steps = re.findall(rf"run '{RUN}': outer step (\d+) done by (\d+) nodes?", swarm.log("bootstrap"))
    elapsed = time.monotonic() - started  # after the log was read: no line of it is later
    assert 1 <= len(steps) <= 1 + elapsed / STEPS_EVERY, steps
    assert ids["node0"] not in said("node0"), "a node does not announce itself"


def test_a_node_without_a_terminal_prints_its_progress_every_interval(swarm: LocalSwarm) -> None:
    """Under systemd or nohup there is no progress bar: a line per `node.progress_interval`."""
    swarm.start_bootstrap()
    started = time.monotonic()
    swarm.start_node("node", None, "--set", "node.progress_interval=1", command="join")
    line = re.compile(r"^outer step \d+, inner step (\d+)/10, loss \d+\.\d{3}, [\d,]+ tok/s$", re.M)
    wait_until(lambda: len(line.findall(swarm.log("node"))) >= 3, 120, what="three progress lines")
    positions = [int(position) for position in line.findall(swarm.log("node"))]
    elapsed = time.monotonic() - started  # after the log was read: no line of it is later
    assert len(positions) <= 1 + elapsed / 1.0, positions  # at most one a second
    assert all(1 <= position <= 10 for position in positions), positions


def test_the_all_reduce_rate_is_the_transfers_not_the_wait(swarm: LocalSwarm) -> None:
    """A node that waits for a slower one in every sync: its rate counted bytes over the whole sync,
    the wait included (2 Mbit/s on a loopback that carried 200): the transfer's own time now."""
    swarm.start_bootstrap()
    both = ["--set", "swarm.wait_nodes=2", "--set", "train.max_steps=100000"]
    swarm.start_node("fast", None, *both, command="join")
    swarm.start_node("slow", None, *both, "--set", "train.batch_size=16", command="join")  # 4x the work

    def synced() -> list[dict]:
        return [r for r in metrics(swarm.root / "fast", "outer") if r["members"] == 2 and r["bytes_sent"]]

    wait_until(lambda: len(synced()) >= 3, 180, what="three outer steps of both nodes")
    fast = re.search(r"node (\w{12}): [\d.]+M parameters", swarm.log("fast"))
    assert fast is not None, swarm.log("fast")
    rates = {node["id"][:12]: node["allreduce_mbps"] for node in swarm.status()["nodes"]}
    with_the_wait = max(8 * r["bytes_sent"] / r["sync_s"] / 1e6 for r in synced())
    assert rates[fast.group(1)] > 2 * with_the_wait, (rates, synced())


def beat(index: int, seq: int, *, state: NodeState = NodeState.TRAINING, timestamp: float = 0.0) -> Heartbeat:
    return Heartbeat(
        run_id="r",
        node_key=index.to_bytes(4, "big") * 8,
        seq=seq,
        timestamp=timestamp,
        expiration=0.0,
        state=state,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_of_records_makes_no_more_lines_and_no_more_memory() -> None:
    """Keys are free in an open run: 20 000 strangers joining and leaving at once make one line
    each way (a few named, the rest counted), the roster remembers at most MAX_NODES, and nothing
    is said twice of one departure."""
    clock, lines = Clock(), list[str]()
    roster = Roster("r", timeout=6.0, say=lines.append, clock=clock)
    crowd = [beat(i, 1) for i in range(20000)]
    roster.update(crowd)
    assert len(lines) == 1 and lines[0].startswith(f"{MAX_NODES} nodes joined run 'r'"), lines
    assert lines[0].count(",") == MAX_NAMED - 1 and lines[0].endswith(f"and {MAX_NODES - MAX_NAMED} more")
    assert roster.live() == MAX_NODES
    clock.now += 7  # nobody's heartbeat advanced
    roster.update(crowd)
    roster.update(crowd)
    assert len(lines) == 2 and lines[1].startswith(f"{MAX_NODES} nodes left run 'r' (0 live)"), lines[1:]
    for _ in range(5):  # more reads, more time: nothing new to say
        clock.now += 10
        roster.update(crowd)
    assert len(lines) == 2, lines[2:]


def test_each_departure_is_said_once_with_its_reason() -> None:
    clock, lines = Clock(), list[str]()
    roster = Roster("r", timeout=6.0, say=lines.append, clock=clock, me=beat(0, 1).node_key)
    roster.update([beat(0, 1), beat(1, 1), beat(2, 1)])
    assert lines == [
        f"2 nodes joined run 'r' (3 live): {beat(1, 1).node_key.hex()[:12]}, {beat(2, 1).node_key.hex()[:12]}"
    ]
    clock.now += 10  # a line of a kind at most every LINE_GAP
    roster.update([beat(1, 2, state=NodeState.DEAD), beat(2, 2)])
    named = "named by 2 members it failed"
    roster.left_out(5, {beat(2, 2).node_key: named})
    roster.left_out(6, {beat(2, 2).node_key: named})  # still out: no line
    one, two = beat(1, 1).node_key.hex()[:12], beat(2, 1).node_key.hex()[:12]
    assert lines[1:] == [
        f"node {one} left run 'r' (deathrattle; 2 live)",
        f"node {two} left out by the evidence of a failed attempt (outer step 5: {named})",
    ]
    roster.crashed(beat(1, 2), "crashed: its data port refuses connections")  # gone already
    clock.now += 10
    roster.crashed(beat(2, 2), "crashed: its data port refuses connections")
    roster.update([beat(1, 2, state=NodeState.DEAD), beat(2, 2)])
    clock.now += 10
    roster.update([beat(2, 2)])
    assert lines[3:] == [f"node {two} left run 'r' (crashed: its data port refuses connections; 1 live)"]
    roster.update([beat(2, 3)])  # signed before the verdict, stored just before the crash, read late
    assert lines[4:] == []
    roster.update([beat(2, 4, timestamp=time.time() + 1)])  # restarted: its heartbeat advances again
    assert lines[4:] == [f"node {two} joined run 'r' (2 live)"]
    finished = replace(beat(2, 5, state=NodeState.DEAD), extra={"finished": True})
    clock.now += 10
    roster.update([finished])
    assert lines[5:] == [f"node {two} left run 'r' (finished the run; 1 live)"]


def test_a_deathrattle_read_just_after_a_crash_verdict_is_the_reason() -> None:
    """A node that stops cleanly closes its port as it leaves: a peer that probed it then reads its
    deathrattle a moment later, and says that, not a crash (seen: a clean exit said as a crash). A
    crash verdict with no such record is said two reads later."""
    clock, lines = Clock(), list[str]()
    roster = Roster("r", timeout=6.0, say=lines.append, clock=clock)
    roster.update([beat(1, 1), beat(2, 1)])
    refused = "crashed: its data port refuses connections"
    roster.crashed(beat(1, 1), refused)
    roster.update([beat(1, 1), beat(2, 2)])
    assert lines[1:] == [], "a crash verdict waits a read for the node's own word"
    roster.update([beat(1, 2, state=NodeState.DEAD), beat(2, 3)])
    one, two = beat(1, 1).node_key.hex()[:12], beat(2, 1).node_key.hex()[:12]
    assert lines[1:] == [f"node {one} left run 'r' (deathrattle; 1 live)"]
    clock.now += 5  # a line of a kind at most every LINE_GAP
    roster.crashed(beat(2, 3), refused)
    roster.update([beat(1, 2, state=NodeState.DEAD), beat(2, 4)])  # signed before the verdict
    assert lines[2:] == []
    roster.update([beat(1, 2, state=NodeState.DEAD), beat(2, 4)])
    assert lines[2:] == [f"node {two} left run 'r' ({refused}; 0 live)"]


def test_status_says_whether_the_run_is_open_or_closed_and_takes_no_fixed_wait(
    swarm: LocalSwarm, tmp_path: Path
) -> None:
    """Against a bootstrap peer with no node, `status` neither pauses between empty reads nor
    watches for heartbeats to stop (2 heartbeat intervals: two minutes at 60 s): nobody is there."""
    swarm.start_bootstrap()
    create_key_file(tmp_path / "authority.key")
    authority = load_key_file(tmp_path / "authority.key").node_id
    slow = ["--set", "swarm.heartbeat_interval=60"]
    common = ["status", "--peer", swarm.bootstrap_addr, "--config", "debug", *slow]
    opened = cli(*common, "--json", timeout=60)
    assert opened.returncode == 0, opened.stderr
    status = json.loads(opened.stdout.splitlines()[-1])
    assert (status["run"], status["access"], status["authority"], status["nodes"]) == (RUN, "open", None, [])
    assert status["progress"] == {"done": 0, "outer_steps": None, "tokens": 0, "tokens_per_s": 0}
    closed = cli(*common, "--json", "--set", f'run.authority="{authority}"', timeout=60)
    assert closed.returncode == 0, closed.stderr
    status = json.loads(closed.stdout.splitlines()[-1])
    assert (status["access"], status["authority"]) == ("closed", authority)
    table = cli(*common, "--once", "--set", f'run.authority="{authority}"', timeout=60)
    assert table.returncode == 0, table.stderr
    assert table.stdout.startswith(f"run '{RUN}': closed (nodes admitted by authority {authority[:12]}"), (
        table.stdout
    )
    table = cli(*common, "--once", timeout=60)
    assert table.stdout.startswith(f"run '{RUN}': open"), table.stdout


def test_a_record_claiming_a_far_step_does_not_stand_for_the_run() -> None:
    """One record that claims outer step 10**12 done (a stranger's) made the bootstrap say so and
    never say the run's real steps again: the line reports the step most live nodes report."""
    clock, lines = Clock(), list[str]()
    roster = Roster("r", timeout=6.0, say=lines.append, clock=clock, steps_every=1.0)

    def at(index: int, seq: int, step: int) -> Heartbeat:
        return replace(beat(index, seq), outer_step=step, params_hash="ab" * 32)

    liar = at(9, 1, 10**12)
    roster.update([at(1, 1, 3), at(2, 1, 3), liar])
    clock.now += 2
    roster.update([at(1, 2, 4), at(2, 2, 4), replace(liar, seq=2)])
    steps = [line for line in lines if "done by" in line]
    assert steps == ["run 'r': outer step 2 done by 2 nodes", "run 'r': outer step 3 done by 2 nodes"], lines
