"""Signed heartbeats and the validator, checked record by record (the DHT-level tests are in test_swarm)."""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from typing import Any

import msgpack
import pytest
from hivemind.dht.validation import DHTRecord
from hypothesis import given, settings
from hypothesis import strategies as st

from p2ptrain.identity import NodeIdentity, load_or_create_identity
from p2ptrain.identity import verify as identity_verify
from p2ptrain.swarm.records import (
    MAX_RECORD_BYTES,
    Heartbeat,
    NodeState,
    RecordError,
    decode_heartbeat,
    heartbeat_key,
)
from p2ptrain.swarm.validator import HeartbeatValidator, key_id
from tests.support.records import RUN, SOON

Identities = tuple[NodeIdentity, NodeIdentity]


@pytest.fixture(scope="module")
def identities(tmp_path_factory: pytest.TempPathFactory) -> Identities:
    root = tmp_path_factory.mktemp("ids")
    return load_or_create_identity(root / "a"), load_or_create_identity(root / "b")


def beat(identity: NodeIdentity, seq: int = 1, expiration: float = SOON, **changes: Any) -> Heartbeat:
    fields: dict[str, Any] = dict(
        run_id=RUN,
        node_key=identity.public_key,
        seq=seq,
        timestamp=1.0,
        expiration=expiration,
        state=NodeState.IDLE,
    )
    fields.update(changes)
    return Heartbeat(**fields)


def as_record(value: bytes, subkey: bytes, *, expiration: float = SOON, run: str = RUN) -> DHTRecord:
    """The record as hivemind hands it to validators: msgpack-serialized value and subkey."""
    return DHTRecord(key_id(heartbeat_key(run)), msgpack.packb(subkey), msgpack.packb(value), expiration)


def test_round_trip(identities: Identities) -> None:
    a, _ = identities
    record = beat(a, outer_step=7, tokens=123, params_hash="ab" * 32, state=NodeState.TRAINING)
    assert decode_heartbeat(record.sign(a)) == record


def test_signed_record_is_small(identities: Identities) -> None:
    a, _ = identities
    long = beat(a, data_addr="x" * 200, ckpt_addr="y" * 200, params_hash="f" * 64, ckpt_digest="e" * 64)
    assert len(long.sign(a)) < MAX_RECORD_BYTES


def test_cannot_sign_for_another_node(identities: Identities) -> None:
    a, b = identities
    with pytest.raises(ValueError):
        beat(a).sign(b)


def test_validator_accepts_a_good_record(identities: Identities) -> None:
    a, _ = identities
    assert HeartbeatValidator((RUN,)).validate(as_record(beat(a).sign(a), a.public_key))


def test_forged_signature_is_refused(identities: Identities) -> None:
    a, b = identities
    version, body, _ = msgpack.unpackb(beat(a).sign(a))
    forged = msgpack.packb([version, body, b.sign(b"p2ptrain/heartbeat/v1\0" + body)])
    assert not HeartbeatValidator((RUN,)).validate(as_record(forged, a.public_key))


def test_tampered_body_is_refused(identities: Identities) -> None:
    a, _ = identities
    version, body, signature = msgpack.unpackb(beat(a).sign(a))
    fields = msgpack.unpackb(body)
    fields["tokens"] = 10**9
    tampered = msgpack.packb([version, msgpack.packb(fields), signature])
    assert not HeartbeatValidator((RUN,)).validate(as_record(tampered, a.public_key))


def test_record_under_another_nodes_subkey_is_refused(identities: Identities) -> None:
    a, b = identities
    assert not HeartbeatValidator((RUN,)).validate(as_record(beat(a).sign(a), b.public_key))


def test_record_moved_to_another_run_is_refused(identities: Identities) -> None:
    a, _ = identities
    assert not HeartbeatValidator((RUN, "other")).validate(
        as_record(beat(a).sign(a), a.public_key, run="other")
    )


def test_extended_expiration_is_refused(identities: Identities) -> None:
    a, _ = identities
    value = beat(a, expiration=100.0).sign(a)
    assert not HeartbeatValidator((RUN,)).validate(as_record(value, a.public_key, expiration=SOON))


def test_replayed_record_is_refused(identities: Identities) -> None:
    a, _ = identities
    validator = HeartbeatValidator((RUN,))
    old, new = beat(a, seq=5).sign(a), beat(a, seq=6).sign(a)
    assert validator.validate(as_record(old, a.public_key))
    assert validator.validate(as_record(new, a.public_key))
    assert validator.validate(as_record(new, a.public_key))  # the same record again (replication) is fine
    assert not validator.validate(as_record(old, a.public_key))
    equivocation = beat(a, seq=6, tokens=1).sign(a)
    assert not validator.validate(as_record(equivocation, a.public_key))


def test_unsigned_and_malformed_values_at_the_run_key_are_refused(identities: Identities) -> None:
    a, _ = identities
    validator = HeartbeatValidator((RUN,))
    key = key_id(heartbeat_key(RUN))
    for value in [msgpack.packb(b"hello"), msgpack.packb(123), msgpack.packb({"a": 1}), b"\xc1garbage"]:
        assert not validator.validate(DHTRecord(key, msgpack.packb(a.public_key), value, SOON))


def test_oversized_record_is_refused(identities: Identities) -> None:
    a, _ = identities
    huge = beat(a, extra={"pad": "x" * 400})
    version, body, signature = msgpack.unpackb(huge.sign(a))
    padded = msgpack.packb([version, body + b"\0" * MAX_RECORD_BYTES, signature])
    assert not HeartbeatValidator((RUN,)).validate(as_record(padded, a.public_key))


def test_bootstrap_validator_still_checks_heartbeats_of_any_run(identities: Identities) -> None:
    a, b = identities
    validator = HeartbeatValidator()
    assert validator.validate(as_record(beat(a).sign(a), a.public_key))
    assert not validator.validate(as_record(beat(a).sign(a), b.public_key))


def test_foreign_keys_allow_small_values_only() -> None:
    validator = HeartbeatValidator((RUN,))
    other = key_id("someone-else")
    assert validator.validate(DHTRecord(other, msgpack.packb(None), msgpack.packb(b"small"), SOON))
    assert not validator.validate(DHTRecord(other, msgpack.packb(None), msgpack.packb(b"x" * 5000), SOON))


def test_states_and_counters_are_checked(identities: Identities) -> None:
    a, _ = identities
    good = beat(a)
    nonfinite = [("timestamp", float("-inf")), ("timestamp", float("nan")), ("expiration", float("inf"))]
    for field, value in [("state", "exploded"), ("seq", -1), ("node_key", b"short"), *nonfinite]:
        body = msgpack.packb({**dataclasses.asdict(good), "state": good.state.value, field: value})
        value_bytes = msgpack.packb([1, body, a.sign(b"p2ptrain/heartbeat/v1\0" + body)])
        with pytest.raises(RecordError):
            decode_heartbeat(value_bytes)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=6000))
def test_decoder_survives_garbage(data: bytes) -> None:
    with contextlib.suppress(RecordError):
        decode_heartbeat(data)


@settings(max_examples=200, deadline=None)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**63), 2**64 - 1)
        | st.floats()
        | st.text(max_size=20)
        | st.binary(max_size=40),
        lambda children: (
            st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
        ),
        max_leaves=20,
    )
)
def test_decoder_survives_wellformed_msgpack_of_any_shape(obj: object) -> None:
    with pytest.raises(RecordError):
        decode_heartbeat(msgpack.packb([1, msgpack.packb(obj), b"s" * 64]))


def test_validator_never_raises_on_garbage(tmp_path: Path) -> None:
    validator = HeartbeatValidator((RUN,))
    key = key_id(heartbeat_key(RUN))
    for value in [b"", b"\x00", b"\xff" * 100, msgpack.packb([1, 2, 3])]:
        assert validator.validate(DHTRecord(key, b"\xc1", value, 0.0)) is False


def test_a_reader_verifies_each_record_once_and_a_changed_byte_again(identities: Identities) -> None:
    """VerifiedRecords: the bytes of the last read are not verified again; any other bytes are."""
    from p2ptrain.swarm.membership import VerifiedRecords

    a, _ = identities
    value = beat(a, seq=5).sign(a)
    verified = VerifiedRecords()
    first = verified.decode(value)
    verified.read_done()
    assert verified.decode(value) is first  # the same bytes: the same, already verified record
    tampered = bytearray(value)
    tampered[-1] ^= 1  # the signature's last byte
    with pytest.raises(RecordError):
        verified.decode(bytes(tampered))
    verified.read_done()
    verified.read_done()  # a read without it: forgotten, so verified afresh next time
    assert verified.decode(value) is not first and verified.decode(value) == first


def test_the_validator_verifies_a_records_bytes_once_and_still_checks_where_they_are_stored(
    identities: Identities, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A get hears the same record from every replica, and nodes poll the key several times a
    second: the validator verifies the signature of given bytes once (a bounded number of them),
    but where they are stored (key, subkey, expiration) and their sequence it checks every time."""
    import p2ptrain.swarm.records as records
    import p2ptrain.swarm.validator as validator_module

    verifications: list[tuple[bytes, ...]] = []

    def counting_verify(*args: bytes) -> bool:
        verifications.append(args)
        return verify(*args)

    verify = identity_verify
    monkeypatch.setattr(records, "verify", counting_verify)
    a, b = identities
    validator = HeartbeatValidator((RUN, "other"))
    value = beat(a, seq=5).sign(a)
    for _ in range(10):
        assert validator.validate(as_record(value, a.public_key))
    assert len(verifications) == 1
    assert not validator.validate(as_record(value, b.public_key))  # under another node's subkey
    assert not validator.validate(as_record(value, a.public_key, run="other"))  # under another run
    assert not validator.validate(as_record(value, a.public_key, expiration=SOON + 60))
    assert validator.validate(as_record(beat(a, seq=6).sign(a), a.public_key))
    assert not validator.validate(as_record(value, a.public_key))  # verified bytes, but replayed now
    tampered = bytearray(value)
    tampered[-1] ^= 1
    assert not validator.validate(as_record(bytes(tampered), a.public_key))
    assert len(verifications) == 3  # seq 6 and the tampered bytes: each verified afresh

    monkeypatch.setattr(validator_module, "MAX_VERIFIED", 2)
    fresh = HeartbeatValidator((RUN,))
    older = [beat(b, seq=seq).sign(b) for seq in (1, 2, 3)]
    for signed in older:
        assert fresh.validate(as_record(signed, b.public_key))
    verifications.clear()
    assert fresh.validate(as_record(older[2], b.public_key))  # among the last two: not again
    assert not fresh.validate(as_record(older[0], b.public_key))  # forgotten: verified, then stale
    assert len(verifications) == 1
