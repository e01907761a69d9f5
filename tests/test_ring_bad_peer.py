"""A member that authenticates correctly, then sends bad frames: the honest member fails cleanly."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest

from p2ptrain.comm import quant
from p2ptrain.comm.budget import MAX_PENDING_HANDSHAKES, MAX_PENDING_PER_SOURCE
from p2ptrain.comm.connect import dial_member
from p2ptrain.comm.dataplane import membership_digest
from p2ptrain.comm.handshake import HandshakeError
from p2ptrain.comm.ring import AllReduceError, DataPlaneServer, RingMember, RingSettings, ring_all_reduce
from p2ptrain.comm.wire import MAGIC, PREFIX, VERSION, encode_frame
from p2ptrain.identity import load_or_create_identity

LENGTH = 1000
STEP = 4


def rs_header(n: int = LENGTH // 2 + 12) -> dict:
    return {"kind": "rs", "step": STEP, "round": 0, "chunk": 0, "n": n}


def frame(header: dict, payload: bytes) -> bytes:
    return b"".join(bytes(part) for part in encode_frame(header, payload))


def nan_params_payload(length: int) -> bytes:
    good = quant.encode_payload(np.ones(length, np.float32), 256)
    blocks = quant.num_blocks(length, 256)
    return np.full(blocks, np.nan, np.float32).tobytes() + bytes(good[4 * blocks :])  # NaN mins


# The honest member (index 0) owns segment 1 and receives segment 0 from the bad one first:
# segment 0 spans [0, 512) with block-aligned bounds.
SEGMENT0 = 512
BAD_FRAMES = {
    "wrong payload size": frame(rs_header(SEGMENT0), b"\x00" * 10),
    "wrong value count": frame(rs_header(7), quant.encode_payload(np.ones(7, np.float32), 256)),
    "non-finite block parameters": frame(rs_header(SEGMENT0), nan_params_payload(SEGMENT0)),
    "garbage": b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 64,
    "oversized length field": PREFIX.pack(MAGIC, VERSION, 2, 1 << 31) + b"\x80\x00",
    "truncated frame": frame(rs_header(SEGMENT0), quant.encode_payload(np.ones(SEGMENT0, np.float32), 256))[
        :-100
    ],
    "wrong step": frame(
        {**rs_header(SEGMENT0), "step": STEP + 1}, quant.encode_payload(np.ones(SEGMENT0, np.float32), 256)
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_bad_frame_from_an_authenticated_peer(tmp_path: Path, case: str, caplog):
    async def scenario() -> tuple[Exception | None, np.ndarray, np.ndarray]:
        honest_id, bad_id = (
            load_or_create_identity(tmp_path / "honest"),
            load_or_create_identity(tmp_path / "bad"),
        )
        settings = RingSettings(failure_timeout=2.0, setup_timeout=10.0, topology="ring")
        honest, bad = DataPlaneServer(honest_id, settings), DataPlaneServer(bad_id, settings)
        members = [
            RingMember(honest_id.public_key, *await honest.start()),
            RingMember(bad_id.public_key, *await bad.start()),
        ]
        digest = membership_digest(STEP, members)
        bad.expect(STEP, [honest_id.public_key], digest)  # accept the honest member's dial, then ignore it

        async def misbehave() -> None:
            _, writer = await dial_member(bad_id, members[0], STEP, digest, settings)
            writer.write(BAD_FRAMES[case])
            await writer.drain()
            await asyncio.sleep(5)
            writer.close()

        buffer = np.random.default_rng(0).standard_normal(LENGTH).astype(np.float32)
        before = buffer.copy()
        attacker = asyncio.create_task(misbehave())
        error = None
        try:
            await ring_all_reduce(honest, STEP, members, buffer)
        except AllReduceError as exc:
            error = exc
        attacker.cancel()
        await honest.close()
        await bad.close()
        return error, buffer, before

    with caplog.at_level(logging.WARNING, logger="p2ptrain.comm.ring"):
        error, buffer, before = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert isinstance(error, AllReduceError), case
    assert np.array_equal(buffer, before), "the buffer must stay untouched on failure"
    assert any("all-reduce of step" in record.getMessage() for record in caplog.records)


async def idle_connections(port: int, source: str, count: int) -> list[tuple]:
    return [await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)) for _ in range(count)]


async def settle(condition, what: str) -> None:
    for _ in range(300):  # until the server has taken the connections in (bounded)
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(what)


def test_one_source_holds_at_most_its_share_of_pending_handshakes(tmp_path: Path):
    """Idle connections beyond a source's share are closed at once; memory stays bounded."""

    async def scenario() -> None:
        server = DataPlaneServer(load_or_create_identity(tmp_path / "x"), RingSettings(failure_timeout=5.0))
        _, port = await server.start()
        idle = await idle_connections(port, "127.0.0.2", MAX_PENDING_PER_SOURCE)
        await settle(lambda: server.pending_handshakes == MAX_PENDING_PER_SOURCE, "the source's share held")
        reader, writer = (await idle_connections(port, "127.0.0.2", 1))[0]
        assert await asyncio.wait_for(reader.read(), 2.0) == b"", "closed at once"
        assert server.pending_handshakes == MAX_PENDING_PER_SOURCE
        for _, idle_writer in [*idle, (reader, writer)]:
            idle_writer.close()
        await server.close()

    asyncio.run(scenario())


def test_a_member_gets_through_a_full_pool_of_idle_connections(tmp_path: Path):
    """Idle connections from many sources fill the pool; a member's dial still completes its
    handshake (the oldest idle one gives way), and a hello for a far step is refused at once."""

    async def scenario() -> None:
        settings = RingSettings(failure_timeout=5.0, setup_timeout=5.0)
        listener_id, member_id = (
            load_or_create_identity(tmp_path / "l"),
            load_or_create_identity(tmp_path / "m"),
        )
        server = DataPlaneServer(listener_id, settings)
        host, port = await server.start()
        sources = [f"127.0.0.{i}" for i in range(2, 2 + MAX_PENDING_HANDSHAKES // MAX_PENDING_PER_SOURCE + 1)]
        idle = [
            conn
            for source in sources
            for conn in await idle_connections(port, source, MAX_PENDING_PER_SOURCE)
        ]
        await settle(lambda: server.pending_handshakes == MAX_PENDING_HANDSHAKES, "a full pool")
        assert server.pending.evicted >= MAX_PENDING_PER_SOURCE
        listener = RingMember(listener_id.public_key, host, port)
        members = [listener, RingMember(member_id.public_key, "127.0.0.1", 1)]
        digest = membership_digest(STEP, members)
        server.at_step(STEP)
        registration = server.expect(STEP, [member_id.public_key], digest)
        _, writer = await dial_member(member_id, listener, STEP, digest, settings)
        assert (await asyncio.wait_for(registration.incoming[(member_id.public_key, 0)], 5)) is not None
        writer.close()
        with pytest.raises(HandshakeError, match="far ahead"):
            await dial_member(member_id, listener, STEP + 1000, digest, settings)
        for _, idle_writer in idle:
            idle_writer.close()
        await server.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
