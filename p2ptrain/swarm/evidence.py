"""Who is left out of a step, by one rule every node applies to the same signed records.

A member that never connects, never answers the handshake or breaks the protocol fails the attempt
for everyone. Each node that saw it happen names the culprit in its own ready record for the step:

    extra["blame"] = {"step": N, "keys": [hex prefix of each member it could not work with]}

The field is part of the signed record, sticky for the rest of the step, and present (perhaps
empty) on every node that has had an attempt of step N fail: it *reported*. Every node then elects
the next attempt from the ready records minus `left_out(ready, N)`:

- every member named by an accuser that is not itself left out is left out;
- a member named by two or more accusers is surely the problem: only it goes;
- a member named by a single accuser, that reported and does not name the accuser back, says the
  link was fine from its side. One of the two is lying or broken and nobody can tell which, so both
  go: a liar costs the swarm one member per lie (itself), never the step;
- an accuser who is left out by two or more others loses its voice (a stranger accusing honest
  members after everyone named it).

A node that has seen a member fail steps in a row names it in its ready record from the start of
the next steps (`Offences`), so an unreachable node is ignored for a while instead of costing every
step a failed attempt; when that while is over, the node first probes it (a hello it must answer
within a second, and not with "our views differ": no honest node says so to a step nobody is at)
and names it again at once if it fails. Records of other steps and names that match no ready
member count for nothing, so an old or forged accusation cannot reach beyond one step.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from p2ptrain.identity import short_id
from p2ptrain.swarm.records import Heartbeat
from p2ptrain.untrusted import lower_hex

BLAME_FIELD = "blame"
PREFIX_HEX = 16
"""64 bits of a node key name it among the members of a step (as the link measurements do)."""
MAX_BLAMED = 8
"""Names a record may carry; beyond that, an accuser could only be flooding."""
MAX_IGNORE_STEPS = 64
"""Longest a repeat offender is named from the start of a step (steps)."""
MAX_OFFENDERS = 1024
"""Offenders a node remembers (the oldest offence is forgotten first): bounded memory."""


def blame_field(step: int, keys: Iterable[bytes]) -> dict[str, Any]:
    """The record field saying that this node, at `step`, could not work with `keys`."""
    names = sorted({key.hex()[:PREFIX_HEX] for key in keys})[:MAX_BLAMED]
    return {"step": step, "keys": names}


def reported(beat: Heartbeat, step: int) -> set[str] | None:
    """The key prefixes `beat` names for `step`, or None when it reported nothing for that step."""
    blame = beat.extra.get(BLAME_FIELD)
    if not isinstance(blame, Mapping):
        return None
    at = blame.get("step")
    if not isinstance(at, int) or isinstance(at, bool) or at != step:
        return None
    keys = blame.get("keys")
    if not isinstance(keys, list) or len(keys) > MAX_BLAMED:
        return set()
    return {name for name in keys if isinstance(name, str) and len(name) == PREFIX_HEX and lower_hex(name)}


def accusations(ready: Iterable[Heartbeat], step: int) -> dict[bytes, set[bytes]]:
    """Accused → its accusers, among the ready members of `step`."""
    beats = list(ready)
    by_prefix = {beat.node_key.hex()[:PREFIX_HEX]: beat.node_key for beat in beats}
    accused: dict[bytes, set[bytes]] = defaultdict(set)
    for beat in beats:
        for name in reported(beat, step) or ():
            key = by_prefix.get(name)
            if key is not None and key != beat.node_key:
                accused[key].add(beat.node_key)
    return dict(accused)


def left_out(ready: Collection[Heartbeat], step: int) -> dict[bytes, str]:
    """The ready members of `step` that its next attempt goes without, each with the reason."""
    accused = accusations(ready, step)
    if not accused:
        return {}
    reporters = {beat.node_key for beat in ready if reported(beat, step) is not None}
    surely = {key for key, accusers in accused.items() if len(accusers) >= 2}
    out = {key: f"named by {len(accused[key])} members it failed" for key in surely}
    for key, accusers in accused.items():
        voiced = accusers - surely
        if key in surely or not voiced:
            continue
        accuser = min(voiced)
        out[key] = f"named by {short_id(accuser)}"
        if key in reporters and key not in accused.get(accuser, set()) and len(voiced) == 1:
            out.setdefault(accuser, f"its accusation of {short_id(key)} is not confirmed")
    return out


@dataclass
class Offences:
    """The members this node saw fail steps in a row, to name from the start of the next steps.

    A member this node named in a step is named from the start of the next 2 steps; each time it
    fails again before it took part in a completed step, for twice as many (4, 8, …, at most
    MAX_IGNORE_STEPS). Taking part in a completed step clears its record.

    A failure counts whoever named it: a member that was in one of this node's attempts of a step
    and not among the members who completed it failed that step here too. Which of the members
    names a stranger first depends on timing (the one whose patience runs out first), so counting
    only this node's own naming let the windows of 2 restart with each new namer (seen: tried
    every third step). Only this node's naming opens a window, so a failure seen elsewhere makes
    no one named, only named for longer when this node itself sees it fail.
    """

    _count: dict[bytes, int] = field(default_factory=dict)
    _last: dict[bytes, int] = field(default_factory=dict)
    _until: dict[bytes, int] = field(default_factory=dict)

    def step_done(
        self, step: int, members: Iterable[bytes], *, named: Iterable[bytes], failed: Iterable[bytes] = ()
    ) -> None:
        """After `step`: who took part in it (cleared), whom this node named in it, and who else
        was tried in it here and failed (left out by someone else's evidence)."""
        for key in members:
            for table in (self._count, self._last, self._until):
                table.pop(key, None)
        for key in named:
            if self._count_failure(key, step):
                # no completed step with it since its last offence: a repeat, named for twice as long
                self._until[key] = step + 1 + min(2 ** self._count[key], MAX_IGNORE_STEPS)
        for key in failed:
            self._count_failure(key, step)
        while len(self._last) > MAX_OFFENDERS:
            oldest = min(self._last, key=self._last.__getitem__)
            for table in (self._count, self._last, self._until):
                table.pop(oldest, None)

    def _count_failure(self, key: bytes, step: int) -> bool:
        """One more failure of `key`, at most one per step; False if `step` had one already."""
        if self._last.get(key) == step:
            return False
        self._count[key] = self._count.get(key, 0) + 1
        self._last[key] = step
        return True

    def due_at(self, step: int) -> set[bytes]:
        """Offenders whose window has ended by `step`: tried again unless they still fail a probe."""
        return {key for key, until in self._until.items() if until <= step}

    def still_failing(self, step: int, keys: Iterable[bytes]) -> None:
        """These offenders failed a probe before `step`: named from its start, for twice as long."""
        for key in keys:
            self._count[key] = self._count.get(key, 0) + 1
            self._last[key] = step - 1
            self._until[key] = step + min(2 ** self._count[key], MAX_IGNORE_STEPS)

    def named_at(self, step: int) -> set[bytes]:
        """Whom to name in the ready record of `step` before any attempt of it."""
        return {key for key, until in self._until.items() if self._last[key] < step < until}


class Refusers:
    """Members whose handshake has refused ours during one step, and since when.

    An honest member refuses outright ("our views differ", or a plain no: the step is over there)
    only for a while, until records propagate. One that still refuses after `patience` seconds,
    with no handshake of ours completed meanwhile, is lying, as a stranger that answers every hello
    so would, or broken. Unnamed, it would stall every step: the dial it refuses ends the attempt on
    every member before anyone's deadline names it, and counted as failed tries, its refusals burn
    the step's retries within seconds.

    The patience is twice the setup deadline (what a member that never connects gets): an honest
    member can be held for up to one deadline by another that never answers before it names that
    one too, and meanwhile it refuses us (our views differ). With one deadline's patience, nodes
    that name a member at different times could name each other."""

    def __init__(self, patience: float, clock: Callable[[], float] = time.monotonic):
        self.patience = patience
        self._clock = clock
        self._since: dict[bytes, float] = {}

    def forgive(self, connected: Iterable[bytes]) -> None:
        """Members that completed a handshake with us since: whatever they said before, they do not
        refuse everything (an honest member held by a refuser refuses only some of our dials)."""
        for key in connected:
            self._since.pop(key, None)

    def still(self, refuser: bytes | None) -> bytes | None:
        """`refuser` if it has said so for `patience` seconds by now, else None (it may be honest)."""
        if refuser is None:
            return None
        now = self._clock()
        since = self._since.setdefault(refuser, now)
        return refuser if now - since >= self.patience else None
