"""The DHT validator: enforces the heartbeat format (records.py) at every node that stores records.

Kept apart from the record format so that what reads or writes records without a DHT (a pushed
record, the tools) does not import hivemind.
"""

from __future__ import annotations

import functools
import logging
from collections import OrderedDict

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import get_dht_time

import p2ptrain.swarm.quiet  # noqa: F401  (hivemind keeps quiet)
from p2ptrain.swarm.records import (
    MAX_RECORD_BYTES,
    Heartbeat,
    RecordError,
    StaleRecord,
    check_admitted,
    decode_heartbeat,
    heartbeat_key,
    relays_key,
    unpack_bounded,
)
from p2ptrain.untrusted import ThrottledLog

log = logging.getLogger(__name__)

MAX_FOREIGN_BYTES = 1024
"""Values at keys that are not ours (a stranger's, or hivemind tooling's) are tolerated up to this."""
MAX_LIFETIME_ANY_RUN = 600.0 + 2 * 3600.0
"""The longest record life any node's settings allow (heartbeat_timeout + max_clock_skew, at their
maxima), plus that clock skew. Nodes of one run may differ in these settings (they are not part of
the shared config), so every validator uses this bound: about two hours, not ten years."""
MAX_PROTECTED_KEYS = 4096
MAX_VERIFIED = 4096
"""Records kept verified by their exact bytes (at most 4 KiB each: some 20 MiB at most). A flood of
validly signed records under fresh keys can only push honest ones out, to be checked again."""


@functools.lru_cache(maxsize=256)
def key_id(key: str) -> bytes:
    """The DHTID bytes hivemind hands to validators for `key`."""
    return DHTID.generate(source=key).to_bytes()


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
        *,
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
        self._verified: OrderedDict[bytes, Heartbeat] = OrderedDict()
        """Value bytes → the record they decoded to, signature checked. A get hears the same record
        from every replica it asks, and every node polls the key several times a second: checking
        each copy again was most of a DHT process's CPU at 16 nodes (benchmarks.scale). Bytes that
        verified once verify always; what depends on the time or on other records (expiry, ticket,
        sequence) is checked again each time."""

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
            heartbeat = self._decode(record.value)
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

    def _decode(self, value: bytes) -> Heartbeat:
        """decode_heartbeat of the DHT value, or what it gave for these very bytes before."""
        heartbeat = self._verified.get(value)
        if heartbeat is not None:
            self._verified.move_to_end(value)
            return heartbeat
        heartbeat = decode_heartbeat(_unpack_value(value))
        self._verified[value] = heartbeat
        while len(self._verified) > MAX_VERIFIED:
            self._verified.popitem(last=False)
        return heartbeat

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
    value = unpack_bounded(data, MAX_RECORD_BYTES * 4)
    if not isinstance(value, bytes):
        raise RecordError(f"value is {type(value).__name__}, not bytes")
    return value
