"""Who joined a run and who left it, and why: the lines a bootstrap peer prints about its run and a
node logs about its peers, from the records they read anyway (`SwarmView` hands it every read).

A node leaves
- by its deathrattle: its record says `dead` (or `leaving`, or that it finished the run);
- crashed: its data port refuses connections (crash_watch.py tells the roster);
- silent: its heartbeat did not advance for the liveness timeout (stopped, frozen, cut off);
and for a step it is left out by the evidence of a failed attempt (evidence.py; the node's
elections tell). Each departure is one line, once; a node whose heartbeat advances again after it
left has joined again (after a crash verdict, with a record signed after the verdict: one stored
just before the crash and read late is no return).

In an open run any record may be a stranger's: the roster remembers at most MAX_NODES nodes, and
says at most one line of a kind per `gap` seconds (the events in between go into the next line, a
few by name and the others counted), so no number of records makes more lines.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from p2ptrain.identity import short_id
from p2ptrain.swarm.records import FINISHED_FIELD, Heartbeat, NodeState, record_number
from p2ptrain.swarm.status import busiest_ring, planned_steps

log = logging.getLogger(__name__)

MAX_NODES = 4096
"""Nodes the roster remembers: keys are free in an open run."""
MAX_NAMED = 5
"""Nodes one line names; the others in it are counted."""
LINE_GAP = 5.0
"""Seconds between two lines of one kind (joins, leaves, left out): what comes sooner waits for
the next line."""
STEPS_EVERY = 30.0
"""Seconds between two "outer step N done" lines of a bootstrap peer."""
CRASH_GRACE_READS = 2
"""Reads of the records a crash verdict (its port refuses) waits for the node's own record to say
why it left: a node that stops cleanly closes its port as it leaves, and a peer that probed it then
read the deathrattle a moment later (seen: a clean exit said as a crash). Two, as the first may have
been under way before the verdict; counted in reads, not seconds, as a drill's last steps may hold
only a few of them."""
FORGET_AFTER = 120.0
"""Seconds a node that left is remembered after its record was last read: longer than a record
lives in the DHT (heartbeat_timeout + max_clock_skew), so its last record is no news."""


def departure(beat: Heartbeat) -> str:
    """Why the record says its node left ("" while it takes part)."""
    if beat.state is NodeState.FINISHED or (
        beat.state is NodeState.DEAD and beat.extra.get(FINISHED_FIELD) is True
    ):
        return "finished the run"
    if beat.state is NodeState.DEAD:
        return "deathrattle"
    if beat.state is NodeState.LEAVING:
        return "leaving"
    return ""


@dataclass(kw_only=True)
class _Node:
    beat: Heartbeat
    advanced: float
    """When its seq last grew, on this reader's clock."""
    seen: float
    """When a read last had its record."""
    gone: str = ""
    """Why it left; "" while it takes part."""
    left_out_of: int | None = None
    """The step the evidence left it out of (said once until it takes part in a step again)."""
    crashed_at: float = -math.inf
    """Wall time of the crash verdict: records it signed before that, read late, are no return."""
    suspected: str = ""
    """A crash verdict not said yet: its deathrattle, read within CRASH_GRACE_READS, is the better
    reason."""
    reads_since: int = 0
    """Reads since the verdict in `suspected`."""


class Coalesced:
    """Events of one kind, (node, detail) each: the first after a quiet `gap` is said at once, those
    that follow within it go into one line (MAX_NAMED by name, the others counted)."""

    def __init__(self, gap: float):
        self.gap = gap
        self.items: list[tuple[str, str]] = []
        self.more = 0
        self._last = -math.inf

    def add(self, node: str, detail: str = "") -> None:
        if len(self.items) < MAX_NAMED:
            self.items.append((node, detail))
        else:
            self.more += 1

    def take(self, now: float) -> tuple[list[tuple[str, str]], int] | None:
        """The events to say now and how many more there were, or None."""
        if not self.items or now - self._last < self.gap:
            return None
        taken = self.items, self.more
        self.items, self.more, self._last = [], 0, now
        return taken


class Roster:
    """The nodes of one run across reads, and the lines about who joined, left or was left out.

    `say` takes the lines about departures (and steps, every `steps_every` seconds where given),
    `say_joins` those about joins (default: `say`); without `say`, this module's log takes them
    (joins at INFO, the rest at WARNING). `me`: this node, never announced."""

    def __init__(
        self,
        run_id: str,
        *,
        timeout: float,
        say: Callable[[str], None] | None = None,
        say_joins: Callable[[str], None] | None = None,
        me: bytes = b"",
        steps_every: float | None = None,
        gap: float = LINE_GAP,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.run_id = run_id
        self.timeout = timeout
        self._say = say or log.warning
        self._say_joins = say_joins or say or log.info
        self.me = me
        self.steps_every = steps_every
        self._clock = clock
        self._nodes: dict[bytes, _Node] = {}
        self._joined = Coalesced(gap)
        self._left = Coalesced(gap)
        self._out = Coalesced(gap)
        self._step = -1
        """The last step a steps line named."""
        self._steps_said = -math.inf
        self._forgot = -math.inf

    def live(self) -> int:
        """Nodes taking part now, as far as this roster knows (`me` among them)."""
        return sum(1 for node in self._nodes.values() if not node.gone) + (1 if self.me else 0)

    def update(self, beats: Iterable[Heartbeat]) -> None:
        """One read's records (the newest of each node): who joined, who left; then the lines due."""
        now = self._clock()
        for beat in beats:
            key = beat.node_key
            if key == self.me or beat.state is NodeState.RELAY:
                continue
            known = self._nodes.get(key)
            if known is None:
                if len(self._nodes) >= MAX_NODES:
                    # full: newcomers go unsaid until the records of those that left are gone (a
                    # stranger's flood, forgotten at once, would come back as "joined" next read)
                    continue
                why = departure(beat)  # an old deathrattle, say: no news
                self._nodes[key] = _Node(beat=beat, advanced=now, seen=now, gone=why)
                if not why:
                    self._joined.add(short_id(key))
                continue
            known.seen = now
            if beat.seq <= known.beat.seq:
                continue
            known.beat, known.advanced = beat, now
            why = departure(beat)
            if why and not known.gone:
                self._leave(known, why)
            elif not why and known.gone and beat.timestamp > known.crashed_at:
                # a record signed before its crash verdict was stored just before the crash and
                # read late (seen: a crashed node said to leave, join and leave again)
                known.gone, known.left_out_of, known.crashed_at = "", None, -math.inf
                self._joined.add(short_id(key))
            elif not why and known.suspected and beat.timestamp > known.crashed_at:
                known.suspected = ""  # alive after all: a record signed after the verdict
        for node in self._nodes.values():
            silent = now - node.advanced > self.timeout
            if not node.gone and node.suspected:
                node.reads_since += 1
                if silent or node.reads_since >= CRASH_GRACE_READS:
                    self._leave(node, node.suspected)  # the more precise reason of the two
            if not node.gone and silent:
                self._leave(node, f"silent for over {self.timeout:g} s")
        if now - self._forgot >= 1.0:
            self._forget(now)
        self.flush(now)

    def crashed(self, beat: Heartbeat, why: str) -> None:
        """Its node left: `why` (its data port refuses connections). Said once, like any departure,
        CRASH_GRACE_READS reads later, unless its record says another reason meanwhile."""
        node = self._nodes.get(beat.node_key)
        if node is not None and not node.gone and not node.suspected:
            node.crashed_at = time.time()
            node.suspected, node.reads_since = why, 0

    def left_out(self, step: int, reasons: dict[bytes, str]) -> None:
        """The evidence left these nodes out of `step` (election.left_out): each said once until it
        takes part in a step again (`took_part`)."""
        for key, why in reasons.items():
            node = self._nodes.get(key)
            if node is None or node.gone or node.left_out_of is not None or key == self.me:
                continue
            node.left_out_of = step
            self._out.add(short_id(key), f"outer step {step}: {why}")
        self.flush(self._clock())

    def took_part(self, keys: Collection[bytes]) -> None:
        """These nodes completed a step with this one: left out of none."""
        for key in keys:
            node = self._nodes.get(key)
            if node is not None:
                node.left_out_of = None

    def _leave(self, node: _Node, why: str) -> None:
        node.gone, node.suspected = why, ""
        self._left.add(short_id(node.beat.node_key), why)

    def _forget(self, now: float) -> None:
        """Drop the nodes that left and whose records are gone."""
        self._forgot = now
        stale = [key for key, node in self._nodes.items() if node.gone and now - node.seen > FORGET_AFTER]
        for key in stale:
            del self._nodes[key]

    def flush(self, now: float | None = None) -> None:
        """Say the lines that are due."""
        now = self._clock() if now is None else now
        run = f"run {self.run_id!r}"
        joined = self._joined.take(now)
        if joined:
            self._say_joins(_line(joined, f"joined {run}", f"{self.live()} live"))
        left = self._left.take(now)
        if left:
            self._say(_line(left, f"left {run}", f"{self.live()} live"))
        out = self._out.take(now)
        if out:
            self._say(_line(out, "left out by the evidence of a failed attempt"))
        if self.steps_every is not None and now - self._steps_said >= self.steps_every:
            line = self._steps_line()
            if line:
                self._steps_said = now
                self._say(line)

    def _steps_line(self) -> str:
        """The completed outer step most live nodes report, if another than the one said last;
        else "". Most, not the highest: one record claiming a far step (a stranger's) would
        otherwise stand for the run, and silence its real steps for as long as it lives."""
        beats = [node.beat for node in self._nodes.values() if not node.gone]
        ring = busiest_ring(beats)
        if ring is None or ring["step"] == self._step:
            return ""
        self._step = step = ring["step"]
        members = {bytes.fromhex(key) for key in ring["members"]}
        losses = [
            value
            for beat in beats
            if beat.node_key in members and (value := record_number(beat.extra.get("loss"))) is not None
        ]
        loss = f", loss {sum(losses) / len(losses):.3f}" if losses else ""
        plan = planned_steps(beats)
        of = f" ({step + 1} of {plan} done)" if plan is not None else ""
        count = len(members)
        return f"run {self.run_id!r}: outer step {step} done by {count} node{'s' * (count != 1)}{loss}{of}"


def _line(taken: tuple[list[tuple[str, str]], int], what: str, count: str = "") -> str:
    """One node: "node a <what> (detail; count)"; more: "3 nodes <what> (count): a (detail), …"."""
    items, more = taken
    if len(items) == 1 and not more:
        node, detail = items[0]
        inside = "; ".join(part for part in (detail, count) if part)
        return f"node {node} {what}" + (f" ({inside})" if inside else "")
    names = ", ".join(f"{node} ({detail})" if detail else node for node, detail in items)
    total = len(items) + more
    return (
        f"{total} nodes {what}"
        + (f" ({count})" if count else "")
        + f": {names}"
        + (f" and {more} more" if more else "")
    )
