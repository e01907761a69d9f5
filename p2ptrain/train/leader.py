"""What rank 0 of a node alone holds and does in the outer step: the shared state S's θ_outer and
momentum (host memory, canonical layout), the vector it shares with the agent, the link to the
agent, and the metrics file. The trainer and the overlapped outer step (overlap.py) both work
through it; the other local ranks have none (`Trainer.leader` is None there).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from p2ptrain.channel import Averaged, Ready
from p2ptrain.faults import NEVER
from p2ptrain.train.agent_link import AgentLink
from p2ptrain.train.metrics import MetricsWriter
from p2ptrain.train.outer import OuterNesterov, all_finite

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class Leader:
    """Rank 0's part of the outer step (see the module docstring), in one object so that the
    blocking outer step (trainer.py) and the overlapped one (overlap.py) are handed the same thing,
    and on the other ranks plainly nothing."""

    outer: OuterNesterov
    """S's params and momentum."""
    buffer: torch.Tensor
    """The vector shared with the agent: Δ handed over, the average handed back (it is the agent's
    between the two)."""
    link: AgentLink
    metrics: MetricsWriter
    nan_step: int = NEVER
    """Fault injection (P2PTRAIN_INJECT_NAN_STEP): the outer step whose Δ gets a NaN."""

    def checked_ready(self, step: int, tokens: int, delta: torch.Tensor) -> Ready:
        """The Ready for `delta`: never send NaN/Inf; contribute nothing (weight 0) instead."""
        if step == self.nan_step:
            delta[0] = math.nan  # fault injection: P2PTRAIN_INJECT_NAN_STEP
        finite = all_finite(delta)
        if not finite:
            log.error("outer step %d: pseudo-gradient holds NaN/Inf; contributing zero", step)
            delta.zero_()
        return Ready(step, tokens if finite else 0, finite)

    def record_outer(
        self,
        step: int,
        averaged: Averaged | None,
        *,
        loss: float,
        finite: bool,
        params_hash: str,
        seconds: float = 0.0,
        **overlap: int,
    ) -> None:
        """The metrics line of outer step `step`, just taken (`loss`: its phase's mean; `overlap`:
        where in the next phase an overlapped step was taken)."""
        self.metrics.write(
            "outer",
            step,
            loss=round(loss, 5),
            members=averaged.members if averaged else 0,
            ring=averaged.ring if averaged else [],
            sync_s=round(averaged.sync_s, 3) if averaged else 0.0,
            replayed=averaged.replayed if averaged else False,
            bytes_sent=averaged.bytes_sent if averaged else 0,
            relayed_bytes=averaged.relayed_bytes if averaged else 0,
            finite=finite,
            params_hash=params_hash,
            seconds=round(seconds, 3),
            **overlap,
        )
