"""A member that authenticates correctly, then sends bad frames: the honest member fails cleanly."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from p2ptrain.comm.codec import quant
from p2ptrain.comm.net.attempt import AllReduceError
from p2ptrain.comm.net.budget import (
    MAX_PENDING_HANDSHAKES,
    MAX_PENDING_PER_SOURCE,
    MAX_PROVING_PER_SOURCE,
    ParkingLot,
)
from p2ptrain.comm.net.members import Member, membership_digest
from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.comm.reduce.allreduce import all_reduce
from p2ptrain.comm.reduce.connect import dial_member
from p2ptrain.comm.transport.handshake import HandshakeError, dial
from p2ptrain.comm.transport.seal import TAG_BYTES, FrameSeal
from p2ptrain.comm.transport.wire import MAGIC, PREFIX, VERSION, encode_frame, encode_head
from p2ptrain.config import CommConfig
from p2ptrain.identity import load_or_create_identity
from p2ptrain.procs import ChildProcesses, free_port
from p2ptrain.untrusted import budget_source
from tests.support.flooder import hello
from tests.support.helpers import discard, read_address, settle
from tests.support.ring_procs import run_ring

LENGTH = 1000
STEP = 4


def rs_header(n: int = LENGTH // 2 + 12) -> dict:
    return {"kind": "rs", "step": STEP, "round": 0, "chunk": 0, "n": n}


def nan_params_payload(length: int) -> bytes:
    good = quant.encode_payload(np.ones(length, np.float32), 256)
    blocks = quant.num_blocks(length, 256)
    return np.full(blocks, np.nan, np.float32).tobytes() + bytes(good[4 * blocks :])  # NaN mins


def sealed(seal: FrameSeal, header: dict, payload: bytes | bytearray | memoryview) -> bytes:
    """The frame as the authenticated member sends it: sealed with its own session key."""
    head = encode_head(header, len(payload) + TAG_BYTES)
    out = bytearray(len(payload) + TAG_BYTES)
    seal.seal_into(head, memoryview(payload), memoryview(out))
    return head + bytes(out)


def flipped(frame: bytes, offset: int) -> bytes:
    changed = bytearray(frame)
    changed[offset] ^= 0x01
    return bytes(changed)


GOOD = quant.encode_payload(np.ones(512, np.float32), 256)


def good_frame(seal: FrameSeal) -> bytes:
    return sealed(seal, rs_header(SEGMENT0), bytes(GOOD))


# The honest member (index 0) owns segment 1 and receives segment 0 from the bad one first:
# segment 0 spans [0, 512) with block-aligned bounds.
SEGMENT0 = 512
BAD_FRAMES: dict[str, Callable[[FrameSeal], bytes]] = {
    "wrong payload size": lambda seal: sealed(seal, rs_header(SEGMENT0), b"\x00" * 10),
    "wrong value count": lambda seal: sealed(
        seal, rs_header(7), quant.encode_payload(np.ones(7, np.float32), 256)
    ),
    "non-finite block parameters": lambda seal: sealed(
        seal, rs_header(SEGMENT0), nan_params_payload(SEGMENT0)
    ),
    "garbage": lambda seal: b"GET / HTTP/1.1\r\n\r\n" + b"\x00" * 64,
    "oversized length field": lambda seal: PREFIX.pack(MAGIC, VERSION, 2, 1 << 31) + b"\x80\x00",
    "truncated frame": lambda seal: sealed(seal, rs_header(SEGMENT0), bytes(GOOD))[:-100],
    "wrong step": lambda seal: sealed(seal, {**rs_header(SEGMENT0), "step": STEP + 1}, bytes(GOOD)),
    "not sealed": lambda seal: b"".join(bytes(part) for part in encode_frame(rs_header(SEGMENT0), GOOD)),
    "one payload bit flipped after sealing": lambda seal: flipped(
        sealed(seal, rs_header(SEGMENT0), bytes(GOOD)), -40
    ),
    "one header bit flipped after sealing": lambda seal: flipped(
        sealed(seal, rs_header(SEGMENT0), bytes(GOOD)), 20
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_bad_frame_from_an_authenticated_peer(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> tuple[Exception | None, np.ndarray, np.ndarray]:
        honest_id, bad_id = (
            load_or_create_identity(tmp_path / "honest"),
            load_or_create_identity(tmp_path / "bad"),
        )
        comm = CommConfig(failure_timeout=2.0, topology="ring")
        honest = DataPlaneServer(identity=honest_id, comm=comm, setup_timeout=10.0)
        bad = DataPlaneServer(identity=bad_id, comm=comm, setup_timeout=10.0)
        (honest_host, honest_port), (bad_host, bad_port) = await honest.start(), await bad.start()
        members = [
            Member(key=honest_id.public_key, host=honest_host, port=honest_port),
            Member(key=bad_id.public_key, host=bad_host, port=bad_port),
        ]
        digest = membership_digest(STEP, members)
        bad.expect(
            STEP, [honest_id.public_key], digest=digest
        )  # accept the honest member's dial, then ignore it

        async def misbehave() -> None:
            _, writer, session = await dial_member(
                bad_id, members[0], step=STEP, digest=digest, setup_timeout=10.0, failure_timeout=2.0
            )
            assert session.keys is not None
            writer.write(BAD_FRAMES[case](FrameSeal(session.keys.sending)))
            await writer.drain()
            await asyncio.sleep(5)
            writer.close()

        buffer = np.random.default_rng(0).standard_normal(LENGTH).astype(np.float32)
        before = buffer.copy()
        attacker = asyncio.create_task(misbehave())
        error = None
        try:
            await all_reduce(honest, step=STEP, members=members, buffer=buffer)
        except AllReduceError as exc:
            error = exc
        await discard(attacker)
        await honest.close()
        await bad.close()
        return error, buffer, before

    with caplog.at_level(logging.WARNING, logger="p2ptrain.comm.reduce.allreduce"):
        error, buffer, before = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert isinstance(error, AllReduceError), case
    assert np.array_equal(buffer, before), "the buffer must stay untouched on failure"
    assert any("all-reduce of step" in record.getMessage() for record in caplog.records)


async def idle_connections(
    port: int, source: str, count: int
) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    return [await asyncio.open_connection("127.0.0.1", port, local_addr=(source, 0)) for _ in range(count)]


async def still_open(reader: asyncio.StreamReader, seconds: float = 0.5) -> bool:
    """No end of stream within `seconds` (a close on loopback arrives in well under a millisecond;
    there is no event for "not closed")."""
    try:
        return await asyncio.wait_for(reader.read(1), seconds) != b""
    except asyncio.TimeoutError:
        return True


def test_a_member_behind_a_flooders_address_gets_through_and_the_source_holds_only_its_share(
    tmp_path: Path,
) -> None:
    """A source's idle connections beyond its share displace its oldest idle one (so the source
    never holds more, and memory stays bounded), and a member dialing from that same address — a
    home router or carrier-grade NAT it shares with the flooder — completes its handshake. (Before,
    every newcomer from a source at its share was closed at once: the member with it.) The one
    that gave way is parked: its handshake task ends, the connection stays open (a flooder has
    nothing to reopen)."""

    async def scenario() -> None:
        listener_id, member_id = (
            load_or_create_identity(tmp_path / "l"),
            load_or_create_identity(tmp_path / "m"),
        )
        server = DataPlaneServer(
            identity=listener_id, comm=CommConfig(failure_timeout=5.0), setup_timeout=5.0
        )
        host, port = await server.start()
        idle = await idle_connections(port, "127.0.0.2", MAX_PENDING_PER_SOURCE)
        await settle(lambda: server.pending_handshakes == MAX_PENDING_PER_SOURCE, "the source's share held")
        idle += await idle_connections(port, "127.0.0.2", 1)
        await settle(lambda: server.pending.evicted == 1, "one evicted")
        assert server.pending_handshakes == MAX_PENDING_PER_SOURCE
        parking = server.pending.parking
        assert parking is not None and len(parking) == parking.held_by("127.0.0.2") == 1
        await settle(lambda: len(server._answering) == MAX_PENDING_PER_SOURCE, "the parked one's task ended")
        assert await still_open(idle[0][0]) and parking.closed == 0
        listener = Member(key=listener_id.public_key, host=host, port=port)
        members = [listener, Member(key=member_id.public_key, host="127.0.0.2", port=1)]
        digest = membership_digest(STEP, members)
        server.at_step(STEP)
        registration = server.expect(STEP, [member_id.public_key], digest=digest)
        reader, writer = await asyncio.open_connection(host, port, local_addr=("127.0.0.2", 0))
        await dial(
            reader,
            writer,
            identity=member_id,
            expected_peer=listener_id.public_key,
            step=STEP,
            digest=digest,
            timeout=5.0,
        )
        assert (await asyncio.wait_for(registration.incoming[(member_id.public_key, 0)], 5)) is not None
        writer.close()
        for _, idle_writer in idle:
            idle_writer.close()
        await server.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_parked_connections_are_held_open_within_bounds_and_closed_when_the_node_stops(
    tmp_path: Path,
) -> None:
    """The lot's per-source cap closes that source's oldest parked connection (its dialer reads
    the end), one held past hold_s is closed when the next is parked, and the node's close ends
    the rest: no parked connection outlives its bounds or the node."""

    async def scenario() -> None:
        now = [0.0]
        server = DataPlaneServer(
            identity=load_or_create_identity(tmp_path / "l"),
            comm=CommConfig(failure_timeout=30.0),
            setup_timeout=5.0,
        )
        server.pending.parking = lot = ParkingLot(total=3, per_source=2, hold_s=10.0, clock=lambda: now[0])
        _, port = await server.start()
        idle = await idle_connections(port, "127.0.0.2", MAX_PENDING_PER_SOURCE + 2)
        await settle(lambda: lot.parked == 2, "two parked")
        assert lot.closed == 0 and await still_open(idle[0][0])
        idle += await idle_connections(port, "127.0.0.2", 1)  # the source's third: its first parked closes
        assert await asyncio.wait_for(idle[0][0].read(), 5.0) == b""
        await settle(lambda: lot.parked == 3, "three parked")
        assert (len(lot), lot.held_by("127.0.0.2"), lot.closed) == (2, 2, 1)
        other = await idle_connections(port, "127.0.0.3", MAX_PENDING_PER_SOURCE + 1)
        await settle(lambda: lot.parked == 4, "another source's parked")
        assert (len(lot), lot.closed) == (3, 1) and await still_open(other[0][0])
        now[0] = 11.0  # past hold_s: the next one parked closes the three held
        idle += await idle_connections(port, "127.0.0.2", 1)
        await settle(lambda: lot.parked == 5, "one more parked")
        assert (len(lot), lot.closed) == (1, 4)
        for reader in (idle[1][0], idle[2][0], other[0][0]):
            assert await asyncio.wait_for(reader.read(), 5.0) == b""
        still = idle[3][0]  # the fourth of its source: parked last, at 11
        assert await still_open(still)
        await server.close()
        assert len(lot) == 0 and await asyncio.wait_for(still.read(), 5.0) == b""
        for _, writer in idle + other:
            writer.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_an_ipv6_host_counts_as_its_64_in_every_per_source_budget() -> None:
    """A host given a whole IPv6 /64 would otherwise hold 2⁶⁴ shares of the budgets."""
    assert budget_source(("2001:db8:1:2::1", 4000, 0, 0)) == budget_source(("2001:db8:1:2:ffff::9", 1, 0, 0))
    assert budget_source(("2001:db8:1:2::1", 4000, 0, 0)) == "2001:db8:1:2::/64"
    assert budget_source(("2001:db8:1:3::1", 4000, 0, 0)) != budget_source(("2001:db8:1:2::1", 4000, 0, 0))
    assert budget_source(("fe80::1%eth0", 4000, 0, 2)) == "fe80::/64"
    assert budget_source(("::ffff:192.0.2.7", 4000, 0, 0)) == "192.0.2.7"  # IPv4 on a dual-stack socket
    assert budget_source(("192.0.2.7", 4000)) != budget_source(("192.0.2.8", 4000))  # IPv4: per address
    assert budget_source(None) == "?" and budget_source(("not an address", 1)) == "not an address"


def test_a_member_gets_through_a_full_pool_of_idle_connections(tmp_path: Path) -> None:
    """Idle connections from many sources fill the pool; a member's dial still completes its
    handshake (the oldest idle one gives way), and a hello for a far step is refused at once."""

    async def scenario() -> None:
        listener_id, member_id = (
            load_or_create_identity(tmp_path / "l"),
            load_or_create_identity(tmp_path / "m"),
        )
        server = DataPlaneServer(
            identity=listener_id, comm=CommConfig(failure_timeout=5.0), setup_timeout=5.0
        )
        host, port = await server.start()
        sources = [f"127.0.0.{i}" for i in range(2, 2 + MAX_PENDING_HANDSHAKES // MAX_PENDING_PER_SOURCE + 1)]
        idle = [
            conn
            for source in sources
            for conn in await idle_connections(port, source, MAX_PENDING_PER_SOURCE)
        ]
        await settle(lambda: server.pending_handshakes == MAX_PENDING_HANDSHAKES, "a full pool")
        assert server.pending.evicted >= MAX_PENDING_PER_SOURCE
        listener = Member(key=listener_id.public_key, host=host, port=port)
        members = [listener, Member(key=member_id.public_key, host="127.0.0.1", port=1)]
        digest = membership_digest(STEP, members)
        server.at_step(STEP)
        registration = server.expect(STEP, [member_id.public_key], digest=digest)
        _, writer, _ = await dial_member(
            member_id, listener, step=STEP, digest=digest, setup_timeout=5.0, failure_timeout=5.0
        )
        assert (await asyncio.wait_for(registration.incoming[(member_id.public_key, 0)], 5)) is not None
        writer.close()
        with pytest.raises(HandshakeError, match="far ahead"):
            await dial_member(
                member_id, listener, step=STEP + 1000, digest=digest, setup_timeout=5.0, failure_timeout=5.0
            )
        for _, idle_writer in idle:
            idle_writer.close()
        await server.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))


@pytest.mark.parametrize(("offset", "phase"), [(2_000, "reduce-scatter"), (200_000, "all-gather")])
@pytest.mark.procs
def test_a_bit_flipped_on_the_path_fails_the_step_for_every_member(
    tmp_path: Path, offset: int, phase: str
) -> None:
    """A TCP proxy (its own process) in front of member 1 flips one bit of a frame its predecessor
    sends, after the handshake. Unsealed, every member ended with the same wrong result (flip in
    the reduce-scatter) or with different results (in the all-gather). Now member 1 refuses the
    frame and fails, and so does every member: none takes a result before it knows that all hold
    it (the completion barrier)."""
    children = ChildProcesses()

    def through_proxy(host: str, port: int) -> tuple[str, int]:
        address_file = tmp_path / "proxy.port"
        argv = [
            sys.executable,
            "-m",
            "tests.support.proxy",
            "--target",
            f"{host}:{port}",
            "--flip-at",
            str(offset),
        ]
        children.spawn("proxy", [*argv, "--address-file", str(address_file)], log_path=tmp_path / "proxy.log")
        return "127.0.0.1", int(read_address(address_file))

    comm = CommConfig(chunk_bytes=1 << 16, topology="ring", failure_timeout=3.0)
    try:
        outcomes, results, _ = run_ring(tmp_path, 3, 200_003, comm=comm, proxy=through_proxy, proxied=1)
    finally:
        assert children.stop_all() == []
    assert "flipped a bit" in (tmp_path / "proxy.log").read_text(), phase
    assert len(outcomes) == 3 and not outcomes[1].ok, outcomes
    assert "failed authentication" in outcomes[1].error, outcomes[1].error
    assert results == {}, "nobody takes a result member 1 does not hold"


def test_strangers_proving_keys_for_a_step_do_not_hide_a_member_whose_views_differ(tmp_path: Path) -> None:
    """A member whose hello was refused for another membership is alive and trying: the attempt
    fails with "views differ", blaming nobody. Strangers that prove throw-away keys for the step
    first once filled the bounded set of keys heard from, so the member was then named."""

    async def scenario() -> AllReduceError:
        ours, member = (load_or_create_identity(tmp_path / name) for name in ("ours", "member"))
        server = DataPlaneServer(
            identity=ours, comm=CommConfig(failure_timeout=2.0, topology="ring"), setup_timeout=3.0
        )
        host, port = await server.start()
        members = [
            Member(key=ours.public_key, host=host, port=port),
            Member(key=member.public_key, host="127.0.0.1", port=free_port(), reachable=False),  # it dials us
        ]
        server.at_step(STEP)
        reduce = asyncio.create_task(
            all_reduce(server, step=STEP, members=members, buffer=np.ones(100, np.float32))
        )
        for index in range(40):  # strangers: proven keys, another membership
            stranger = load_or_create_identity(tmp_path / f"stranger{index}")
            reader, writer = await asyncio.open_connection(*server.address)
            with pytest.raises(HandshakeError):
                await dial(
                    reader,
                    writer,
                    identity=stranger,
                    expected_peer=ours.public_key,
                    step=STEP,
                    digest=bytes(32),
                    timeout=2.0,
                )
            writer.close()
        reader, writer = await asyncio.open_connection(*server.address)
        with pytest.raises(HandshakeError, match=r"views differ|membership"):
            await dial(
                reader,
                writer,
                identity=member,
                expected_peer=ours.public_key,
                step=STEP,
                digest=bytes(32),
                timeout=2.0,
            )
        writer.close()
        try:
            with pytest.raises(AllReduceError) as failed:
                await reduce
        finally:
            await server.close()
        return failed.value

    error = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert error.views_differ and error.unresponsive is None, error


def test_hellos_for_a_step_under_way_hold_their_sources_share_until_they_prove_a_key(tmp_path: Path) -> None:
    """One source sends hellos for the step this node is reducing, under made-up keys and digests,
    and never a proof. Each is answered with a signed welcome; those waits held no slot of any
    pool, so one source held a thousand (descriptors ran out). Now they hold the source's share of
    the pool of welcomes waiting for a proof, the rest are refused, and a member still gets in."""

    async def scenario() -> None:
        listener_id, member_id = (load_or_create_identity(tmp_path / n) for n in ("l", "m"))
        server = DataPlaneServer(
            identity=listener_id, comm=CommConfig(failure_timeout=5.0), setup_timeout=5.0
        )
        host, port = await server.start()
        listener = Member(key=listener_id.public_key, host=host, port=port)
        digest = membership_digest(
            STEP, [listener, Member(key=member_id.public_key, host="127.0.0.1", port=1)]
        )
        server.at_step(STEP)
        registration = server.expect(STEP, [member_id.public_key], digest=digest)
        flood = []
        for _ in range(MAX_PROVING_PER_SOURCE + 64):
            _, writer = await asyncio.open_connection(host, port, local_addr=("127.0.0.3", 0))
            writer.write(hello(STEP))  # a made-up key and digest
            flood.append(writer)
        await settle(lambda: server.proving.refused >= 64, "the rest refused")
        assert len(server.proving) == MAX_PROVING_PER_SOURCE
        assert len(server._answering) <= MAX_PROVING_PER_SOURCE + MAX_PENDING_PER_SOURCE
        _, writer, _ = await dial_member(
            member_id, listener, step=STEP, digest=digest, setup_timeout=5.0, failure_timeout=5.0
        )
        assert (await asyncio.wait_for(registration.incoming[(member_id.public_key, 0)], 5)) is not None
        for flooding in [*flood, writer]:
            flooding.close()
        await server.close()

    asyncio.run(asyncio.wait_for(scenario(), 60))
