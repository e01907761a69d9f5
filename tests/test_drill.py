"""Election and all-reduce together: real node agents (`p2ptrain drill`) on 127.0.0.1."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.support.drills import DRILL, assert_agreement, drill_log, finish, start_drill
from tests.support.helpers import LocalSwarm

pytestmark = pytest.mark.procs
"""Every test here starts processes."""

BEHIND, AHEAD = {"P2PTRAIN_INJECT_CLOCK_OFFSET": "-5"}, {"P2PTRAIN_INJECT_CLOCK_OFFSET": "5"}
"""Wall clocks 5 s off. Against the 6 s heartbeat_timeout, DHT expiration alone would make the records
of a clock behind expire after 1 s everywhere, and a clock ahead see everyone else's that way."""


def test_four_nodes_two_with_clocks_5s_off_agree_on_members_order_and_result_for_20_steps(
    swarm: LocalSwarm,
) -> None:
    swarm.start_bootstrap()
    names = [f"node{i}" for i in range(4)]
    clocks = {"node1": BEHIND, "node2": AHEAD}
    for name in names:
        drill = [
            "--steps",
            "20",
            "--nodes",
            "4",
            "--inner",
            "0.5",
            "--set",
            "swarm.push_records=true",
        ]
        swarm.start_node(name, None, *drill, *DRILL, command="drill", env=clocks.get(name))
    for name in names:
        assert swarm.children.wait(name, timeout=180) == 0, swarm.log(name)
    logs = {name: drill_log(swarm, name) for name in names}
    assert all(len(log) == 20 for log in logs.values())
    assert_agreement(logs, range(20))
    assert all(len(entry["members"]) == 4 for log in logs.values() for entry in log)
    orders = {tuple(entry["members"]) for entry in logs["node0"]}
    assert len(orders) > 1, "the ring order should rotate between steps"
    # every node pushed its ready records to the others, and pushed records reached their views
    # before the DHT's copies did (record_push.py)
    pushed, taken = zip(*(log[-1]["records"] for log in logs.values()), strict=True)
    assert all(sent > 0 for sent in pushed) and sum(taken) > 0, (pushed, taken)


def test_survivors_go_on_after_a_member_is_killed(swarm: LocalSwarm) -> None:
    # node2's clock runs ahead: its last records stay in the DHT long after it dies; and the DHT
    # alone carries the ready records here (swarm.push_records off: a swarm's other way)
    names = start_drill(
        swarm,
        14,
        *("--set", "swarm.straggler_deadline=2", "--set", "swarm.push_records=false"),
        env={"node2": AHEAD},
    )
    swarm.children.signal("node2", signal.SIGKILL)
    logs = finish(swarm, names[:2])
    assert all(len(log) == 14 for log in logs.values()), logs
    assert_agreement(logs, range(14))
    assert len(logs["node0"][-1]["members"]) == 2, "the killed node must be out of the later steps"
    # the step during which the node died completed within heartbeat timeout + the ring's failure bound
    slowest = max(entry["sync_s"] for entry in logs["node0"])
    assert slowest <= 6 + 5 + 2, slowest


def test_a_crashed_member_is_left_out_at_once_not_at_the_heartbeat_timeout(swarm: LocalSwarm) -> None:
    """Its data port refuses connections, which says the process is gone: the survivors do not wait
    for the 30 s heartbeat timeout (nor the 60 s straggler deadline) to go on without it."""
    slow_to_notice = ["--set", "swarm.heartbeat_timeout=30", "--set", "swarm.straggler_deadline=60"]
    names = start_drill(swarm, 10, *slow_to_notice)
    swarm.children.signal("node2", signal.SIGKILL)
    logs = finish(swarm, names[:2])
    assert_agreement(logs, range(10))
    assert len(logs["node0"][-1]["members"]) == 2, "the killed node must be out of the later steps"
    waits = [entry["sync_s"] for entry in logs["node0"]]
    assert max(waits) < 10, (waits, swarm.log("node0")[-4000:])
    assert "refuses connections" in swarm.log("node0")


def test_drill_rejects_bad_arguments(tmp_path: Path) -> None:
    from tests.support.helpers import assert_one_line_error, cli

    assert_one_line_error(cli("drill", "--work-dir", str(tmp_path), "--steps", "-1"), "--steps")
    # the flags `join` took before drills and watching were commands: one line saying where they went
    assert_one_line_error(cli("join", "--work-dir", str(tmp_path), "--drill", "5"), "p2ptrain drill --steps")
    assert_one_line_error(cli("join", "--work-dir", str(tmp_path), "--observe"), "p2ptrain watch")


def test_elections_go_on_after_the_bootstrap_peer_dies(swarm: LocalSwarm) -> None:
    names = start_drill(swarm, 12)
    swarm.children.signal("bootstrap", signal.SIGKILL)
    logs = finish(swarm, names)
    assert all(len(log) == 12 for log in logs.values())
    assert_agreement(logs, range(12))
    assert all(len(entry["members"]) == 3 for log in logs.values() for entry in log)


def test_a_node_stopped_with_sigterm_is_dropped_without_waiting_for_its_timeout(swarm: LocalSwarm) -> None:
    names = start_drill(swarm, 12)
    swarm.children.signal("node2", signal.SIGTERM)
    assert swarm.children.wait("node2", timeout=5) == 0
    assert "deathrattle sent" in swarm.log("node2")
    logs = finish(swarm, names[:2])
    assert_agreement(logs, range(12))
    assert len(logs["node0"][-1]["members"]) == 2
    # no step waited for the heartbeat timeout (6 s): the deathrattle removed node2 at once
    assert max(entry["sync_s"] for entry in logs["node0"]) < 5, [e["sync_s"] for e in logs["node0"]]


def test_eight_nodes_agree_on_every_step(swarm: LocalSwarm) -> None:
    """The largest swarm in the suite (24 processes with their DHT children and p2pds): every
    node takes every step with all eight, one digest and one result per step."""
    names = start_drill(swarm, 8, nodes=8)
    logs = finish(swarm, names)
    assert all(len(log) == 8 for log in logs.values()), {name: len(log) for name, log in logs.items()}
    assert_agreement(logs, range(8))
    assert all(len(entry["members"]) == 8 for entry in logs["node0"]), [e["members"] for e in logs["node0"]]


def test_a_node_that_gave_a_step_up_takes_the_next_one_only_after_the_others_finished_it(
    swarm: LocalSwarm,
) -> None:
    """node2 gives step 2 up (fault) while node0 waits 6 s for node1's late ready(2). Taking step 3
    at once, alone after the 2 s straggler deadline (nobody else is at 3 yet), would give step 3 two
    results: it waits until the others are done with step 2, and step 3 has one result."""
    faults = {"node1": {"P2PTRAIN_INJECT_LATE": "2:6"}, "node2": {"P2PTRAIN_INJECT_GIVE_UP": "2"}}
    names = start_drill(swarm, 6, "--set", "swarm.straggler_deadline=2", env=faults)
    logs = finish(swarm, names)
    assert [entry["step"] for entry in logs["node2"]] == list(range(6))
    assert "given_up" in logs["node2"][2] and "fault injection" in logs["node2"][2]["given_up"]
    assert_agreement({name: logs[name] for name in ("node0", "node1")}, range(6))
    for step in range(3, 6):  # node2 took these steps with the others, not alone beside them
        taken = [log[step] for log in logs.values() if "given_up" not in log[step]]
        assert len({entry["hash"] for entry in taken}) == 1, (step, taken)
    others_done = max(logs[name][2]["time"] for name in ("node0", "node1"))
    # its next step taken (3, unless the others took 3 without it while its record was on the way)
    after = next(entry for entry in logs["node2"][3:] if "given_up" not in entry)
    assert after["ready_time"] > others_done, (after, others_done)
    assert "waiting for the others to end it" in swarm.log("node2")


def test_a_swarm_on_the_sparse_codec_agrees_on_every_step_and_sends_a_fraction_of_the_bytes(
    swarm: LocalSwarm,
) -> None:
    """comm.codec = "sparse": each node gathers the others' shares and computes the same mean
    (reduce/gather.py), with its own error feedback; a 50k-value vector takes 1.5 kB a share."""
    names = start_drill(swarm, 6, "--set", 'comm.codec="sparse"')
    logs = finish(swarm, names)
    assert all(len(log) == 6 for log in logs.values()), logs
    assert_agreement(logs, range(6))
    assert all(len(entry["members"]) == 3 for log in logs.values() for entry in log)
    share = 50_000 // 4096 * 120 + 8 + 96 + 16  # 12 whole chunks' records and the last one's
    assert all(entry["bytes_sent"] == 2 * share for log in logs.values() for entry in log), logs
