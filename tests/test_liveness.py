"""Liveness on the reader's own clock: a node is alive while its heartbeat sequence advances."""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import pytest

from p2ptrain.faults import shift_wall_clock
from p2ptrain.identity import NodeIdentity
from p2ptrain.swarm.membership import Offered, SwarmView
from p2ptrain.swarm.records import Heartbeat, NodeState
from tests.support.helpers import assert_one_line_error, cli


class Clock:
    """The reader's monotonic clock, advanced by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def beat(index: int, seq: int, *, state: NodeState = NodeState.TRAINING, timestamp: float = 0.0) -> Heartbeat:
    return Heartbeat(
        run_id="r",
        node_key=bytes([index]) * 32,
        seq=seq,
        timestamp=timestamp,
        expiration=0.0,
        state=state,
    )


def view(clock: Clock) -> SwarmView:
    return SwarmView(dht=None, run_id="r", timeout=6.0, clock=clock)  # type: ignore[arg-type]


def test_a_node_is_alive_while_its_sequence_advances_and_silent_after_the_timeout() -> None:
    clock = Clock()
    swarm = view(clock)
    assert [b.seq for b in swarm.judge([beat(1, 10), beat(2, 20)])] == [10, 20]
    for step in range(1, 10):  # node 1 keeps publishing, node 2 went silent at seq 20
        clock.now += 1.0
        seen = swarm.judge([beat(1, 10 + step), beat(2, 20)])
        assert [b.node_key[0] for b in seen] == ([1, 2] if step <= 6 else [1]), step


def test_wall_clock_timestamps_do_not_matter() -> None:
    """A record from a host whose clock is hours off is judged by its sequence alone."""
    clock = Clock()
    swarm = view(clock)
    far_past, far_future = beat(1, 5, timestamp=time.time() - 7200), beat(2, 5, timestamp=time.time() + 7200)
    assert len(swarm.judge([far_past, far_future])) == 2
    clock.now += 5.0
    assert len(swarm.judge([replace(far_past, seq=6), replace(far_future, seq=6)])) == 2


def test_an_older_replica_neither_revives_nor_replaces_the_newest_record() -> None:
    clock = Clock()
    swarm = view(clock)
    swarm.judge([beat(1, 7, state=NodeState.READY)])
    clock.now += 3.0
    (seen,) = swarm.judge([beat(1, 6, state=NodeState.TRAINING)])  # a lagging replica
    assert (seen.seq, seen.state) == (7, NodeState.READY)
    clock.now += 3.5  # 6.5 s since seq 7 was first seen: the stale replica kept nothing alive
    assert swarm.judge([beat(1, 6, state=NodeState.TRAINING)]) == []


def test_a_node_gone_from_the_dht_is_forgotten_and_fresh_when_it_returns() -> None:
    clock = Clock()
    swarm = view(clock)
    swarm.judge([beat(1, 3)])
    clock.now += 10.0
    assert swarm.judge([]) == []
    assert [b.seq for b in swarm.judge([beat(1, 3)])] == [3]  # restarted node re-publishes


def test_clock_offset_hook_shifts_the_wall_clock_only(monkeypatch: pytest.MonkeyPatch) -> None:
    true_time, true_monotonic = time.time, time.monotonic
    monkeypatch.setenv("P2PTRAIN_INJECT_CLOCK_OFFSET", "-5")
    monkeypatch.setattr(time, "time", time.time)  # restored after the test
    monkeypatch.setattr(time, "time_ns", time.time_ns)
    assert shift_wall_clock() == -5.0
    assert abs(true_time() - 5.0 - time.time()) < 0.5
    assert time.monotonic is true_monotonic


@pytest.mark.procs
def test_a_bad_clock_offset_is_one_line() -> None:
    result = cli("config", "show", env={"P2PTRAIN_INJECT_CLOCK_OFFSET": "soon"})
    assert_one_line_error(result, "P2PTRAIN_INJECT_CLOCK_OFFSET='soon'")


def test_nodes_that_finished_the_run_are_remembered_after_they_left() -> None:
    from p2ptrain.swarm.records import FINISHED_FIELD

    clock = Clock()
    swarm = view(clock)
    swarm.judge([replace(beat(1, 1, state=NodeState.FINISHED), outer_step=7), beat(2, 1)])
    assert swarm.finished == {bytes([1]) * 32: 7}
    left = replace(beat(3, 1, state=NodeState.DEAD), outer_step=7, extra={FINISHED_FIELD: True})
    crashed = replace(beat(4, 1, state=NodeState.DEAD), outer_step=9)
    swarm.judge([left, crashed])
    clock.now += 60.0
    assert swarm.judge([]) == []  # the records are gone; the memory of who finished is not
    assert swarm.finished == {bytes([1]) * 32: 7, bytes([3]) * 32: 7}


def test_a_pushed_records_bytes_are_taken_held_or_refused(tmp_path: Path) -> None:
    """What a receiver answers a push (record_push.py): "held" only for a verified record of a
    known node of this run that it has now, taken or already there (or newer); a node whose pushes
    are all held elects before its DHT store is done."""
    from p2ptrain.identity import load_or_create_identity

    known, stranger = load_or_create_identity(tmp_path / "a"), load_or_create_identity(tmp_path / "b")

    def signed(identity: NodeIdentity, seq: int, run_id: str = "r") -> bytes:
        record = Heartbeat(
            run_id=run_id,
            node_key=identity.public_key,
            seq=seq,
            timestamp=0.0,
            expiration=time.time() + 60,
            state=NodeState.READY,
        )
        return record.sign(identity)

    swarm = view(Clock())
    swarm.judge([replace(beat(1, 10), node_key=known.public_key)])
    assert swarm.offer_signed(signed(known, 11), "peer") is Offered.TAKEN
    assert swarm.offer_signed(signed(known, 11), "peer") is Offered.HELD  # the same again
    assert swarm.offer_signed(signed(known, 10), "peer") is Offered.HELD  # it has a newer one
    assert swarm.offer_signed(signed(stranger, 11), "peer") is Offered.REFUSED  # a node it does not know
    assert swarm.offer_signed(signed(known, 12, run_id="other"), "peer") is Offered.REFUSED
    tampered = bytearray(signed(known, 13))
    tampered[-1] ^= 1
    assert swarm.offer_signed(bytes(tampered), "peer") is Offered.REFUSED


def test_a_pushed_record_counts_only_for_a_known_node_and_only_when_newer() -> None:
    """Records pushed over the data plane (record_push.py) make news of known nodes arrive before the
    DHT has them; they add no one, bring back nothing older, and the next DHT read keeps them."""
    clock = Clock()
    swarm = view(clock)
    swarm.judge([beat(1, 10), beat(2, 20)])
    assert swarm.offer(beat(3, 99, state=NodeState.READY)) is Offered.REFUSED, (
        "a node this view does not know"
    )
    assert swarm.offer(beat(1, 9, state=NodeState.READY)) is Offered.HELD, "older than the record known"
    assert swarm.offer(beat(1, 10, state=NodeState.READY)) is Offered.HELD, "the same seq: nothing new"
    assert swarm.offer(replace(beat(1, 11, state=NodeState.READY), run_id="another run")) is Offered.REFUSED
    assert swarm.offer(beat(1, 11, state=NodeState.READY)) is Offered.TAKEN
    clock.now += 5.0
    seen = {b.node_key[0]: b for b in swarm.judge([beat(1, 10), beat(2, 20)])}  # the DHT lags behind
    assert (seen[1].seq, seen[1].state) == (11, NodeState.READY)
    clock.now += 2.0  # node 2 silent for 7 s; node 1's pushed record came 7 s ago as well
    assert [b.node_key[0] for b in swarm.judge([beat(1, 10), beat(2, 20)])] == []
