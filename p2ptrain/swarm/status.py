"""The swarm table: what `p2ptrain status` prints and what nodes log while they run."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from p2ptrain.comm.net.reach import Reach
from p2ptrain.identity import short_id
from p2ptrain.swarm.election import LINK_PREFIX_HEX, LINKS_FIELD, ring_order
from p2ptrain.swarm.records import (
    OUTER_STEPS_FIELD,
    ROUND_TRIPS_FIELD,
    STEP_TOKENS_FIELD,
    TOKENS_RATE_FIELD,
    TOKENS_TOTAL_FIELD,
    Heartbeat,
    NodeState,
    record_count,
    record_number,
)
from p2ptrain.untrusted import lower_hex

MAX_SHOWN_PATHS = 32
"""Paths shown per node: what an honest record holds (record_extras.MAX_PUBLISHED_LINKS of each
kind); a record claiming more is cut there."""


def measured_paths(extra: dict[str, Any]) -> list[dict[str, Any]]:
    """A node's measured paths from its record (untrusted): per peer key prefix, the round trip
    (ms) and, where the link held our sends up, its rate (Mbit/s); None where not measured."""
    paths: dict[str, dict[str, Any]] = {}
    for field_name, unit, scale in ((ROUND_TRIPS_FIELD, "rtt_ms", 1.0), (LINKS_FIELD, "mbps", 8e-6)):
        published = extra.get(field_name)
        if not isinstance(published, dict):
            continue
        for prefix, value in list(published.items())[:MAX_SHOWN_PATHS]:
            number = record_number(value)
            if not _is_prefix(prefix) or number is None or number < 0:
                continue
            if prefix not in paths and len(paths) >= MAX_SHOWN_PATHS:
                continue
            path = paths.setdefault(prefix, {"to": prefix, "rtt_ms": None, "mbps": None})
            path[unit] = round(number * scale, 1)
    return list(paths.values())


def _is_prefix(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= LINK_PREFIX_HEX and lower_hex(value)


def _completed(heartbeats: list[Heartbeat]) -> list[Heartbeat]:
    """The records that say their node completed outer step `outer_step` − 1 (a params hash with it);
    a record at step 0 with a params hash is nobody's completed step (a stranger's lie)."""
    return [
        beat
        for beat in heartbeats
        if beat.params_hash and beat.outer_step > 0 and beat.state is not NodeState.DEAD
    ]


def _ring(finished: list[Heartbeat], step: int) -> dict[str, Any]:
    """Step `step` and its members in ring order, from the records of the nodes that completed it."""
    keys = [beat.node_key for beat in finished if beat.outer_step - 1 == step]
    return {"step": step, "members": [key.hex() for key in ring_order(keys, step)]}


def last_ring(heartbeats: list[Heartbeat]) -> dict[str, Any] | None:
    """The latest completed outer step and its ring, derived from the records.

    A node that completed step N publishes outer_step N+1 with its params hash; the members of N
    are those nodes, in the order every node computes (`ring_order`).
    """
    finished = _completed(heartbeats)
    if not finished:
        return None
    step = max(beat.outer_step for beat in finished) - 1
    return _ring(finished, step)


def busiest_ring(heartbeats: list[Heartbeat]) -> dict[str, Any] | None:
    """The completed outer step the most live nodes report (the latest of equals), and its ring:
    what a log line may say of the run, where one record's claim must not stand for it."""
    finished = _completed(heartbeats)
    if not finished:
        return None
    counts = Counter(beat.outer_step - 1 for beat in finished)
    step = max(counts, key=lambda at: (counts[at], at))
    return _ring(finished, step)


def checkpoint_agreement(heartbeats: list[Heartbeat]) -> dict[str, Any] | None:
    """The most announced checkpoint digest among live nodes, and how many of them announce it."""
    announced = [
        beat.ckpt_digest for beat in heartbeats if beat.ckpt_digest and beat.state is not NodeState.DEAD
    ]
    if not announced:
        return None
    digest, count = Counter(announced).most_common(1)[0]
    return {"digest": digest, "agree": count, "of": len(announced)}


def planned_steps(heartbeats: list[Heartbeat]) -> int | None:
    """The run's outer steps as most of its records say (OUTER_STEPS_FIELD), or None: a bootstrap
    peer reads no run config, so the nodes say it."""
    plans = Counter(
        value for beat in heartbeats if (value := record_count(beat.extra.get(OUTER_STEPS_FIELD))) is not None
    )
    return plans.most_common(1)[0][0] if plans else None


def run_progress(heartbeats: list[Heartbeat], verdicts: dict[bytes, str] | None = None) -> dict[str, Any]:
    """`{"done", "outer_steps", "tokens", "tokens_per_s"}`: outer steps completed, of how many (None:
    no record says), the tokens the nodes say they contributed (those that left too, while their
    records last) and the swarm's tokens per second (the sum over the nodes still at work), as
    the records claim them."""
    ring = last_ring(heartbeats)
    verdicts = verdicts or {}
    at_work = [
        beat
        for beat in heartbeats
        if beat.state not in (NodeState.DEAD, NodeState.FINISHED) and beat.node_key not in verdicts
    ]
    rates = [record_number(beat.extra.get(TOKENS_RATE_FIELD)) for beat in at_work]
    return {
        "done": ring["step"] + 1 if ring else 0,
        "outer_steps": planned_steps(heartbeats),
        "tokens": sum(record_count(beat.extra.get(TOKENS_TOTAL_FIELD)) or 0 for beat in heartbeats),
        "tokens_per_s": round(sum(rate for rate in rates if rate is not None and rate > 0), 1),
    }


def shares(heartbeats: list[Heartbeat]) -> dict[bytes, float]:
    """Each member's share of the tokens of the last completed step (its weight in the average)."""
    ring = last_ring(heartbeats)
    if ring is None:
        return {}
    members = set(ring["members"])
    tokens = {}
    for beat in heartbeats:
        if beat.node_key.hex() in members:
            counted = record_count(beat.extra.get(STEP_TOKENS_FIELD))
            tokens[beat.node_key] = counted if counted is not None else beat.tokens
    total = sum(tokens.values())
    return {key: round(count / total, 4) for key, count in tokens.items()} if total else {}


def access(authority: bytes | None) -> dict[str, Any]:
    """Whether the run is open to anyone or closed (admission tickets of `authority`)."""
    if authority is None:
        return {"access": "open", "authority": None}
    return {"access": "closed", "authority": authority.hex()}


def run_line(run_id: str, authority: bytes | None) -> str:
    """The table's first line: the run, and whether anyone may join it."""
    if authority is None:
        return f"run {run_id!r}: open (any node that reaches a bootstrap peer may join)"
    return f"run {run_id!r}: closed (nodes admitted by authority {short_id(authority)}…)"


def status_json(
    heartbeats: list[Heartbeat],
    now: float | None = None,
    *,
    verdicts: dict[bytes, str] | None = None,
    relays: list[Heartbeat] | None = None,
    run_id: str = "",
    authority: bytes | None = None,
) -> dict[str, Any]:
    """`{"run", "access", "authority", "progress": {...}, "nodes": [...], "relays": [...],
    "last_ring": {...} | null, "checkpoint": {...} | null}` (`status --json`). `relays`: the run's
    standby relays (bootstrap --relay) that serve now; `authority`: the run's, None if it is open.

    A node's `state` is its record's, or the verdict `membership.observe` reached (gone, silent);
    its `tokens` the running total it says it contributed (None where its record has none), and
    `share` its part of the last step's tokens (None: not a member of it)."""
    now = time.time() if now is None else now
    verdicts = verdicts or {}
    share = shares(heartbeats)
    return {
        "run": run_id,
        **access(authority),
        "progress": run_progress(heartbeats, verdicts),
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
                "tokens": record_count(beat.extra.get(TOKENS_TOTAL_FIELD)),
                "share": share.get(beat.node_key),
                "tokens_per_s": record_number(beat.extra.get(TOKENS_RATE_FIELD)),
                # the sender's clock, so only as good as the two clocks agree
                "last_seen_s": round(max(0.0, now - beat.timestamp), 2),
                "params_hash": beat.params_hash,
                "peer_id": beat.peer_id,
                "loss": record_number(beat.extra.get("loss")),
                # Mbit/s this node sent during its last all-reduce (the transfer, not the election)
                "allreduce_mbps": record_number(beat.extra.get("allreduce_mbps")),
                # the longest smoothed round trip to a member it sent to in that all-reduce (ms)
                "rtt_ms": record_number(beat.extra.get("rtt_ms")),
                # per peer it sent to: the smoothed round trip, and the rate where the link held it up
                "paths": measured_paths(beat.extra),
                "ckpt_digest": beat.ckpt_digest,
                "data_addr": beat.data_addr,
                # "open": peers dialed it back; "closed": behind NAT (it dials out); "": not probed
                "reach": Reach.parse(beat.data_reach).value,
                "ckpt_reach": Reach.parse(beat.ckpt_reach).value,  # its sidecar's, the same way
            }
            for beat in heartbeats
        ],
    }


def progress_line(progress: dict[str, Any]) -> str:
    """The summary line: "progress: 13 of 40 outer steps done, 1,234,567 tokens, 2,345 tok/s"."""
    of = progress["outer_steps"] if progress["outer_steps"] is not None else "?"
    return (
        f"progress: {progress['done']} of {of} outer steps done, {progress['tokens']:,} tokens, "
        f"{progress['tokens_per_s']:,.0f} tok/s"
    )


def _reach(row: dict[str, Any]) -> str:
    """The data port's reachability, and the sidecar's after a slash where it was probed and differs."""
    data, ckpt = row["reach"] or "?", row["ckpt_reach"]
    return f"{data}/{ckpt}" if ckpt and ckpt != data else data


def format_table(
    heartbeats: list[Heartbeat],
    now: float | None = None,
    *,
    verdicts: dict[bytes, str] | None = None,
    relays: list[Heartbeat] | None = None,
    run_id: str = "",
    authority: bytes | None = None,
) -> str:
    """A fixed-width table of the nodes, one line each, then the swarm's summary lines; with
    `run_id`, the run and whether it is open or closed first."""
    status = status_json(heartbeats, now, verdicts=verdicts, relays=relays, authority=authority)
    rows = status["nodes"]
    header = (
        f"{'node':<14}{'state':<10}{'step':>6}{'tokens':>14}{'share':>7}{'loss':>8}{'Mbit/s':>9}{'rtt':>8}"
        f"{'seen':>8}  {'reach':<14}{'params':<13}{'ckpt':<13}peer"
    )
    lines = [run_line(run_id, authority)] if run_id else []
    lines += [header, "-" * len(header)]
    for row in rows:
        loss = f"{row['loss']:.3f}" if row["loss"] is not None else "-"
        rate = f"{row['allreduce_mbps']:.0f}" if row["allreduce_mbps"] is not None else "-"
        rtt = f"{row['rtt_ms']:.0f}ms" if row["rtt_ms"] is not None else "-"
        tokens = f"{row['tokens']:,}" if row["tokens"] is not None else "-"
        share = f"{row['share']:.0%}" if row["share"] is not None else "-"
        lines.append(
            f"{short_id(bytes.fromhex(row['id'])):<14}{row['state']:<10}{row['outer_step']:>6}"
            f"{tokens:>14}{share:>7}{loss:>8}{rate:>9}{rtt:>8}{row['last_seen_s']:>7.1f}s  {_reach(row):<14}"
            f"{row['params_hash'][:12] or '-':<13}{row['ckpt_digest'][:12] or '-':<13}{row['peer_id']}"
        )
    lines.append(f"{len(rows)} node(s); {progress_line(status['progress'])}")
    agreement = status["checkpoint"]
    if agreement:
        digest, agree, total = agreement["digest"][:12], agreement["agree"], agreement["of"]
        lines.append(f"checkpoint {digest} announced by {agree} of {total} node(s)")
    ring = status["last_ring"]
    if ring:
        order = " → ".join(short_id(bytes.fromhex(key)) for key in ring["members"])
        lines.append(f"last ring (step {ring['step']}): {order}")
    for relay in status["relays"]:
        lines.append(f"standby relay {short_id(bytes.fromhex(relay['id']))} at {relay['data_addr']}")
    for row in rows:
        if row["paths"]:
            shown = ", ".join(_path_text(path) for path in row["paths"])
            lines.append(f"paths of {short_id(bytes.fromhex(row['id']))}: {shown}")
    return "\n".join(lines)


def _path_text(path: dict[str, Any]) -> str:
    """ "2f3a9c01d4e5 230 ms 41.5 Mbit/s": a peer, its round trip and its measured rate if any."""
    rtt = f" {path['rtt_ms']:.0f} ms" if path["rtt_ms"] is not None else ""
    rate = f" {path['mbps']:.1f} Mbit/s" if path["mbps"] is not None else ""
    return f"{path['to'][:12]}{rtt}{rate}"
