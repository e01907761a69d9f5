"""Replaying a missed outer step from its encoded all-reduce result (ckpt/replay.py, the sidecar)."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from p2ptrain.ckpt.replay import (
    RecentResults,
    ReplayError,
    ResultCollector,
    StepResult,
    fetch_result,
    pack_result,
    pack_sparse_result,
    unpack_into,
)
from p2ptrain.ckpt.sidecar import CheckpointSidecar
from p2ptrain.comm.codec import quant, sparse
from p2ptrain.swarm.records import Heartbeat
from tests.support.helpers import settle
from tests.support.records import record

BLOCK = 256


def encoded_chunks(values: np.ndarray, bounds: list[int]) -> list[tuple[int, int, quant.Buffer]]:
    return [(a, b, quant.encode_payload(values[a:b], BLOCK)) for a, b in itertools.pairwise(bounds)]


@pytest.fixture
def result() -> tuple[np.ndarray, bytes]:
    return dense_step()


def dense_step() -> tuple[np.ndarray, bytes]:
    """(what every member decoded, the packed result) of a 10 000-value step 7 in three chunks."""
    values = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    chunks = encoded_chunks(values, [0, 4096, 8192, 10_000])
    decoded = np.empty_like(values)
    for start, stop, payload in chunks:
        quant.dequantize(quant.decode_payload(payload, stop - start, block=BLOCK), decoded[start:stop])
    return decoded, pack_result(7, values.size, block=BLOCK, chunks=chunks[::-1])  # any order in, sorted out


def test_replay_gives_the_members_bytes_exactly(result: tuple[np.ndarray, bytes]) -> None:
    decoded, packed = result
    buffer = np.zeros(decoded.size, np.float32)
    unpack_into(packed, 7, buffer=buffer, block=BLOCK)
    assert buffer.tobytes() == decoded.tobytes()


def test_a_four_bit_result_replays_exactly_and_only_as_four_bits() -> None:
    values = np.random.default_rng(4).standard_normal(5_001).astype(np.float32)
    chunks = [(a, b, quant.encode_payload(values[a:b], BLOCK, bits=4)) for a, b in [(0, 4096), (4096, 5_001)]]
    decoded = np.empty_like(values)
    for start, stop, payload in chunks:
        quant.dequantize(
            quant.decode_payload(payload, stop - start, block=BLOCK, bits=4), decoded[start:stop]
        )
    packed = pack_result(3, values.size, block=BLOCK, chunks=chunks, bits=4)
    buffer = np.zeros_like(values)
    unpack_into(packed, 3, buffer=buffer, block=BLOCK, bits=4)
    assert buffer.tobytes() == decoded.tobytes()
    with pytest.raises(ReplayError, match="bits"):
        unpack_into(
            packed, 3, buffer=np.zeros_like(values), block=BLOCK
        )  # a node of the 8-bit run refuses it


def sparse_step(members: int = 3, numel: int = 10_000) -> tuple[np.ndarray, bytes, list[bytearray]]:
    """(what every member of a sparse step took, its packed record, the shares) of step 5."""
    code = sparse.SparseCode()
    shares = [
        sparse.encode(np.random.default_rng(m).standard_normal(numel).astype(np.float32), code)
        for m in range(members)
    ]
    weights = [float(np.float32(1 / members))] * members
    taken = np.zeros(numel, np.float32)
    for share, weight in zip(shares, weights, strict=True):
        sparse.decode_add(share, taken, code, weight=weight)
    return taken, pack_sparse_result(5, numel, code=code, shares=shares, weights=weights), shares


def test_a_sparse_step_replays_as_every_member_summed_it_and_only_in_a_sparse_run() -> None:
    taken, packed, _ = sparse_step()
    buffer = np.full(taken.size, 3.0, np.float32)
    unpack_into(packed, 5, buffer=buffer, block=BLOCK, code=sparse.SparseCode())
    assert buffer.tobytes() == taken.tobytes()
    with pytest.raises(ReplayError, match="another codec"):
        unpack_into(packed, 5, buffer=buffer, block=BLOCK)  # a node of a dense run
    _, dense = dense_step()
    with pytest.raises(ReplayError, match="another codec"):
        unpack_into(dense, 7, buffer=np.zeros(10_000, np.float32), block=BLOCK, code=sparse.SparseCode())
    with pytest.raises(ReplayError, match="chunk, k"):
        unpack_into(packed, 5, buffer=buffer, block=BLOCK, code=sparse.SparseCode(k=32))


@pytest.mark.parametrize("damage", ["share", "weight", "short"])
def test_a_sparse_record_with_a_bad_share_or_weight_is_refused_and_the_buffer_kept(damage: str) -> None:
    _, packed, shares = sparse_step()
    code = sparse.SparseCode()
    if damage == "share":  # the last share's first two indices both 0
        broken = bytearray(packed)
        at = len(packed) - len(shares[-1]) + 8
        broken[at : at + 3] = b"\x00\x00\x00"
        packed = bytes(broken)
    elif damage == "weight":
        packed = pack_sparse_result(5, 10_000, code=code, shares=shares, weights=[0.5, 2.0, 0.5])
    else:
        packed = packed[:-1]
    buffer = np.full(10_000, 3.0, np.float32)
    with pytest.raises(ReplayError):
        unpack_into(packed, 5, buffer=buffer, block=BLOCK, code=code)
    assert (buffer == 3.0).all()


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda p: p[:3], "truncated"),
        (lambda p: p[:-1], "payload of"),
        (lambda p: p + b"x", "left over"),
        (lambda p: b"\xff\xff\xff\x7f" + p[4:], "header length"),
        (lambda p: p[:4] + b"\xc1" * (len(p) - 4), "malformed header"),
    ],
)
def test_malformed_results_are_refused_and_leave_the_buffer_alone(
    result: tuple[np.ndarray, bytes], mutate: Callable[[bytes], bytes], needle: str
) -> None:
    _, packed = result
    buffer = np.full(10_000, 3.0, np.float32)
    with pytest.raises(ReplayError, match=needle):
        unpack_into(mutate(packed), 7, buffer=buffer, block=BLOCK)
    assert (buffer == 3.0).all()


def test_a_result_of_another_step_size_or_with_gaps_is_refused(result: tuple[np.ndarray, bytes]) -> None:
    _, packed = result
    with pytest.raises(ReplayError, match="wanted"):
        unpack_into(packed, 8, buffer=np.zeros(10_000, np.float32), block=BLOCK)
    with pytest.raises(ReplayError, match="wanted"):
        unpack_into(packed, 7, buffer=np.zeros(9_999, np.float32), block=BLOCK)
    values = np.ones(10_000, np.float32)
    gap = pack_result(
        7, 10_000, block=BLOCK, chunks=[c for c in encoded_chunks(values, [0, 4096, 8192, 10_000]) if c[0]]
    )
    with pytest.raises(ReplayError, match="does not continue"):
        unpack_into(gap, 7, buffer=np.zeros(10_000, np.float32), block=BLOCK)
    poisoned = bytearray(pack_result(7, 256, block=BLOCK, chunks=encoded_chunks(values, [0, 256])))
    payload_at = len(poisoned) - quant.payload_size(256, BLOCK)
    poisoned[payload_at : payload_at + 4] = np.float32(np.nan).tobytes()  # the block's min
    with pytest.raises(ReplayError, match="non-finite"):
        unpack_into(bytes(poisoned), 7, buffer=np.zeros(256, np.float32), block=BLOCK)


def one_chunk(value: float) -> StepResult:
    return StepResult(
        numel=BLOCK, block=BLOCK, chunks=encoded_chunks(np.full(BLOCK, value, np.float32), [0, BLOCK])
    )


def test_only_the_last_results_are_kept() -> None:
    kept = RecentResults(2)
    for step in range(4):
        kept.add(step, one_chunk(step))
    assert [kept.packed(step) for step in range(4)] == [
        None,
        None,
        pack_result(2, BLOCK, block=BLOCK, chunks=one_chunk(2).chunks),
        pack_result(3, BLOCK, block=BLOCK, chunks=one_chunk(3).chunks),
    ]
    off = RecentResults(0)
    off.add(1, one_chunk(1))
    assert off.packed(1) is None


def test_the_sidecar_serves_kept_results_and_fetch_skips_peers_without_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        with_result, without = RecentResults(2), RecentResults(2)
        with_result.add(5, one_chunk(5))
        sidecars = [CheckpointSidecar(tmp_path, results=kept) for kept in (without, with_result)]
        ports = [await sidecar.start("127.0.0.1", 0) for sidecar in sidecars]
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        try:
            assert await fetch_result(urls, 5, limit=1 << 20, timeout=5.0) == with_result.packed(5)
            assert await fetch_result(urls, 4, limit=1 << 20, timeout=5.0) is None
            assert await fetch_result(urls[1:], 5, limit=4, timeout=5.0) is None  # larger than the bound
        finally:
            for sidecar in sidecars:
                await sidecar.close()

    with caplog.at_level(logging.INFO, logger="p2ptrain.ckpt.sidecar"):
        asyncio.run(scenario())
    # routine in every join (a node asked for a step it dropped): said, but not as a warning
    misses = [r for r in caplog.records if "no all-reduce result of step 4 kept" in r.getMessage()]
    assert misses and all(record.levelno == logging.INFO for record in misses)


def test_a_collector_keeps_every_result_of_a_download_while_members_keep_two(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A swarm takes six steps while a node downloads its checkpoint; its members keep the last two
    results only, the collector all six (until its bound), each fetched over HTTP as it is made. A
    liar's record at a far step (its sidecar serves nothing) does not move it past a step the honest
    members have not done."""

    async def scenario() -> None:
        kept = RecentResults(2)
        sidecar, liars_sidecar = CheckpointSidecar(tmp_path, results=kept), CheckpointSidecar(tmp_path)
        port, liars_port = await sidecar.start("127.0.0.1", 0), await liars_sidecar.start("127.0.0.1", 0)
        beat = serving_node(port, outer_step=3)
        liar = replace(
            beat, node_key=bytes([1]) * 32, outer_step=10**9, ckpt_addr=f"http://127.0.0.1:{liars_port}"
        )
        peers = [beat, liar]

        async def read() -> list[Heartbeat]:
            return list(peers)

        size = len(pack_result(0, BLOCK, block=BLOCK, chunks=one_chunk(0).chunks))
        collector = ResultCollector(read, 1 << 20, max_bytes=4 * size, timeout=5.0, interval=0.01)
        collector.start(3)
        try:
            for step in range(3, 9):  # the member takes step `step`: its result is made, its record moves on
                kept.add(step, one_chunk(step))
                peers[0] = replace(beat, outer_step=step + 1)
                wanted = min(4, step - 2)

                def collected(wanted: int = wanted) -> bool:
                    return collector.kept == wanted

                await settle(collected, f"the result of step {step}")
            await settle(lambda: not collector.collecting, "the collector stopping at its bound")
            assert kept.packed(3) is None and kept.packed(8) is not None  # the member moved on
            assert collector.take(4) == pack_result(4, BLOCK, block=BLOCK, chunks=one_chunk(4).chunks)
            assert collector.take(3) is None  # older than one taken: dropped
            assert [collector.take(s) for s in (5, 6)] == [
                pack_result(s, BLOCK, block=BLOCK, chunks=one_chunk(s).chunks) for s in (5, 6)
            ]
            assert collector.take(7) is None  # past the bound of 4 results: not collected
        finally:
            collector.stop()
            await sidecar.close()
            await liars_sidecar.close()

    asyncio.run(scenario())
    assert "no more are collected" in caplog.text


def test_a_step_no_member_serves_does_not_hold_up_the_collection_of_the_steps_after_it(
    tmp_path: Path,
) -> None:
    """A fast swarm took steps 3 to 6 between two reads; its member keeps only 5 and 6. The collector
    takes both at its first read: waiting its tries at 3 and 4 first (a round apart, here 60 s), it
    would find 5 and 6 dropped too once the swarm had moved on."""

    async def scenario() -> None:
        kept = RecentResults(2)
        for step in range(3, 7):
            kept.add(step, one_chunk(step))
        sidecar = CheckpointSidecar(tmp_path, results=kept)
        port = await sidecar.start("127.0.0.1", 0)
        beat = serving_node(port, outer_step=7)
        reads = 0

        async def read() -> list[Heartbeat]:
            nonlocal reads
            reads += 1
            return [beat]

        collector = ResultCollector(read, 1 << 20, max_bytes=1 << 20, timeout=5.0, interval=60.0)
        collector.start(3)
        try:
            await settle(lambda: collector.kept == 2, "the results of steps 5 and 6")
            assert reads == 1
            assert [collector.take(s) for s in (3, 4, 5, 6)] == [None, None, kept.packed(5), kept.packed(6)]
        finally:
            collector.stop()
            await sidecar.close()

    asyncio.run(scenario())


def serving_node(port: int, *, outer_step: int) -> Heartbeat:
    """The record of a node at `outer_step` whose sidecar on 127.0.0.1:`port` peers can reach."""
    return record(
        0,
        outer_step=outer_step,
        ckpt_addr=f"http://127.0.0.1:{port}",
        ckpt_reach="open",
    )
