"""Heartbeat records made up for tests: a node's key by index, a record of it in a state."""

from __future__ import annotations

import time
from typing import Any

from p2ptrain.swarm.records import Heartbeat, NodeState

RUN = "test-run"


SOON = time.time() + 600
"""An expiration every validator accepts (records may not expire years ahead)."""


def record(index: int, **fields: Any) -> Heartbeat:
    """A heartbeat of node `index` (run "r", seq 1, training, clocks at 0) with `fields` over it."""
    defaults: dict[str, Any] = {
        "run_id": "r",
        "node_key": bytes([index]) * 32,
        "seq": 1,
        "timestamp": 0.0,
        "expiration": 0.0,
        "state": NodeState.TRAINING,
    }
    return Heartbeat(**{**defaults, **fields})


def key(index: int) -> bytes:
    return bytes([index]) * 32


def beat(index: int, state: NodeState, *, step: int, tokens: int = 100, timestamp: float = 1e9) -> Heartbeat:
    return Heartbeat(
        run_id="r",
        node_key=key(index),
        seq=1,
        timestamp=timestamp,
        expiration=0.0,
        state=state,
        outer_step=step,
        data_addr=f"127.0.0.1:{5000 + index}",
        tokens=tokens,
    )
