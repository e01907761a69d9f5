"""The election function: members and ring order from heartbeats, identical on every node."""

from __future__ import annotations

import asyncio
import itertools
import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from p2ptrain.comm.net.attempt import StreamConnection
from p2ptrain.comm.net.members import Member, membership_digest
from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.comm.reduce.connect import dial_member
from p2ptrain.config import CommConfig
from p2ptrain.identity import load_or_create_identity
from p2ptrain.swarm.election import (
    LINKS_FIELD,
    Election,
    decide,
    elect,
    expected_for,
    measured_links,
    parse_address,
    ready_for,
    ring_order,
)
from p2ptrain.swarm.evidence import BLAME_FIELD, blame_field
from p2ptrain.swarm.records import Heartbeat, NodeState
from tests.support.records import beat, key


def decided(beats: list[Heartbeat], step: int, deadline_passed: bool) -> Election:
    """`decide`, where the view allows a decision."""
    election = decide(beats, step, deadline_passed=deadline_passed)
    assert election is not None
    return election


def test_parse_address() -> None:
    assert parse_address("10.0.0.1:80") == ("10.0.0.1", 80)
    assert parse_address("[::1]:9000") == ("::1", 9000)
    for bad in ["", "host", "host:", ":80", "h:0", "h:70000", "h:x", "h:²", "h:٣٣"]:  # digits, not ASCII
        assert parse_address(bad) is None


def test_ready_and_expected() -> None:
    beats = [
        beat(1, NodeState.READY, step=4),
        beat(2, NodeState.SYNCING, step=4),
        beat(3, NodeState.TRAINING, step=4),
        beat(4, NodeState.READY, step=3),
        beat(5, NodeState.JOINING, step=4),
        beat(6, NodeState.DEAD, step=4),
    ]
    assert [b.node_key for b in ready_for(beats, 4)] == [key(1), key(2)]
    assert [b.node_key for b in expected_for(beats, 4)] == [key(3)]


def test_a_node_alone_in_its_view_waits_for_the_deadline() -> None:
    beats = [beat(1, NodeState.READY, step=4)]
    assert decide(beats, 4, deadline_passed=False) is None
    assert decided(beats, 4, deadline_passed=True).keys == [key(1)]


def test_never_solo_while_another_node_is_at_the_step() -> None:
    """A stale record of a peer (its ready record has not reached us) must not let us go alone."""
    beats = [beat(1, NodeState.READY, step=4), beat(2, NodeState.LEAVING, step=4)]
    assert decide(beats, 4, deadline_passed=True) is None
    beats = [beat(1, NodeState.READY, step=4), beat(2, NodeState.JOINING, step=5)]  # not in the steps yet
    assert decided(beats, 4, deadline_passed=True).keys == [key(1)]


def test_never_solo_while_another_node_is_past_the_step() -> None:
    """One node past the step is no majority (swarm_ahead), but it took the step or gave it up
    without us: alone, we would fork it. Seen: a node that had named the one other node at the step
    (evidence of an earlier step) took steps alone while two nodes took them together."""
    for state in (NodeState.TRAINING, NodeState.READY, NodeState.FINISHED):
        assert (
            decide([beat(1, NodeState.READY, step=4), beat(2, state, step=5)], 4, deadline_passed=True)
            is None
        )
    named = replace(beat(1, NodeState.READY, step=4), extra={BLAME_FIELD: blame_field(4, [key(2)])})
    assert decided([named, beat(2, NodeState.READY, step=4)], 4, deadline_passed=True).keys == [key(1)]
    with_one_past = [named, beat(2, NodeState.READY, step=4), beat(3, NodeState.TRAINING, step=5)]
    assert decide(with_one_past, 4, deadline_passed=True) is None


def test_waits_for_nodes_still_training_until_the_deadline() -> None:
    beats = [
        beat(1, NodeState.READY, step=4),
        beat(3, NodeState.READY, step=4),
        beat(2, NodeState.TRAINING, step=4),
    ]
    assert decide(beats, 4, deadline_passed=False) is None
    election = decide(beats, 4, deadline_passed=True)
    assert election is not None and sorted(election.keys) == [key(1), key(3)]  # the straggler is left out


def test_only_a_majority_goes_on_without_the_others() -> None:
    """Two pairs that each see only their own ready records must not both take the step."""
    pair = [beat(1, NodeState.READY, step=4), beat(2, NodeState.READY, step=4)]
    others = [beat(3, NodeState.TRAINING, step=4), beat(4, NodeState.TRAINING, step=4)]
    assert decide(pair + others, 4, deadline_passed=True) is None
    assert sorted(decided(pair + others[:1], 4, deadline_passed=True).keys) == [key(1), key(2)]  # 2 of 3
    everyone = [*pair, beat(3, NodeState.READY, step=4), beat(4, NodeState.READY, step=4)]
    assert len(decided(everyone, 4, deadline_passed=False).keys) == 4


def test_every_node_computes_the_same_election_from_the_same_records() -> None:
    beats = [beat(i, NodeState.READY, step=7, tokens=10 * i) for i in range(1, 7)]
    reference = decided(beats, 7, False)
    for _ in range(10):
        shuffled = random.sample(beats, len(beats))
        election = decided(shuffled, 7, False)
        assert election.keys == reference.keys and election.digest == reference.digest
    assert [m.weight for m in reference.members] == [10.0 * (k[0]) for k in reference.keys]


def test_clock_skew_does_not_change_the_result() -> None:
    """Record timestamps come from each sender's clock; the election never reads them."""
    beats = [beat(i, NodeState.READY, step=3) for i in range(1, 5)]
    skewed = [beat(i, NodeState.READY, step=3, timestamp=1e9 + (5 if i == 2 else 0)) for i in range(1, 5)]
    assert decided(beats, 3, False).keys == decided(skewed, 3, False).keys


def test_order_rotates_between_steps_and_is_a_permutation() -> None:
    keys = [key(i) for i in range(1, 9)]
    orders = {tuple(ring_order(keys, step)) for step in range(10)}
    assert len(orders) > 1
    assert all(sorted(order) == sorted(keys) for order in orders)


def test_bandwidth_aware_order_avoids_slow_links() -> None:
    keys = [key(i) for i in range(1, 6)]
    fast = 1e9
    throughput = {(a, b): fast for a in keys for b in keys if a != b}
    base = ring_order(keys, 0)
    # make every link out of base[0] slow except to base[3]
    for other in keys:
        if other not in (base[0], base[3]):
            throughput[(base[0], other)] = 1e3
    order = ring_order(keys, 0, throughput)
    assert order[0] == base[0] and order[1] == base[3]
    assert ring_order(list(reversed(keys)), 0, throughput) == order


def slowest(order: list[bytes], throughput: dict) -> float:
    return min(throughput.get((order[i], order[(i + 1) % len(order)]), math.inf) for i in range(len(order)))


def test_a_single_slow_link_is_always_avoided() -> None:
    """Any one directed link can be avoided from 3 nodes up; the greedy tour's closing link too."""
    for n in range(3, 7):
        keys = [key(i) for i in range(1, n + 1)]
        for sender, receiver in itertools.permutations(keys, 2):
            for step in range(4):
                throughput = {(sender, receiver): 1e6}
                order = ring_order(keys, step, throughput)
                assert sorted(order) == sorted(keys)
                assert slowest(order, throughput) == math.inf, (n, step)


def test_the_slowest_link_is_the_best_possible_in_small_swarms() -> None:
    """Against brute force over every ring: a few slow links among 4–7 nodes, 300 cases."""
    misses = 0
    for case in range(300):
        rng = random.Random(case)
        keys = [key(i) for i in range(1, rng.randint(4, 7) + 1)]
        links = rng.sample(list(itertools.permutations(keys, 2)), rng.randint(1, 3))
        throughput = {link: rng.choice([1e5, 1e6, 1e7]) for link in links}
        best = max(slowest([keys[0], *rest], throughput) for rest in itertools.permutations(keys[1:]))
        misses += slowest(ring_order(keys, case, throughput), throughput) < best
    assert misses <= 12  # a heuristic: 4 of 300 when written


def test_links_published_in_ready_records_order_the_ring() -> None:
    beats = [beat(i, NodeState.READY, step=9) for i in range(1, 5)]
    plain = decided(beats, 9, False).keys
    slow = (plain[0], plain[1])  # the base order's first link
    beats[slow[0][0] - 1] = replace(
        beats[slow[0][0] - 1], extra={LINKS_FIELD: {slow[1].hex()[:16]: 125_000, "ffff": 1.0}}
    )
    assert measured_links(beats) == {slow: 125_000.0}
    elections = [decided(random.sample(beats, len(beats)), 9, False) for _ in range(5)]
    assert len({election.digest for election in elections}) == 1  # every node alike
    order = elections[0].keys
    assert slowest(order, {slow: 125_000.0}) == math.inf and sorted(order) == sorted(plain)


def test_malformed_link_fields_are_ignored() -> None:
    beats = [beat(i, NodeState.READY, step=2) for i in range(1, 4)]
    other = key(2).hex()[:16]
    for links in [
        "fast",
        {other: "1e9"},
        {other: -5},
        {other: True},
        {other: math.inf},
        {7: 1.0},
        {other: 0},
    ]:
        assert measured_links([replace(beats[0], extra={LINKS_FIELD: links}), *beats[1:]]) == {}
    assert (
        measured_links([replace(beats[0], extra={LINKS_FIELD: {key(1).hex()[:16]: 9.0}})]) == {}
    )  # to itself


def test_ring_order_at_1000_nodes_is_fast_enough() -> None:
    import time

    keys = [i.to_bytes(32, "big") for i in range(1000)]
    throughput = {(keys[i], keys[(i * 7 + 3) % 1000]): float(i) for i in range(1000)}
    started = time.perf_counter()
    order = ring_order(keys, 1, throughput)
    assert len(set(order)) == 1000
    assert time.perf_counter() - started < 30  # O(n²) greedy; a bound, not a benchmark


def test_elect_decides_at_the_straggler_deadline_on_its_own_clock() -> None:
    now = [0.0]
    views = [
        [
            beat(1, NodeState.TRAINING, step=2),
            beat(2, NodeState.TRAINING, step=2),
            beat(3, NodeState.TRAINING, step=2),
        ]
    ] + [
        [
            beat(1, NodeState.READY, step=2),
            beat(2, NodeState.TRAINING, step=2),
            beat(3, NodeState.READY, step=2),
        ]
    ] * 100

    async def read() -> list[Heartbeat]:
        now[0] += 0.5
        return views.pop(0)

    async def scenario() -> Election:
        return await elect(read, 2, straggler_deadline=2.0, timeout=30, poll_interval=0, clock=lambda: now[0])

    election = asyncio.run(scenario())
    assert sorted(election.keys) == [key(1), key(3)]
    assert now[0] == pytest.approx(3.0)  # first ready seen at 1.0, deadline 2.0 later


@pytest.mark.parametrize(
    ("others", "decided_at"),
    [
        ([], 1.0),  # alone in the run: the grace, not the whole deadline
        ([beat(2, NodeState.JOINING, step=3)], 10.0),  # a joiner may be ready soon: the deadline
        ([beat(2, NodeState.TRAINING, step=1)], 10.0),  # one behind: expected, the deadline
        ([beat(2, NodeState.IDLE, step=0), beat(3, NodeState.DEAD, step=2)], 1.0),  # a watcher, the dead
    ],
)
def test_a_node_alone_in_its_run_waits_a_grace_not_the_deadline(
    others: list[Heartbeat], decided_at: float
) -> None:
    """20 steps of a node whose run had no other node took 230 s against 27 s without the network:
    each waited the whole straggler deadline for ready records from nodes nobody had seen."""
    mine = beat(1, NodeState.READY, step=2)
    election, decided = elect_alone(iter(lambda: [mine, *others], None), lone_grace=1.0)
    assert election.keys == [key(1)]
    assert decided == pytest.approx(decided_at)


def test_one_read_that_missed_the_others_does_not_start_a_lone_step() -> None:
    """A DHT read that timed out shows no other node; the next shows the peer still training.
    The grace counts only reads in a row that show nobody: the deadline holds."""
    mine = beat(1, NodeState.READY, step=2)
    other = beat(2, NodeState.TRAINING, step=1)
    election, decided = elect_alone(iter([[mine, other], [mine], *[[mine, other]] * 200]), lone_grace=0.25)
    assert election.keys == [key(1)]  # alone after the deadline, as before
    assert decided == pytest.approx(10.0)


def elect_alone(reads: Iterator[list[Heartbeat]], *, lone_grace: float) -> tuple[Election, float]:
    """`elect` for node 1 at step 2 over `reads`, a read every 0.25 s, straggler deadline 10 s:
    the election and how long after the first read it decided."""
    now = [0.0]

    async def read() -> list[Heartbeat]:
        now[0] += 0.25
        return next(reads)

    election = asyncio.run(
        elect(
            read,
            2,
            straggler_deadline=10.0,
            timeout=60,
            poll_interval=0,
            clock=lambda: now[0],
            me=key(1),
            lone_grace=lone_grace,
        )
    )
    return election, now[0] - 0.25


def test_elect_times_out() -> None:
    async def read() -> list[Heartbeat]:
        return [beat(1, NodeState.TRAINING, step=2)]

    with pytest.raises(TimeoutError):
        asyncio.run(elect(read, 2, straggler_deadline=1.0, timeout=0.2, poll_interval=0.05))


def test_status_derives_the_last_ring_from_the_records() -> None:
    from dataclasses import replace

    from p2ptrain.swarm.status import format_table, last_ring, status_json

    beats = [replace(beat(i, NodeState.TRAINING, step=8), params_hash="ab") for i in (1, 2, 3)]
    beats.append(replace(beat(4, NodeState.TRAINING, step=7), params_hash="cd"))  # finished an older step
    beats.append(beat(5, NodeState.JOINING, step=0))
    ring = last_ring(beats)
    assert ring == {"step": 7, "members": [k.hex() for k in ring_order([key(1), key(2), key(3)], 7)]}
    assert status_json(beats)["last_ring"] == ring
    assert "last ring (step 7)" in format_table(beats)
    assert last_ring([beat(5, NodeState.JOINING, step=0)]) is None


def test_a_node_behind_everyone_is_told_instead_of_going_solo() -> None:
    from p2ptrain.swarm.election import SwarmAhead, swarm_ahead

    me = key(1)
    ahead = [
        beat(1, NodeState.READY, step=3),
        beat(2, NodeState.TRAINING, step=4),
        beat(3, NodeState.READY, step=4),
    ]
    assert swarm_ahead(ahead, 3, me=me)
    # another node at 3 too: both are behind those that took step 3 (together they would fork it)
    assert swarm_ahead([*ahead, beat(4, NodeState.TRAINING, step=3)], 3, me=me)
    assert not swarm_ahead([beat(1, NodeState.READY, step=3), beat(4, NodeState.TRAINING, step=3)], 3, me=me)
    assert not swarm_ahead(
        [beat(1, NodeState.READY, step=3), beat(2, NodeState.DEAD, step=4)], 3, me=me
    )  # alone
    assert not swarm_ahead([beat(1, NodeState.READY, step=3), beat(2, NodeState.JOINING, step=9)], 3, me=me)
    # one record far ahead is not the swarm: a majority of the others must be past the step
    lone_claim = [
        beat(1, NodeState.READY, step=3),
        beat(2, NodeState.TRAINING, step=3),
        beat(3, NodeState.READY, step=3),
    ]
    assert not swarm_ahead([*lone_claim, beat(4, NodeState.TRAINING, step=10**9)], 3, me=me)
    assert not swarm_ahead([*lone_claim, beat(4, NodeState.FINISHED, step=10**9)], 3, me=me)

    async def read() -> list[Heartbeat]:
        return ahead

    with pytest.raises(SwarmAhead, match="past outer step 3"):
        asyncio.run(elect(read, 3, straggler_deadline=0, timeout=5, poll_interval=0, me=me))


def test_a_node_replaying_a_step_aims_past_the_step_the_others_have_begun() -> None:
    from p2ptrain.swarm.election import join_aim

    me = key(1)
    mine = beat(1, NodeState.TRAINING, step=3)
    # the others train step 4 (step 3's sync done): their election of 4 will wait for us
    assert (
        join_aim([mine, beat(2, NodeState.TRAINING, step=4), beat(3, NodeState.TRAINING, step=4)], 3, me=me)
        == 4
    )
    # most are ready for 4 or syncing it: likely decided without us; aim for 5 and replay 4
    begun = [mine, beat(2, NodeState.READY, step=4), beat(3, NodeState.SYNCING, step=4)]
    assert join_aim(begun, 3, me=me) == 5
    # one of two is no majority; one far record is not the swarm
    assert join_aim([beat(2, NodeState.READY, step=4), beat(3, NodeState.TRAINING, step=4)], 3, me=me) == 4
    assert join_aim([beat(2, NodeState.READY, step=9), beat(3, NodeState.TRAINING, step=4)], 3, me=me) == 4


def test_a_node_that_gave_a_step_up_waits_while_the_others_are_still_at_it() -> None:
    """swarm_still_at, the mirror of swarm_ahead: after giving step 3 up, node 1 (at 4 now) must
    not take step 4 while the others have not finished 3 (they would take 4 after it: a fork)."""
    from p2ptrain.swarm.election import swarm_still_at

    me = key(1)
    mine = beat(1, NodeState.TRAINING, step=4)
    still = [
        mine,
        beat(2, NodeState.SYNCING, step=3),
        beat(3, NodeState.READY, step=3),
        beat(4, NodeState.TRAINING, step=4),
    ]
    assert swarm_still_at(still, 3, me=me)
    # a strict majority past: the step is the swarm's (replayed), whoever is still at it
    assert not swarm_still_at([*still[:2], beat(3, NodeState.TRAINING, step=4), still[3]], 3, me=me)
    # the others gave it up as well (each says so with a record of step 4): nobody waits for anyone
    assert not swarm_still_at(
        [mine, beat(2, NodeState.TRAINING, step=4), beat(3, NodeState.READY, step=4)], 3, me=me
    )
    assert not swarm_still_at([mine], 3, me=me)  # alone
    # a node far behind still counts as at it while no majority is past (it may still take the step)
    assert swarm_still_at([mine, beat(2, NodeState.TRAINING, step=1)], 3, me=me)
    # half past is no majority; the dead, the joining and those that finished are never still at it
    assert swarm_still_at(
        [mine, beat(2, NodeState.READY, step=3), beat(3, NodeState.TRAINING, step=4)], 3, me=me
    )
    others = [
        beat(2, NodeState.DEAD, step=3),
        beat(3, NodeState.JOINING, step=0),
        beat(4, NodeState.FINISHED, step=3),
    ]
    assert not swarm_still_at([mine, *others], 3, me=me)
    assert not swarm_still_at(
        [mine, beat(2, NodeState.READY, step=3)], 3, me=me, finished={key(3): 3, key(4): 5}
    )


def test_a_node_behind_a_finished_run_catches_up_even_after_the_others_left() -> None:
    """A node that finished never takes another step: its history is the swarm's. Remembered after
    it left (deathrattle), so the node behind never takes the step alone."""
    from dataclasses import replace

    from p2ptrain.swarm.election import SwarmAhead, swarm_ahead
    from p2ptrain.swarm.membership import finished_run
    from p2ptrain.swarm.records import FINISHED_FIELD

    me = key(1)
    finished = beat(2, NodeState.FINISHED, step=5)
    assert swarm_ahead([beat(1, NodeState.READY, step=4), finished], 4, me=me)
    assert swarm_ahead([beat(1, NodeState.READY, step=5), finished], 5, me=me)  # nobody will ever take step 5
    assert not swarm_ahead([beat(1, NodeState.READY, step=6), finished], 6, me=me)
    left = replace(beat(2, NodeState.DEAD, step=5), extra={FINISHED_FIELD: True})
    assert finished_run(left) and finished_run(finished) and not finished_run(beat(2, NodeState.DEAD, step=5))
    assert not swarm_ahead([beat(1, NodeState.READY, step=4)], 4, me=me)
    assert swarm_ahead([beat(1, NodeState.READY, step=4)], 4, me=me, finished={key(2): 5})
    still_here = [
        beat(1, NodeState.READY, step=4),
        beat(3, NodeState.TRAINING, step=4),
        beat(4, NodeState.READY, step=4),
    ]
    assert not swarm_ahead(still_here, 4, me=me, finished={key(2): 5})  # one of four

    async def read() -> list[Heartbeat]:
        return [beat(1, NodeState.READY, step=4)]

    with pytest.raises(SwarmAhead):
        asyncio.run(
            elect(read, 4, straggler_deadline=0, timeout=5, poll_interval=0, me=me, finished={key(2): 5})
        )


def test_a_member_of_the_previous_step_whose_newer_record_is_late_is_waited_for() -> None:
    """Node 2 took step 4 with node 1; its record still says syncing(4) here. Without knowing it is
    on its way, node 1 and 3 would take step 5 without it (and it would find the swarm past it)."""
    beats = [
        beat(1, NodeState.READY, step=5),
        beat(2, NodeState.SYNCING, step=4),
        beat(3, NodeState.READY, step=5),
    ]
    assert decide(beats, 5, deadline_passed=False) is not None
    assert decide(beats, 5, deadline_passed=False, in_transit={key(1), key(2)}) is None
    late = decide(beats, 5, deadline_passed=True, in_transit={key(1), key(2)})
    assert late is not None and len(late.members) == 2  # a majority after the deadline, as for a straggler


def _greedy_oracle(base: list[bytes], throughput: dict) -> list[bytes]:
    """The greedy tour as first written: O(n²), the fastest link out of every unvisited node."""
    rank = {key: index for index, key in enumerate(base)}
    tour, left = [base[0]], set(base[1:])
    while left:
        here = tour[-1]
        nxt = min(left, key=lambda key: (-throughput.get((here, key), math.inf), rank[key]))
        tour.append(nxt)
        left.remove(nxt)
    return tour


def test_the_linear_greedy_tour_equals_the_quadratic_one() -> None:
    from p2ptrain.swarm.election import _greedy_tour

    rng = random.Random(7)
    for trial in range(300):
        n = rng.randint(3, 40)
        keys = [rng.randbytes(32) for _ in range(n)]
        links: dict = {}
        for sender in keys:
            for receiver in rng.sample(keys, min(n, rng.choice([0, 1, 3, 16, n]))):
                if sender != receiver:
                    links[(sender, receiver)] = float(rng.choice([1e6, 2e6, rng.uniform(1e5, 1e8)]))
        assert _greedy_tour(keys, links) == _greedy_oracle(keys, links), trial


@dataclass(kw_only=True)
class WaitingHello:
    """Our data-plane server at `step`, and a member's dial of it for that step (a task), over TCP."""

    server: DataPlaneServer
    member: bytes
    digest: bytes
    dial: asyncio.Task[StreamConnection]

    @staticmethod
    async def start(root: Path, step: int, setup_timeout: float) -> WaitingHello:
        me, member = load_or_create_identity(root / "me"), load_or_create_identity(root / "m")
        server = DataPlaneServer(
            identity=me, comm=CommConfig(failure_timeout=5.0), setup_timeout=setup_timeout
        )
        host, port = await server.start()
        server.at_step(step)  # no candidates: the member's hello waits in a stranger's slot
        members = [
            Member(key=me.public_key, host=host, port=port),
            Member(key=member.public_key, host="127.0.0.1", port=1),
        ]
        digest = membership_digest(step, members)
        dial = asyncio.create_task(
            dial_member(
                member, members[0], step=step, digest=digest, setup_timeout=setup_timeout, failure_timeout=5.0
            )
        )
        return WaitingHello(server=server, member=member.public_key, digest=digest, dial=dial)


def test_a_member_that_dials_before_we_decided_cuts_our_election_wait_short(tmp_path: Path) -> None:
    """`DataPlaneServer.dialed`, which the node's election waits on between reads, returns as soon
    as a member's hello for our step arrives before we registered the step (over real TCP), once
    per hello: a stale wake is consumed, the next wait runs its full time."""
    step = 7

    async def scenario() -> tuple[float, float]:
        hello = await WaitingHello.start(tmp_path, step, setup_timeout=30.0)
        server, member, digest, dial = hello.server, hello.member, hello.digest, hello.dial
        started = asyncio.get_running_loop().time()
        await server.dialed(60.0)  # the hello waits for our registration: we are woken
        woken_after = asyncio.get_running_loop().time() - started
        registration = server.expect(step, [member], digest=digest)
        _, writer, _ = await asyncio.wait_for(dial, 10)
        assert await asyncio.wait_for(registration.incoming[(member, 0)], 10) is not None
        writer.close()
        started = asyncio.get_running_loop().time()
        await server.dialed(0.3)  # nothing new: the whole wait
        waited = asyncio.get_running_loop().time() - started
        await server.close()
        return woken_after, waited

    woken_after, waited = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert woken_after < 30.0, woken_after  # not the full 60 s
    assert waited >= 0.29, waited


def test_a_hello_that_came_after_our_election_does_not_cut_the_next_one_short(tmp_path: Path) -> None:
    """A member's hello that arrives once our election is decided, but before we registered the
    step, wakes no one; registering the step clears it, so our next election waits its full time."""
    step = 7

    async def scenario() -> float:
        hello = await WaitingHello.start(tmp_path, step, setup_timeout=30.0)
        server, member, digest, dial = hello.server, hello.member, hello.digest, hello.dial
        deadline = asyncio.get_running_loop().time() + 10
        while server.waiting.waiting_strangers == 0:  # the hello is in and waits for our step
            assert asyncio.get_running_loop().time() < deadline, "the hello never came"
            await asyncio.sleep(0.01)
        registration = server.expect(step, [member], digest=digest)
        _, writer, _ = await asyncio.wait_for(dial, 10)
        assert await asyncio.wait_for(registration.incoming[(member, 0)], 10) is not None
        writer.close()
        started = asyncio.get_running_loop().time()
        await server.dialed(0.3)  # the next election: nothing new, the whole wait
        waited = asyncio.get_running_loop().time() - started
        await server.close()
        return waited

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) >= 0.29


def test_a_node_that_closes_its_data_plane_cuts_the_hellos_that_wait_for_its_step(tmp_path: Path) -> None:
    """A member's hello for a step we never register waits for us up to setup_timeout. If we stop
    meanwhile (our attempt failed, the node exits), closing the server cuts that connection: the
    dialer fails at once instead of at its deadline, and our close does not wait for it either."""
    step = 7

    async def scenario() -> tuple[float, float, BaseException | None]:
        hello = await WaitingHello.start(tmp_path, step, setup_timeout=60.0)
        server, dial = hello.server, hello.dial
        await server.dialed(30.0)  # the hello is in, proven, and waits for our step
        assert server.waiting.waiting_strangers == 1
        started = asyncio.get_running_loop().time()
        await server.close()
        closed_after = asyncio.get_running_loop().time() - started
        outcome = (await asyncio.gather(dial, return_exceptions=True))[0]
        failed_after = asyncio.get_running_loop().time() - started
        return closed_after, failed_after, outcome if isinstance(outcome, BaseException) else None

    closed_after, failed_after, error = asyncio.run(asyncio.wait_for(scenario(), 90))
    assert error is not None, "the dial got through a server that closed"
    assert closed_after < 10 and failed_after < 10, (closed_after, failed_after, error)  # not setup_timeout
