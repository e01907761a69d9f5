"""The evidence rule: who is left out of a step's next attempt, from the accusations in ready records."""

from __future__ import annotations

from dataclasses import replace

from p2ptrain.swarm.election import decide
from p2ptrain.swarm.evidence import BLAME_FIELD, MAX_BLAMED, Offences, Refusers, blame_field, left_out
from p2ptrain.swarm.records import Heartbeat, NodeState
from tests.support.records import beat, key

STEP = 7


def ready(index: int, blames: list[int] | None = None, step: int = STEP) -> Heartbeat:
    """Node `index` ready for STEP; `blames` is its report (None: it reported nothing)."""
    record = beat(index, NodeState.READY, step=STEP)
    if blames is not None:
        record = replace(record, extra={BLAME_FIELD: blame_field(step, [key(i) for i in blames])})
    return record


def names(out: dict[bytes, str]) -> set[int]:
    return {member[0] for member in out}


def test_no_reports_leave_no_one_out() -> None:
    assert left_out([ready(1), ready(2), ready(3)], STEP) == {}
    assert left_out([ready(1, []), ready(2, []), ready(3)], STEP) == {}


def test_a_silent_member_named_by_one_accuser_goes_alone() -> None:
    # node 3 reported nothing (dead, frozen, a stranger that only publishes ready records)
    assert names(left_out([ready(1, [3]), ready(2), ready(3)], STEP)) == {3}


def test_a_member_named_by_two_goes_alone_even_if_it_denies_it() -> None:
    out = left_out([ready(1, [3]), ready(2, [3]), ready(3, [])], STEP)
    assert names(out) == {3}
    # its own accusations no longer count once two others named it
    out = left_out([ready(1, [3]), ready(2, [3]), ready(3, [1, 2])], STEP)
    assert names(out) == {3}


def test_an_unconfirmed_accusation_costs_the_accuser_too() -> None:
    """Node 2 reported its failed attempt without naming node 1: one of them lies, both go."""
    out = left_out([ready(1, [2]), ready(2, []), ready(3, [])], STEP)
    assert names(out) == {1, 2}
    assert "not confirmed" in out[key(1)]


def test_mutual_accusations_leave_both_out() -> None:
    assert names(left_out([ready(1, [2]), ready(2, [1]), ready(3, [])], STEP)) == {1, 2}


def test_accusations_of_another_step_or_of_nobody_count_for_nothing() -> None:
    assert left_out([ready(1, [2], step=STEP - 1), ready(2), ready(3)], STEP) == {}
    assert left_out([ready(1, [9]), ready(2), ready(3)], STEP) == {}  # 9 is no member
    assert left_out([ready(1, [1]), ready(2), ready(3)], STEP) == {}  # naming itself
    junk = [
        {"step": STEP, "keys": "00" * 8},
        {"step": True, "keys": [key(2).hex()[:16]]},
        {"step": STEP, "keys": ["zz" * 8]},
        {"step": STEP, "keys": [key(2).hex()[:16]] * (MAX_BLAMED + 1)},
        "blame",
    ]
    for value in junk:
        record = replace(ready(1), extra={BLAME_FIELD: value})
        assert left_out([record, ready(2), ready(3)], STEP) == {}, value


def test_the_election_goes_on_without_the_left_out_and_says_so() -> None:
    beats = [ready(1, [4]), ready(2, [4]), ready(3, []), ready(4)]
    election = decide(beats, STEP, deadline_passed=False)
    assert election is not None
    assert sorted(member.key[0] for member in election.members) == [1, 2, 3]
    assert set(election.left_out) == {key(4)}


def test_a_node_alone_with_the_member_it_named_may_go_on_after_the_deadline() -> None:
    beats = [ready(1, [2]), ready(2)]
    assert decide(beats, STEP, deadline_passed=False) is None
    election = decide(beats, STEP, deadline_passed=True)
    assert election is not None and [member.key[0] for member in election.members] == [1]


def test_offenders_are_named_for_2_then_4_steps_until_they_take_part_again() -> None:
    offences = Offences()
    offences.step_done(10, members=[key(1)], named=[key(9)])
    assert [step for step in range(10, 20) if key(9) in offences.named_at(step)] == [11, 12]
    offences.step_done(13, members=[key(1)], named=[key(9)])  # failed again when tried
    assert [step for step in range(13, 24) if key(9) in offences.named_at(step)] == [14, 15, 16, 17]
    offences.step_done(18, members=[key(1), key(9)], named=[])  # it took part: cleared
    assert offences.named_at(19) == set()


def test_a_failure_another_member_named_lengthens_the_next_window_but_names_no_one() -> None:
    """Who names a stranger first depends on timing: the windows must double whoever named it."""
    offences = Offences()
    offences.step_done(0, members=[key(1)], named=[], failed=[key(9)])  # tried here, named elsewhere
    assert all(key(9) not in offences.named_at(step) for step in range(1, 10))
    assert offences.due_at(10) == set()  # nothing to probe: no window of ours
    offences.step_done(3, members=[key(1)], named=[key(9)])  # its second failure, named by us
    assert [step for step in range(3, 12) if key(9) in offences.named_at(step)] == [4, 5, 6, 7]
    offences.step_done(8, members=[key(1), key(9)], named=[])  # it took part: cleared
    offences.step_done(9, members=[key(1)], named=[key(9)])
    assert [step for step in range(9, 15) if key(9) in offences.named_at(step)] == [10, 11]


def test_a_refuser_is_named_after_its_patience_and_a_completed_handshake_starts_it_over() -> None:
    """Outright refusals (views differ, a plain no) name the refuser only once they have lasted the
    patience; a handshake with it that completed in between shows it does not refuse everything."""
    now = [100.0]
    refusers = Refusers(patience=12.0, clock=lambda: now[0])
    a, b = key(1), key(2)
    assert refusers.still(None) is None
    assert refusers.still(a) is None  # its first refusal starts its clock
    now[0] += 11.9
    assert refusers.still(a) is None and refusers.still(b) is None
    now[0] += 0.1
    assert refusers.still(a) == a  # 12 s of refusals
    assert refusers.still(b) is None  # b's clock began 0.1 s ago
    refusers.forgive([a])
    assert refusers.still(a) is None  # starts over
    now[0] += 12.0
    assert refusers.still(a) == a and refusers.still(b) == b
