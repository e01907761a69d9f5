"""Signed heartbeat records and the DHT validator that enforces them at every node that stores them.

A heartbeat lives in the DHT under the run's key `p2ptrain/<run id>/nodes` (a closed run's key also
names its authority: admission.py), with the node's Ed25519 public key as subkey. Its value is a
msgpack triple (version, body, signature): the body is a msgpack map of the fields below, the
signature covers a domain tag plus the body. The body also names its DHT expiration time, so nobody
can re-store an old record with a longer life.
"""

from __future__ import annotations

import enum
import functools
import hashlib
import logging
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

import msgpack
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

import p2ptrain.swarm.quiet  # noqa: F401  (hivemind keeps quiet)
from p2ptrain.identity import PUBLIC_KEY_BYTES, SIGNATURE_BYTES, NodeIdentity, short_id, verify
from p2ptrain.swarm.admission import Ticket, TicketError, check_admits, decode_ticket, read_ticket
from p2ptrain.untrusted import ThrottledLog, UndecodableError, unpack_untrusted

log = logging.getLogger(__name__)

RECORD_VERSION = 1
MAX_RECORD_BYTES = 4096
"""Far below hivemind's ~16 KiB pipe limit; every heartbeat field is short."""
MAX_FOREIGN_BYTES = 1024
"""Values at keys that are not ours (a stranger's, or hivemind tooling's) are tolerated up to this."""
MAX_LIFETIME_ANY_RUN = 600.0 + 2 * 3600.0
"""The longest record life any node's settings allow (heartbeat_timeout + max_clock_skew, at their
maxima), plus that clock skew. Nodes of one run may differ in these settings (they are not part of
the shared config), so every validator uses this bound: about two hours, not ten years."""
MAX_PROTECTED_KEYS = 4096
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


def key_id(key: str) -> bytes:
    """The DHTID bytes hivemind hands to validators for `key`."""
    return DHTID.generate(source=key).to_bytes()


@dataclass(frozen=True)
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
        fields = asdict(self)
        fields["state"] = self.state.value
        return msgpack.packb(fields, use_bin_type=True)

    def sign(self, identity: NodeIdentity) -> bytes:
        if identity.public_key != self.node_key:
            raise ValueError("a heartbeat can only be signed by its own node key")
        body = self.body()
        value = msgpack.packb([RECORD_VERSION, body, identity.sign(_DOMAIN + body)], use_bin_type=True)
        if len(value) > MAX_RECORD_BYTES:
            raise ValueError(f"heartbeat of {len(value)} bytes exceeds {MAX_RECORD_BYTES}")
        return value

    @property
    def digest(self) -> bytes:
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


def _unpack(data: bytes, max_bytes: int = MAX_RECORD_BYTES) -> Any:
    try:
        return unpack_untrusted(data, max_bytes)
    except UndecodableError as exc:
        raise RecordError(str(exc)) from None


def decode_heartbeat(value: bytes) -> Heartbeat:
    """Parse and verify a signed heartbeat value; raise RecordError with the reason otherwise."""
    if len(value) > MAX_RECORD_BYTES:
        raise RecordError(f"record of {len(value)} bytes exceeds {MAX_RECORD_BYTES}")
    envelope = _unpack(value)
    if not (isinstance(envelope, list) and len(envelope) == 3):
        raise RecordError("not a (version, body, signature) triple")
    version, body, signature = envelope
    if version != RECORD_VERSION:
        raise RecordError(f"unsupported record version {version!r}")
    if not isinstance(body, bytes) or not isinstance(signature, bytes) or len(signature) != SIGNATURE_BYTES:
        raise RecordError("malformed body or signature")
    fields = _unpack(body)
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
        check_admits(admission, heartbeat.node_key, authority, now)
    except TicketError as exc:
        raise RecordError(str(exc)) from None


def record_number(value: Any) -> float | None:
    """A float from an untrusted `extra` field of a record, or None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and value == value:
        return round(float(value), 4)
    return None


class HeartbeatValidator(RecordValidatorBase):
    """Accepts only records whose signature, key, subkey, expiration and sequence all check out.

    Runs inside every DHT node (bootstrap peers included), so a forged, replayed, oversized or
    malformed heartbeat is refused where it would be stored, not only where it is read.
    `run_ids` are the runs whose key must hold heartbeats only (closed by `authority`, if given).
    A bootstrap peer serves any run: it cannot tell a run's key from a hash, so it protects every
    key at which it has seen a valid heartbeat (DHT keys are hashes of the run id: junk stored
    there first stays only until a heartbeat arrives, and never longer than its expiration). No
    record may expire later than `max_lifetime` seconds from now. A closed run's key names its
    authority, so every validator checks the tickets of its records without knowing the run.
    """

    def __init__(
        self,
        run_ids: tuple[str, ...] = (),
        max_tracked: int = 65536,
        max_lifetime: float = MAX_LIFETIME_ANY_RUN,
        authority: bytes | None = None,
    ):
        self._protected = {
            key_id(key(run, authority)) for run in run_ids for key in (heartbeat_key, relays_key)
        }
        self._learned: OrderedDict[bytes, None] = OrderedDict()
        self._refusals = ThrottledLog(log)
        self._max_lifetime = max_lifetime
        self._latest: OrderedDict[tuple[bytes, bytes], tuple[int, bytes]] = OrderedDict()
        self._max_tracked = max_tracked

    def validate(self, record: DHTRecord) -> bool:
        try:
            self._check(record)
        except StaleRecord as exc:
            # An older replica, or a store that lost a race with a newer one: expected, and refused.
            log.info("refused DHT record: %s", exc)
            return False
        except RecordError as exc:
            self._refusals.warning("refused DHT record: %s", exc)
            return False
        return True

    def _check(self, record: DHTRecord) -> None:
        try:
            heartbeat = decode_heartbeat(_unpack_value(record.value))
        except RecordError:
            if record.key in self._protected or record.key in self._learned:
                raise
            if len(record.value) > MAX_FOREIGN_BYTES:
                raise RecordError(
                    f"foreign value of {len(record.value)} bytes at a non-p2ptrain key"
                ) from None
            return  # a small value under some other key: not ours to judge
        if record.key != key_id(heartbeat.key):
            raise RecordError(f"heartbeat of run {heartbeat.run_id!r} stored under another key")
        admission = heartbeat.admission
        check_admitted(heartbeat, admission.authority if admission else None, get_dht_time())
        if _unpack_value(record.subkey) != heartbeat.node_key:
            raise RecordError(f"heartbeat of {heartbeat.node_key.hex()[:12]} under another node's subkey")
        if record.expiration_time != heartbeat.expiration:
            raise RecordError(f"heartbeat of {heartbeat.node_key.hex()[:12]} with altered expiration")
        ahead = heartbeat.expiration - get_dht_time()
        if ahead > self._max_lifetime:
            raise RecordError(
                f"heartbeat of {heartbeat.node_key.hex()[:12]} expires {ahead:.0f} s from now "
                f"(at most {self._max_lifetime:.0f} s)"
            )
        self._check_sequence(record.key, heartbeat)
        if record.key not in self._protected:
            self._learned[record.key] = None
            self._learned.move_to_end(record.key)
            while len(self._learned) > MAX_PROTECTED_KEYS:
                self._learned.popitem(last=False)

    def _check_sequence(self, key: bytes, heartbeat: Heartbeat) -> None:
        slot = (key, heartbeat.node_key)
        digest = heartbeat.digest
        seen = self._latest.get(slot)
        if seen is not None:
            seq, seen_digest = seen
            if heartbeat.seq < seq:
                raise StaleRecord(
                    f"replayed heartbeat of {heartbeat.node_key.hex()[:12]} (seq {heartbeat.seq} < {seq})"
                )
            if heartbeat.seq == seq and digest != seen_digest:
                raise RecordError(
                    f"two different heartbeats of {heartbeat.node_key.hex()[:12]} with seq {seq}"
                )
        self._latest[slot] = (heartbeat.seq, digest)
        self._latest.move_to_end(slot)
        while len(self._latest) > self._max_tracked:
            self._latest.popitem(last=False)


def _unpack_value(data: bytes | None) -> bytes:
    """hivemind msgpack-serializes values and subkeys; ours are always msgpack bin (bytes)."""
    if data is None:
        raise RecordError("record without subkey")
    value = _unpack(data, MAX_RECORD_BYTES * 4)
    if not isinstance(value, bytes):
        raise RecordError(f"value is {type(value).__name__}, not bytes")
    return value
