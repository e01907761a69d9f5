"""The swarm table: what `p2ptrain status` prints and what nodes log while they run."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from p2ptrain.comm.net.reach import Reach
from p2ptrain.identity import short_id
from p2ptrain.swarm.election import ring_order
from p2ptrain.swarm.records import Heartbeat, NodeState, record_number


def last_ring(heartbeats: list[Heartbeat]) -> dict[str, Any] | None:
    """The latest completed outer step and its ring, derived from the records.

    A node that completed step N publishes outer_step N+1 with its params hash; the members of N
    are those nodes, in the order every node computes (`ring_order`).
    """
    # a record at step 0 with a params hash is nobody's completed step (a stranger's lie)
    finished = [
        beat
        for beat in heartbeats
        if beat.params_hash and beat.outer_step > 0 and beat.state is not NodeState.DEAD
    ]
    if not finished:
        return None
    step = max(beat.outer_step for beat in finished) - 1
    keys = [beat.node_key for beat in finished if beat.outer_step - 1 == step]
    return {"step": step, "members": [key.hex() for key in ring_order(keys, step)]}


def checkpoint_agreement(heartbeats: list[Heartbeat]) -> dict[str, Any] | None:
    """The most announced checkpoint digest among live nodes, and how many of them announce it."""
    announced = [
        beat.ckpt_digest for beat in heartbeats if beat.ckpt_digest and beat.state is not NodeState.DEAD
    ]
    if not announced:
        return None
    digest, count = Counter(announced).most_common(1)[0]
    return {"digest": digest, "agree": count, "of": len(announced)}


def status_json(
    heartbeats: list[Heartbeat],
    now: float | None = None,
    verdicts: dict[bytes, str] | None = None,
    relays: list[Heartbeat] | None = None,
) -> dict[str, Any]:
    """`{"nodes": [...], "relays": [...], "last_ring": {...} | null, "checkpoint": {...} | null}`
    (`status --json`). `relays`: the run's standby relays (bootstrap --relay) that serve now.

    A node's `state` is its record's, or the verdict `membership.observe` reached (gone, silent)."""
    now = time.time() if now is None else now
    verdicts = verdicts or {}
    return {
        "last_ring": last_ring(heartbeats),
        "checkpoint": checkpoint_agreement(heartbeats),
        "relays": [
            {"id": beat.node_key.hex(), "data_addr": beat.data_addr}
            for beat in relays or []
            if beat.data_addr
        ],
        "nodes": [
            {
                "id": beat.node_key.hex(),
                "state": verdicts.get(beat.node_key, beat.state.value),
                "outer_step": beat.outer_step,
                "tokens": beat.tokens,
                # the sender's clock, so only as good as the two clocks agree
                "last_seen_s": round(max(0.0, now - beat.timestamp), 2),
                "params_hash": beat.params_hash,
                "peer_id": beat.peer_id,
                "loss": record_number(beat.extra.get("loss")),
                "allreduce_mbps": record_number(beat.extra.get("allreduce_mbps")),
                "ckpt_digest": beat.ckpt_digest,
                "data_addr": beat.data_addr,
                # "open": peers dialed it back; "closed": behind NAT (it dials out); "": not probed
                "reach": Reach.parse(beat.data_reach).value,
                "ckpt_reach": Reach.parse(beat.ckpt_reach).value,  # its sidecar's, the same way
            }
            for beat in heartbeats
        ],
    }


def _reach(row: dict[str, Any]) -> str:
    """The data port's reachability, and the sidecar's after a slash where it was probed and differs."""
    data, ckpt = row["reach"] or "?", row["ckpt_reach"]
    return f"{data}/{ckpt}" if ckpt and ckpt != data else data


def format_table(
    heartbeats: list[Heartbeat],
    now: float | None = None,
    verdicts: dict[bytes, str] | None = None,
    relays: list[Heartbeat] | None = None,
) -> str:
    """A fixed-width table of the nodes, one line each, then the swarm's summary lines."""
    status = status_json(heartbeats, now, verdicts, relays)
    rows = status["nodes"]
    header = (
        f"{'node':<14}{'state':<10}{'step':>6}{'tokens':>12}{'loss':>8}{'Mbit/s':>9}{'seen':>8}"
        f"  {'reach':<14}{'params':<13}{'ckpt':<13}peer"
    )
    lines = [header, "-" * len(header)]
    for row in rows:
        loss = f"{row['loss']:.3f}" if row["loss"] is not None else "-"
        rate = f"{row['allreduce_mbps']:.0f}" if row["allreduce_mbps"] is not None else "-"
        lines.append(
            f"{short_id(bytes.fromhex(row['id'])):<14}{row['state']:<10}{row['outer_step']:>6}"
            f"{row['tokens']:>12}{loss:>8}{rate:>9}{row['last_seen_s']:>7.1f}s  {_reach(row):<14}"
            f"{row['params_hash'][:12] or '-':<13}{row['ckpt_digest'][:12] or '-':<13}{row['peer_id']}"
        )
    lines.append(f"{len(rows)} node(s)")
    agreement = status["checkpoint"]
    if agreement:
        digest, agree, total = agreement["digest"][:12], agreement["agree"], agreement["of"]
        lines.append(f"checkpoint {digest} announced by {agree} of {total} node(s)")
    ring = last_ring(heartbeats)
    if ring:
        order = " → ".join(short_id(bytes.fromhex(key)) for key in ring["members"])
        lines.append(f"last ring (step {ring['step']}): {order}")
    for relay in status["relays"]:
        lines.append(f"standby relay {short_id(bytes.fromhex(relay['id']))} at {relay['data_addr']}")
    return "\n".join(lines)
