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
    P2PTRAIN_INJECT_SLOW_START=S      the node starts its ranks S seconds after its record is up, as
                                      one that probes its reachability behind NAT first, or loads
                                      torch from a slow disk (agent)
    P2PTRAIN_INJECT_CLOCK_OFFSET=S    the process's wall clock (time.time) runs S seconds ahead (or
                                      behind, when negative), as on a host whose clock is off; set
                                      by `shift_wall_clock` at process start, before hivemind loads
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

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
        return cls(
            nan_step=_step("P2PTRAIN_INJECT_NAN_STEP"),
            late_step=late_pair[0],
            late_seconds=late_pair[1],
            die_in_sync_step=_step("P2PTRAIN_INJECT_DIE_IN_SYNC"),
            give_up_step=_step("P2PTRAIN_INJECT_GIVE_UP"),
            scale_step=scale_pair[0],
            scale_factor=scale_pair[1],
            slow_start=_seconds("P2PTRAIN_INJECT_SLOW_START"),
        )

    def scale(self, step: int) -> float:
        """The factor P2PTRAIN_INJECT_SCALE applies to this node's pseudo-gradient of `step`."""
        return self.scale_factor if self.scale_step != NEVER and step >= self.scale_step else 1.0

    def die_mid_reduce(self, step: int) -> None:
        """Called as all-reduce frames of `step` arrive: the first one of the chosen step kills us."""
        if step == self.die_in_sync_step:
            os.kill(os.getpid(), signal.SIGKILL)
