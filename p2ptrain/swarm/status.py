"""The swarm table: what `p2ptrain status` prints and what nodes log while they run."""

from __future__ import annotations

import time
from typing import Any

from p2ptrain.identity import short_id
from p2ptrain.swarm.election import ring_order
from p2ptrain.swarm.records import Heartbeat, NodeState


def last_ring(heartbeats: list[Heartbeat]) -> dict[str, Any] | None:
    """The latest completed outer step and its ring, derived from the records.

    A node that completed step N publishes outer_step N+1 with its params hash; the members of N
    are those nodes, in the order every node computes (`ring_order`).
    """
    finished = [beat for beat in heartbeats if beat.params_hash and beat.state is not NodeState.DEAD]
    if not finished:
        return None
    step = max(beat.outer_step for beat in finished) - 1
    keys = [beat.node_key for beat in finished if beat.outer_step - 1 == step]
    return {"step": step, "members": [key.hex() for key in ring_order(keys, step)]}


def status_json(heartbeats: list[Heartbeat], now: float | None = None) -> dict[str, Any]:
    """`{"nodes": [...], "last_ring": {...} | null}` as printed by `p2ptrain status --json`."""
    now = time.time() if now is None else now
    return {
        "last_ring": last_ring(heartbeats),
        "nodes": [
            {
                "id": beat.node_key.hex(),
                "state": beat.state.value,
                "outer_step": beat.outer_step,
                "tokens": beat.tokens,
                # the sender's clock, so only as good as the two clocks agree
                "last_seen_s": round(max(0.0, now - beat.timestamp), 2),
                "params_hash": beat.params_hash,
                "peer_id": beat.peer_id,
            }
            for beat in heartbeats
        ],
    }


def format_table(heartbeats: list[Heartbeat], now: float | None = None) -> str:
    """A fixed-width table of the nodes, one line each."""
    rows = status_json(heartbeats, now)["nodes"]
    header = f"{'node':<14}{'state':<10}{'step':>6}{'tokens':>12}{'seen':>8}  peer"
    lines = [header, "-" * len(header)]
    for row in rows:
        lines.append(
            f"{short_id(bytes.fromhex(row['id'])):<14}{row['state']:<10}{row['outer_step']:>6}"
            f"{row['tokens']:>12}{row['last_seen_s']:>7.1f}s  {row['peer_id']}"
        )
    lines.append(f"{len(rows)} node(s)")
    ring = last_ring(heartbeats)
    if ring:
        order = " → ".join(short_id(bytes.fromhex(key)) for key in ring["members"])
        lines.append(f"last ring (step {ring['step']}): {order}")
    return "\n".join(lines)
