"""Signed heartbeat records: format, signature and ticket checks (validator.py enforces them in the DHT).

A heartbeat lives in the DHT under the run's key `p2ptrain/<run id>/nodes` (a closed run's key also
names its authority: admission.py), with the node's Ed25519 public key as subkey. Its value is a
msgpack triple (version, body, signature): the body is a msgpack map of the fields below, the
signature covers a domain tag plus the body. The body also names its DHT expiration time, so nobody
can re-store an old record with a longer life.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import hashlib
import logging
import math
from dataclasses import dataclass, field
from typing import Any

import msgpack

from p2ptrain.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, NodeIdentity, short_id, verify
from p2ptrain.swarm.admission import Ticket, TicketError, check_admits, decode_ticket, read_ticket
from p2ptrain.untrusted import UndecodableError, unpack_untrusted

log = logging.getLogger(__name__)

RECORD_VERSION = 1
MAX_RECORD_BYTES = 4096
"""Far below hivemind's ~16 KiB pipe limit; every heartbeat field is short."""
_DOMAIN = b"p2ptrain/heartbeat/v1\0"
_MAX_STRING = 512


class NodeState(str, enum.Enum):
    JOINING = "joining"
    IDLE = "idle"  # connected, no training work attached (bootstrap-era nodes)
    TRAINING = "training"
    READY = "ready"
    SYNCING = "syncing"
    FINISHED = "finished"  # done with the run; still serving its checkpoint to nodes behind it
    LEAVING = "leaving"
    DEAD = "dead"  # the deathrattle: the node is gone, do not wait for its timeout
    RELAY = "relay"  # a helper that trains nothing: relays and probes (bootstrap --relay); own key


FINISHED_FIELD = "finished"
"""`extra` field of the deathrattle of a node that finished the run: True. Its outer_step is then
the run's last, so nodes still behind it know the swarm went past their step."""
OUTER_STEPS_FIELD = "outer_steps"
"""`extra` of a training node: its run's outer steps, train.max_steps (the inner steps of the whole
run) over train.inner_steps, rounded up; more where train.time_box cuts inner phases short. The
status page shows the run's progress from it (a bootstrap peer reads no run config)."""
TOKENS_TOTAL_FIELD = "tokens_total"
"""`extra`: tokens the node has contributed to completed outer steps since it started (the
`tokens` field is its weight in the current step only)."""
STEP_TOKENS_FIELD = "step_tokens"
"""`extra`: tokens the node contributed to the outer step it completed last (0: it took it with
weight 0, catching up)."""
TOKENS_RATE_FIELD = "tokens_per_s"
"""`extra`: the node's tokens per second over its last outer step, inner phase and sync together."""
ROUND_TRIPS_FIELD = "rtts"
"""`extra`: {peer key hex prefix: ms}, the smoothed round trips of the node's lanes to the peers
it sent to (comm/net/paths.py), the newest few; the status shows them beside the links' rates."""


class RecordError(ValueError):
    """A record that fails to parse or verify; the message is the logged reason."""


class StaleRecord(RecordError):
    """A validly signed record older than one already seen from the same node (a replay)."""


def heartbeat_key(run_id: str, authority: bytes | None = None) -> str:
    """The DHT key of a run's heartbeats; a closed run's names the authority that admits its nodes."""
    return f"p2ptrain/{run_id}/nodes" if authority is None else f"p2ptrain/{run_id}/{authority.hex()}/nodes"


def relays_key(run_id: str, authority: bytes | None = None) -> str:
    """The DHT key of a run's standby relays (records in state `relay`): kept apart from the
    nodes' key, so nothing that reads the nodes (elections, liveness, the end of the run) sees them."""
    return heartbeat_key(run_id, authority).removesuffix("/nodes") + "/relays"


@dataclass(frozen=True, kw_only=True)
class Heartbeat:
    run_id: str
    node_key: bytes
    seq: int
    timestamp: float
    expiration: float
    state: NodeState
    outer_step: int = 0
    peer_id: str = ""
    data_addr: str = ""
    ckpt_addr: str = ""
    ckpt_digest: str = ""
    params_hash: str = ""
    tokens: int = 0
    config_digest: str = ""
    data_reach: str = ""
    """Whether others can dial data_addr (comm.reach.Reach: "", "open", "closed")."""
    ckpt_reach: str = ""
    """The same of the sidecar at ckpt_addr ("" where it was not probed)."""
    ticket: bytes = b""
    """The admission ticket of a closed run (admission.Ticket.to_bytes); empty in an open run."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Small fields of later protocol revisions; readers ignore what they do not know."""

    def body(self) -> bytes:
        """The signed bytes: every field in declaration order (no deep copy: `dataclasses.asdict`
        copied `extra` for nothing, and was half of what a DHT peer spent checking a record)."""
        values = {item.name: getattr(self, item.name) for item in dataclasses.fields(self)}
        values["state"] = self.state.value
        return msgpack.packb(values, use_bin_type=True)

    def sign(self, identity: NodeIdentity) -> bytes:
        if identity.public_key != self.node_key:
            raise ValueError("a heartbeat can only be signed by its own node key")
        body = self.body()
        value = msgpack.packb([RECORD_VERSION, body, identity.sign(_DOMAIN + body)], use_bin_type=True)
        if len(value) > MAX_RECORD_BYTES:
            raise ValueError(f"heartbeat of {len(value)} bytes exceeds {MAX_RECORD_BYTES}")
        return value

    @functools.cached_property
    def digest(self) -> bytes:
        """sha256 of the body, computed once (the record is immutable)."""
        return hashlib.sha256(self.body()).digest()

    @functools.cached_property
    def admission(self) -> Ticket | None:
        """The ticket (decode_heartbeat verified its signature), parsed once; None in an open run."""
        return read_ticket(self.ticket) if self.ticket else None

    @property
    def key(self) -> str:
        """The DHT key this record belongs under (a standby relay's: the run's relays key)."""
        admission = self.admission
        authority = admission.authority if admission else None
        if self.state is NodeState.RELAY:
            return relays_key(self.run_id, authority)
        return heartbeat_key(self.run_id, authority)


_FIELDS = {
    "run_id": str,
    "node_key": bytes,
    "seq": int,
    "timestamp": float,
    "expiration": float,
    "state": str,
    "outer_step": int,
    "peer_id": str,
    "data_addr": str,
    "ckpt_addr": str,
    "ckpt_digest": str,
    "params_hash": str,
    "tokens": int,
    "config_digest": str,
    "data_reach": str,
    "ckpt_reach": str,
    "ticket": bytes,
    "extra": dict,
}


def unpack_bounded(data: bytes, max_bytes: int = MAX_RECORD_BYTES) -> Any:
    """msgpack from a stranger, at most `max_bytes`; RecordError with the reason otherwise."""
    try:
        return unpack_untrusted(data, max_bytes)
    except UndecodableError as exc:
        raise RecordError(str(exc)) from None


def decode_heartbeat(value: bytes) -> Heartbeat:
    """Parse and verify a signed heartbeat value; raise RecordError with the reason otherwise."""
    if len(value) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(value)} bytes exceeds {MAX_RECORD_BYTES}")
    envelope = unpack_bounded(value)
    if not (isinstance(envelope, list) and len(envelope) == 3):
        raise RecordError("not a (version, body, signature) triple")
    version, body, signature = envelope
    if version != RECORD_VERSION:
        raise RecordError(f"unsupported record version {version!r}")
    if not isinstance(body, bytes) or not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise RecordError("malformed body or signature")
    fields = unpack_bounded(body)
    if not isinstance(fields, dict) or set(fields) != set(_FIELDS):
        raise RecordError("body does not have the heartbeat fields")
    for name, kind in _FIELDS.items():
        item = fields[name]
        if kind is float and isinstance(item, int) and not isinstance(item, bool):
            item = fields[name] = float(item)
        if not isinstance(item, kind) or (kind is int and isinstance(item, bool)):
            raise RecordError(f"field {name} is not {kind.__name__}")
        if isinstance(item, str) and len(item) > _MAX_STRING:
            raise RecordError(f"field {name} is too long")
    if len(fields["node_key"]) != PUBLIC_KEY_BYTES:
        raise RecordError("node_key is not an Ed25519 public key")
    if fields["seq"] < 0 or fields["tokens"] < 0 or fields["outer_step"] < 0:
        raise RecordError("negative counter")
    if not (math.isfinite(fields["timestamp"]) and math.isfinite(fields["expiration"])):
        raise RecordError("a time that is not a finite number")  # -inf became "last seen inf s ago"
    try:
        fields["state"] = NodeState(fields["state"])
    except ValueError:
        raise RecordError(f"unknown state {fields['state']!r}") from None
    if not verify(fields["node_key"], signature, _DOMAIN + body):
        raise RecordError("bad signature")
    if fields["ticket"]:
        try:
            ticket = decode_ticket(fields["ticket"])
        except TicketError as exc:
            raise RecordError(str(exc)) from None
        if ticket.node_key != fields["node_key"]:
            raise RecordError(f"heartbeat of {short_id(fields['node_key'])} with another node's ticket")
    return Heartbeat(**fields)


def check_admitted(heartbeat: Heartbeat, authority: bytes | None, now: float) -> None:
    """Raise RecordError unless `heartbeat` may take part in the run that `authority` closes
    (any record may in an open run: None). Kept apart from decode_heartbeat, whose verdict on the
    same bytes never changes, because a ticket expires."""
    if authority is None:
        return
    admission = heartbeat.admission
    if admission is None:
        raise RecordError(f"heartbeat of {short_id(heartbeat.node_key)} without an admission ticket")
    try:
        check_admits(admission, heartbeat.node_key, authority=authority, now=now)
    except TicketError as exc:
        raise RecordError(str(exc)) from None


def record_number(value: Any) -> float | None:
    """A finite float from an untrusted `extra` field of a record, or None (an inf reached the
    status page's JSON as `Infinity`, which browsers refuse)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return round(float(value), 4)
    return None


def record_count(value: Any) -> int | None:
    """A non-negative integer from an untrusted `extra` field of a record, or None; at most 2**53,
    which the status page's JavaScript still reads exactly."""
    if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 2**53:
        return value
    return None
