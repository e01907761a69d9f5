"""Fault injection for tests and drills: faults a test cannot cause from outside at the right moment.

Read once per process from the environment:

    P2PTRAIN_INJECT_NAN_STEP=N        the pseudo-gradient of outer step N holds a NaN (trainer rank 0)
    P2PTRAIN_INJECT_LATE=N:SECONDS    the node reports ready(N) SECONDS after it sees another node's
                                      ready(N): a straggler, however fast each node computes (agent)
    P2PTRAIN_INJECT_GIVE_UP=N         the node gives outer step N up before it reports ready, as one
                                      whose every attempt failed or that was left out (agent)
    P2PTRAIN_INJECT_DIE_IN_SYNC=N     the node SIGKILLs itself once the all-reduce of step N has data
                                      in flight, as a machine that loses power mid-reduce (agent)
    P2PTRAIN_INJECT_SCALE=N:FACTOR    from outer step N on, the node multiplies its pseudo-gradient by
                                      FACTOR before the all-reduce (negative flips it): a poisoner
                                      whose values stay finite (agent)
    P2PTRAIN_INJECT_ATTACK=N:KIND     from outer step N on, the node sends a well-shaped but wrong
                                      pseudo-gradient (Poisoner.KINDS): the opposite of its own, the
                                      opposite of the last shared result at its own norm, a random
                                      direction at its own norm, its own from K steps ago
                                      (stale:K, default 3), or zeros with its full token count (agent)
    P2PTRAIN_INJECT_SLOW_START=S      the node starts its ranks S seconds after its record is up, as
                                      one that probes its reachability behind NAT first, or loads
                                      torch from a slow disk (agent)
    P2PTRAIN_INJECT_CLOCK_OFFSET=S    the process's wall clock (time.time) runs S seconds ahead (or
                                      behind, when negative), as on a host whose clock is off; set
                                      by `shift_wall_clock` at process start, before hivemind loads
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from p2ptrain.errors import UserError

NEVER = -1


def _step(name: str) -> int:
    text = os.environ.get(name, "")
    try:
        return int(text) if text else NEVER
    except ValueError:
        raise UserError(f"{name}={text!r}: expected an outer step number") from None


def _seconds(name: str) -> float:
    text = os.environ.get(name, "")
    try:
        return float(text) if text else 0.0
    except ValueError:
        raise UserError(f"{name}={text!r}: expected seconds") from None


def shift_wall_clock() -> float:
    """Apply P2PTRAIN_INJECT_CLOCK_OFFSET to time.time in this process (and the children it forks).

    Must run before hivemind is imported: it binds its DHT clock to time.time at import. The
    monotonic clock is left alone, as it is on a host whose wall clock is merely set wrong.
    """
    text = os.environ.get("P2PTRAIN_INJECT_CLOCK_OFFSET", "")
    if not text:
        return 0.0
    try:
        offset = float(text)
    except ValueError:
        raise UserError(f"P2PTRAIN_INJECT_CLOCK_OFFSET={text!r}: expected seconds, e.g. -5") from None
    if offset:
        true_time, true_time_ns = time.time, time.time_ns
        time.time = lambda: true_time() + offset
        time.time_ns = lambda: true_time_ns() + int(offset * 1e9)
    return offset


@dataclass(kw_only=True)
class Poisoner:
    """A member that sends a well-shaped but wrong pseudo-gradient from outer step `start` on: finite,
    of a typical norm, with its full token count — what norm clipping alone lets through."""

    KINDS = ("opposite", "against_result", "random", "stale", "zero")
    start: int
    kind: str
    lag: int = 3
    """stale: how many outer steps old the sent pseudo-gradient is."""
    history: deque[np.ndarray] = field(default_factory=deque)
    last_result: np.ndarray | None = None

    @classmethod
    def parse(cls, text: str, source: str = "P2PTRAIN_INJECT_ATTACK") -> Poisoner:
        """ "STEP:KIND" or "STEP:stale:K"; UserError for anything else."""
        step, _, rest = text.partition(":")
        kind, _, lag = rest.partition(":")
        try:
            poisoner = cls(start=int(step), kind=kind, lag=int(lag) if lag else 3)
        except ValueError:
            poisoner = None
        if poisoner is None or kind not in cls.KINDS or poisoner.lag < 1 or (lag and kind != "stale"):
            raise UserError(
                f"{source}={text!r}: expected STEP:KIND (KIND one of {', '.join(cls.KINDS)}; stale:K)"
            )
        return poisoner

    def corrupt(self, step: int, vector: np.ndarray) -> bool:
        """Replace `vector` (this member's pseudo-gradient of `step`) in place; whether it did."""
        own = vector.copy() if self.kind == "stale" else None
        if own is not None:
            self.history.append(own)
            if len(self.history) > self.lag + 1:
                self.history.popleft()
        if step < self.start:
            return False
        size = float(np.linalg.norm(vector.astype(np.float64)))
        if self.kind == "opposite":
            np.negative(vector, out=vector)
        elif self.kind == "zero":
            vector[:] = 0
        elif self.kind == "stale":
            if len(self.history) <= self.lag:
                return False  # nothing that old yet
            vector[:] = self.history[0]
        else:
            if self.kind == "random":
                direction = np.random.default_rng(step).standard_normal(vector.size)
            elif self.last_result is not None:
                direction = -self.last_result.astype(np.float64)
            else:
                direction = -vector.astype(np.float64)  # no shared result yet: its own, negated
            length = float(np.linalg.norm(direction))
            vector[:] = direction * (size / length if length > 0 and math.isfinite(length) else 0.0)
        return True

    def remember(self, result: np.ndarray) -> None:
        """The shared result of a step (against_result turns the next ones against it)."""
        if self.kind == "against_result":
            self.last_result = result.copy()


@dataclass(frozen=True, kw_only=True)
class Faults:
    nan_step: int = NEVER
    late_step: int = NEVER
    late_seconds: float = 0.0
    die_in_sync_step: int = NEVER
    give_up_step: int = NEVER
    scale_step: int = NEVER
    scale_factor: float = 1.0
    slow_start: float = 0.0
    attack: str = ""
    """P2PTRAIN_INJECT_ATTACK's text, checked here; `poisoner()` makes the (stateful) attacker."""

    @classmethod
    def from_env(cls) -> Faults:
        late = os.environ.get("P2PTRAIN_INJECT_LATE", "")
        late_step, _, late_seconds = late.partition(":")
        try:
            late_pair = (int(late_step), float(late_seconds or 0)) if late else (NEVER, 0.0)
        except ValueError:
            raise UserError(f"P2PTRAIN_INJECT_LATE={late!r}: expected STEP:SECONDS") from None
        scale = os.environ.get("P2PTRAIN_INJECT_SCALE", "")
        scale_step, _, scale_factor = scale.partition(":")
        try:
            scale_pair = (int(scale_step), float(scale_factor)) if scale else (NEVER, 1.0)
        except ValueError:
            raise UserError(f"P2PTRAIN_INJECT_SCALE={scale!r}: expected STEP:FACTOR") from None
        attack = os.environ.get("P2PTRAIN_INJECT_ATTACK", "")
        if attack:
            Poisoner.parse(attack)
        return cls(
            nan_step=_step("P2PTRAIN_INJECT_NAN_STEP"),
            late_step=late_pair[0],
            late_seconds=late_pair[1],
            die_in_sync_step=_step("P2PTRAIN_INJECT_DIE_IN_SYNC"),
            give_up_step=_step("P2PTRAIN_INJECT_GIVE_UP"),
            scale_step=scale_pair[0],
            scale_factor=scale_pair[1],
            slow_start=_seconds("P2PTRAIN_INJECT_SLOW_START"),
            attack=attack,
        )

    def poisoner(self) -> Poisoner | None:
        """The attacker P2PTRAIN_INJECT_ATTACK asks for, if any."""
        return Poisoner.parse(self.attack) if self.attack else None

    def scale(self, step: int) -> float:
        """The factor P2PTRAIN_INJECT_SCALE applies to this node's pseudo-gradient of `step`."""
        return self.scale_factor if self.scale_step != NEVER and step >= self.scale_step else 1.0

    def die_mid_reduce(self, step: int) -> None:
        """Called as all-reduce frames of `step` arrive: the first one of the chosen step kills us."""
        if step == self.die_in_sync_step:
            os.kill(os.getpid(), signal.SIGKILL)
