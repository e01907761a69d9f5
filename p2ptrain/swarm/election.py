"""Leaderless election of the members and ring order of one outer step, from signed heartbeats.

Every node runs the same deterministic function over the heartbeats it reads; no node decides for
the others. A node that has finished its inner steps for step N publishes state `ready` with
outer_step N, its data-plane address and its weight (tokens processed). Then each node:

1. waits until every live node it expects in step N (state `training` with outer_step N) is ready,
   or until `straggler_deadline` seconds after it first *saw* a ready(N) record — measured on its
   own monotonic clock, so clock skew between hosts changes nothing. A node that sees only itself
   ready never goes on alone while another live node is at step N (its ready record may not have
   reached us; a one-member step has no handshake to reveal the disagreement) or past it, and
   otherwise only after the deadline. Only a strict majority of the nodes at step N may go on
   without the others: two halves that each see only their own ready records (a DHT view not yet
   converged) must not both take the step. So in a two-node swarm a straggler holds the other
   back, and so does a slow half of any swarm;
2. takes the ready(N) nodes as the members, ordered by `ring_order`, without those the signed
   evidence of failed attempts leaves out (evidence.py): one unreachable or lying node costs an
   attempt, not the step.

Nodes whose views differ (a record not yet propagated, a straggler seen by some only) compute
different membership digests; the data-plane handshake refuses the mismatch, the all-reduce fails
on all of them, and they re-read and elect again. Ready records are sticky (a node stays ready(N)
until it syncs), so repeated reads converge once the DHT has propagated them.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from p2ptrain.comm.net.members import Member, membership_digest
from p2ptrain.comm.net.reach import can_be_dialed
from p2ptrain.swarm.evidence import left_out
from p2ptrain.swarm.records import Heartbeat, NodeState, record_number
from p2ptrain.untrusted import decimal

log = logging.getLogger(__name__)

Throughput = Mapping[tuple[bytes, bytes], float]
"""Measured bytes/s from the first node to the second, from earlier all-reduces. A link that is
absent never held its sender up: as fast as the sender could feed it, as far as anyone knows."""

LINKS_FIELD = "links"
"""Heartbeat `extra` field: {receiver key hex prefix: bytes/s} measured by the sender."""
LINK_PREFIX_HEX = 16


@dataclass(frozen=True, kw_only=True)
class Election:
    step: int
    members: list[Member]
    left_out: dict[bytes, str] = field(default_factory=dict)
    """Ready nodes the evidence leaves out of this attempt, each with the reason."""
    relays: tuple[Member, ...] = ()
    """Standby relays (`bootstrap --relay`) for edges between members behind NAT, listed only where
    no member can relay (ordered by key; part of the digest)."""

    @property
    def digest(self) -> bytes:
        return membership_digest(self.step, self.members, self.relays)

    @property
    def keys(self) -> list[bytes]:
        return [member.key for member in self.members]


def parse_address(text: str) -> tuple[str, int] | None:
    """'host:port' (IPv6 as '[::1]:port') → (host, port); None when malformed."""
    host, sep, port_text = text.rpartition(":")
    port = decimal(port_text, 5)
    if not sep or not host or port is None or not 0 < port < 65536:
        return None
    return host.strip("[]"), port


def ready_for(heartbeats: Iterable[Heartbeat], step: int) -> list[Heartbeat]:
    """Nodes ready (or already syncing) for `step` with a usable data-plane address."""
    return [
        beat
        for beat in heartbeats
        if beat.state in (NodeState.READY, NodeState.SYNCING)
        and beat.outer_step == step
        and parse_address(beat.data_addr) is not None
    ]


def expected_for(
    heartbeats: Iterable[Heartbeat], step: int, in_transit: Collection[bytes] = ()
) -> list[Heartbeat]:
    """Live nodes still training towards `step`: worth waiting for until the straggler deadline.

    `in_transit`: the members of the previous step with this node. Until their newer record
    reaches us, theirs still says ready or syncing for step - 1, but they are on their way."""
    return [
        beat
        for beat in heartbeats
        if (beat.state is NodeState.TRAINING and beat.outer_step == step)
        or (
            beat.node_key in in_transit
            and beat.state in (NodeState.READY, NodeState.SYNCING)
            and beat.outer_step == step - 1
        )
    ]


def ring_order(keys: Sequence[bytes], step: int, throughput: Throughput | None = None) -> list[bytes]:
    """The ring order every node computes alike.

    Base order: sha256(step, key), which rotates positions from step to step. With measured
    throughput, the goal is the ring whose slowest link is fastest (a pipelined ring runs at its
    slowest link's pace); unmeasured links count as fast. (1) A greedy tour: start at the base
    order's first node and always continue to the unvisited node with the fastest link from the
    current one, ties going to the base order. (2) The tour's closing link is never chosen by the
    greedy step, so a few 2-opt moves follow: while the slowest link can be replaced by reversing
    a stretch of the tour so that the new slowest link is faster, do the first such move (at most
    `MAX_REPAIRS`). Each greedy step walks the unvisited nodes in base order and stops at the
    first whose link from the current node is unmeasured (fast): a record names at most 16 slow
    links, so a step costs about 17 look-ups and the tour O(16·n), not O(n²) (benchmarks.scale);
    exact tours (Held-Karp, O(2ⁿ·n²)) are out of reach beyond ~20 nodes.
    """
    base = sorted(keys, key=lambda key: hashlib.sha256(step.to_bytes(8, "big") + key).digest())
    if not throughput or len(base) < 3:
        return base
    tour = _greedy_tour(base, throughput)
    for _ in range(MAX_REPAIRS):
        better = _repair_slowest_link(tour, throughput)
        if better is None:
            break
        tour = better
    return tour


MAX_REPAIRS = 8


def _greedy_tour(base: Sequence[bytes], throughput: Throughput) -> list[bytes]:
    """From base[0], always on to the unvisited node with the fastest link from the current one
    (unmeasured: fast), ties to the base order. The unvisited nodes are a linked list in base order."""
    n = len(base)
    after = list(range(1, n + 1))  # after[i]: the next unvisited index past i (n: none); 0 heads it
    before = list(range(-1, n - 1))
    tour = [base[0]]
    for _ in range(n - 1):
        here, chosen, best = tour[-1], -1, -math.inf
        index = after[0]
        while index < n:
            rate = throughput.get((here, base[index]), math.inf)
            if rate == math.inf:
                chosen = index
                break
            if rate > best:
                chosen, best = index, rate
            index = after[index]
        tour.append(base[chosen])
        after[before[chosen]] = after[chosen]
        if after[chosen] < n:
            before[after[chosen]] = before[chosen]
    return tour


def _links(tour: Sequence[bytes], throughput: Throughput) -> list[float]:
    return [throughput.get((tour[i], tour[(i + 1) % len(tour)]), math.inf) for i in range(len(tour))]


def _repair_slowest_link(tour: list[bytes], throughput: Throughput) -> list[bytes] | None:
    """The first 2-opt move that makes the slowest link faster, or None when none does. O(n)."""
    n = len(tour)
    links = _links(tour, throughput)
    worst = min(links)
    if worst == math.inf:
        return None
    cut = links.index(worst)
    order = tour[cut + 1 :] + tour[: cut + 1]  # now the slowest link is the closing one, order[-1] → order[0]

    def rate(a: int, b: int) -> float:
        return throughput.get((order[a], order[b]), math.inf)

    # Reversing order[0..end] keeps links end+1 → … → n-1, turns 0..end around, and adds the links
    # order[0] → order[end+1] and order[n-1] → order[end] in place of the slowest one.
    kept = [math.inf] * n  # kept[k]: slowest of the links order[k] → … → order[n-1]
    for k in range(n - 2, -1, -1):
        kept[k] = min(kept[k + 1], rate(k, k + 1))
    turned = math.inf  # slowest of the reversed links order[k+1] → order[k] for k < end
    for end in range(1, n - 1):
        turned = min(turned, rate(end, end - 1))
        if min(turned, kept[end + 1], rate(0, end + 1), rate(n - 1, end)) > worst:
            return order[: end + 1][::-1] + order[end + 1 :]
    return None


def measured_links(ready: Iterable[Heartbeat]) -> dict[tuple[bytes, bytes], float]:
    """The link rates the members of a step published in their ready records.

    Only ready records count: they carry the same measurements from ready to syncing, so every
    node that has read them computes the same ring. Prefixes that match no member are ignored.
    """
    beats = list(ready)
    by_prefix = {beat.node_key.hex()[:LINK_PREFIX_HEX]: beat.node_key for beat in beats}
    found: dict[tuple[bytes, bytes], float] = {}
    for beat in beats:
        links = beat.extra.get(LINKS_FIELD)
        if not isinstance(links, dict):
            continue
        for prefix, value in links.items():
            receiver = by_prefix.get(prefix) if isinstance(prefix, str) else None
            rate = record_number(value)
            if (
                receiver is not None
                and receiver != beat.node_key
                and rate is not None
                and 0 < rate < math.inf
            ):
                found[(beat.node_key, receiver)] = rate
    return found


IN_STEPS = (NodeState.TRAINING, NodeState.READY, NodeState.SYNCING)
"""States of a node that takes part in the outer steps (its outer_step is the one it works on)."""


def _others_at_or_past(
    heartbeats: Iterable[Heartbeat], step: int, *, me: bytes, ignored: Collection[bytes]
) -> bool:
    """Another live node is at `step` (one the evidence leaves out, `ignored`, aside), or in the
    steps (or finished) past it: then the step was taken or given up without us, and taking it
    alone would fork the run even where no majority is past it yet (swarm_ahead)."""
    return any(
        beat.node_key != me
        and beat.state is not NodeState.DEAD
        and (
            (beat.outer_step == step and beat.node_key not in ignored)
            or (beat.outer_step > step and beat.state in (*IN_STEPS, NodeState.FINISHED))
        )
        for beat in heartbeats
    )


def _others_in_the_run(heartbeats: Iterable[Heartbeat], me: bytes) -> bool:
    """Another node of the run is joining or in the steps: a possible member of a step soon."""
    return any(beat.node_key != me and beat.state in (NodeState.JOINING, *IN_STEPS) for beat in heartbeats)


def decide(
    heartbeats: Sequence[Heartbeat],
    step: int,
    *,
    deadline_passed: bool,
    throughput: Throughput | None = None,
    in_transit: Collection[bytes] = (),
    max_tokens: int | None = None,
    excluded: Mapping[bytes, str] | None = None,
    standby: Sequence[Member] = (),
) -> Election | None:
    """The members of `step` if this view allows a decision now, else None (keep waiting).

    Each member's weight is the tokens its record claims, at most `max_tokens` (what the run's
    settings allow one node in one outer step): a member cannot buy itself the average.
    `excluded`: what `left_out` says of this view's ready records, where the caller has it.
    Members behind NAT are kept apart in the ring where they can be (`keep_apart`); where none of
    them can be dialed, the `standby` relays this node knows of are listed for their edges."""
    ready, expected = ready_for(heartbeats, step), expected_for(heartbeats, step, in_transit)
    if excluded is None:
        excluded = left_out(ready, step)
    ready = [beat for beat in ready if beat.node_key not in excluded]
    if not ready or (expected and (not deadline_passed or 2 * len(ready) <= len(ready) + len(expected))):
        return None
    if len(ready) == 1 and (
        not deadline_passed or _others_at_or_past(heartbeats, step, me=ready[0].node_key, ignored=excluded)
    ):
        # Alone in this view: a one-member "all-reduce" has no handshake that would reveal a
        # disagreement, so never go solo while any other live node is at this step (its ready record
        # may just not have reached us) or past it, and otherwise only after the deadline.
        return None
    by_key = {beat.node_key: beat for beat in ready}
    if throughput is None:
        throughput = measured_links(ready)
    behind_nat = {key for key, beat in by_key.items() if not can_be_dialed(beat.data_reach)}
    order = keep_apart(ring_order(list(by_key), step, throughput), behind_nat)
    members = []
    for key in order:
        address = parse_address(by_key[key].data_addr)
        assert address is not None, "ready_for keeps only records with a usable address"
        host, port = address
        tokens = by_key[key].tokens if max_tokens is None else min(by_key[key].tokens, max_tokens)
        members.append(
            Member(key=key, host=host, port=port, weight=float(tokens), reachable=key not in behind_nat)
        )
    relays = (
        () if len(members) < 2 or behind_nat != set(by_key) else tuple(sorted(standby, key=lambda r: r.key))
    )
    return Election(step=step, members=members, left_out=dict(excluded), relays=relays)


def keep_apart(order: list[bytes], behind_nat: Collection[bytes]) -> list[bytes]:
    """The ring order with as few members behind NAT next to each other as can be: neither end of
    such an edge can dial the other, so it goes through a relay (relay.py), which costs a reachable
    member the edge's bandwidth.

    Where the order already keeps them apart it stands; otherwise they are spread over the gaps
    after the reachable members, in order, as evenly as the counts allow. With no reachable member
    at all nothing can be done: the order stands (and its attempt fails)."""
    hidden = [key for key in order if key in behind_nat]
    reachable = [key for key in order if key not in behind_nat]
    n = len(order)
    adjacent = any(order[i] in behind_nat and order[(i + 1) % n] in behind_nat for i in range(n))
    if not hidden or not reachable or (not adjacent and len(hidden) <= len(reachable)) or n < 3:
        return order
    spread = []
    for index, key in enumerate(reachable):
        spread.append(key)
        spread.extend(hidden[index :: len(reachable)])
    return spread


class SwarmAhead(Exception):
    """The swarm is done with this step: no election of it can include anyone else."""


class LeftOut(Exception):
    """The evidence of failed attempts leaves this node out of the step (the message says why)."""


def swarm_ahead(
    heartbeats: Iterable[Heartbeat], step: int, *, me: bytes, finished: Mapping[bytes, int] | None = None
) -> bool:
    """Step `step` has been taken without this node: a strict majority of the run's other nodes —
    those in the steps, those that finished it (still here, or gone: `finished`, node → its last
    step) — is past it (a finished node: at it or past it; it takes no more steps).

    That history is the swarm's, so this node catches up (replay, checkpoint) instead of taking the
    step alone, or with others just as far behind, which would fork the run. A majority, so that
    one record claiming a far step (a stranger's, a broken node's) cannot send everyone off."""
    position = _positions(heartbeats, me, finished)
    return 2 * _past(position, step) > len(position)


def join_aim(heartbeats: Iterable[Heartbeat], step: int, *, me: bytes) -> int:
    """The step a node that replays `step` (the swarm is past it) tells the others it joins at:
    step + 1, so that their election of it waits for the node; or step + 2 where a strict majority
    of the others is ready for step + 1 already (or syncing it). They may then have decided it
    without the node, whose own sync of it would fail on the membership until they are past it —
    and leave it one step behind again (under overlap, where a step's sync follows its phase at
    once, at every step: a joiner over long paths never joined). Aiming one further, the node
    replays step + 1 once it is out, and their election of step + 2 waits for it."""
    others = [b for b in heartbeats if b.node_key != me]
    under_way = sum(
        b.outer_step == step + 1 and b.state in (NodeState.READY, NodeState.SYNCING) for b in others
    )
    return step + 2 if 2 * under_way > len(others) else step + 1


def swarm_still_at(
    heartbeats: Iterable[Heartbeat], step: int, *, me: bytes, finished: Mapping[bytes, int] | None = None
) -> bool:
    """Others are still at `step` (or before it) and no strict majority is past it: the mirror of
    swarm_ahead, for a node that gave `step` up or was left out of it.

    Such a node waits while this holds before it takes step + 1: the others will take `step` and
    only then step + 1, and taking step + 1 without them (alone, or with others left out) would
    fork the run, two results of one step (seen at 16 nodes under load). Once a majority is past,
    the step is the swarm's to replay."""
    position = _positions(heartbeats, me, finished)
    behind = any(not done and at <= step for at, done in position.values())
    return behind and 2 * _past(position, step) <= len(position)


def _positions(
    heartbeats: Iterable[Heartbeat], me: bytes, finished: Mapping[bytes, int] | None
) -> dict[bytes, tuple[int, bool]]:
    """The other nodes' steps: node → (its outer step, whether it finished the run there)."""
    position = {key: (at, True) for key, at in (finished or {}).items() if key != me}
    for beat in heartbeats:
        if beat.node_key == me:
            continue
        if beat.state is NodeState.FINISHED:
            position[beat.node_key] = (beat.outer_step, True)
        elif beat.state in IN_STEPS and beat.node_key not in position:
            position[beat.node_key] = (beat.outer_step, False)
    return position


def _past(position: Mapping[bytes, tuple[int, bool]], step: int) -> int:
    """How many are done with `step`: in a later one, or finished at it or later (no more steps)."""
    return sum(at >= step if done else at > step for at, done in position.values())


async def elect(
    read: Callable[[], Awaitable[list[Heartbeat]]],
    step: int,
    *,
    straggler_deadline: float,
    timeout: float,
    poll_interval: float = 0.25,
    clock: Callable[[], float] = time.monotonic,
    me: bytes | None = None,
    finished: Mapping[bytes, int] | None = None,
    in_transit: Collection[bytes] = (),
    max_tokens: int | None = None,
    pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
    standby: Sequence[Member] = (),
    lone_grace: float | None = None,
) -> Election:
    """Poll the heartbeats (via `read`) until `decide` gives the members of `step`.

    `lone_grace` (given `me`): where every read for this long has shown no other node of the run,
    joining or in the steps, the straggler deadline shrinks to it. The deadline waits for ready
    records still on their way from nodes the view knows; with none known, a run of one node would
    otherwise pay the whole deadline every step. One read that missed the others (a DHT read that
    timed out) starts the grace, the next that sees one ends it.

    The DHT offers no change notification across processes, hence the bounded poll; `pause`
    waits between reads (at most `poll_interval`: the node's cuts it short when a member that has
    decided already dials it).
    Raises TimeoutError when no decision is possible within `timeout` seconds, SwarmAhead (given
    `me`) as soon as the swarm is done with `step` (`swarm_ahead`; `finished` is read again at every
    poll): a straggler must catch up, not take the step alone; and LeftOut when the evidence leaves
    `me` out of the step.
    """
    started = clock()
    first_ready: float | None = None
    lone_since: float | None = None
    """Since when every read has shown no other node of the run (one bad read is not enough)."""
    while True:
        heartbeats = await read()
        if me is not None and swarm_ahead(heartbeats, step, me=me, finished=finished):
            raise SwarmAhead(f"the swarm is past outer step {step}")
        ready = ready_for(heartbeats, step)
        excluded = left_out(ready, step)
        if me in excluded:
            raise LeftOut(f"left out of outer step {step}: {excluded[me]}")
        now = clock()
        if first_ready is None and ready:
            first_ready = now
        if me is None or _others_in_the_run(heartbeats, me):
            lone_since = None
        elif lone_since is None:
            lone_since = now
        passed = first_ready is not None and now - first_ready >= straggler_deadline
        if lone_grace is not None and lone_since is not None and first_ready is not None:
            passed = passed or now - max(lone_since, first_ready) >= lone_grace
        election = decide(
            heartbeats,
            step,
            deadline_passed=passed,
            in_transit=in_transit,
            max_tokens=max_tokens,
            excluded=excluded,
            standby=standby,
        )
        if election is not None:
            return election
        if now - started >= timeout:
            raise TimeoutError(f"no members for step {step} within {timeout:.0f} s")
        await pause(poll_interval)
