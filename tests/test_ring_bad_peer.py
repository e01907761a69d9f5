"""A member that authenticates correctly, then sends bad frames: the honest member fails cleanly."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import numpy as np
import pytest

from p2ptrain.comm import quant
from p2ptrain.comm.dataplane import dial_member, membership_digest
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


def test_handshake_flood_is_capped(tmp_path: Path):
    """Unauthenticated connections beyond the cap are closed at once; memory stays bounded."""
    from p2ptrain.comm.dataplane import MAX_PENDING_HANDSHAKES

    async def scenario() -> int:
        server = DataPlaneServer(load_or_create_identity(tmp_path / "x"), RingSettings(failure_timeout=5.0))
        host, port = await server.start()
        idle = [await asyncio.open_connection(host, port) for _ in range(MAX_PENDING_HANDSHAKES)]
        for _ in range(200):  # until the server has taken them all in (bounded)
            if server.pending_handshakes == MAX_PENDING_HANDSHAKES:
                break
            await asyncio.sleep(0.01)
        assert server.pending_handshakes == MAX_PENDING_HANDSHAKES
        reader, writer = await asyncio.open_connection(host, port)
        closed_at_once = await asyncio.wait_for(reader.read(), 2.0) == b""
        for _, idle_writer in idle:
            idle_writer.close()
        writer.close()
        await server.close()
        return closed_at_once

    assert asyncio.run(scenario())
