"""The dial-back probe (comm/reach.py) between real data-plane servers on 127.0.0.1, a lying
prober, and malformed requests; and how the election keeps members behind NAT apart."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import pytest

from p2ptrain.ckpt.sidecar import CheckpointSidecar
from p2ptrain.comm.net.reach import NONCE_BYTES, ProbeResult, Reach, network_of
from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.comm.transport.wire import read_frame, write_frame
from p2ptrain.config import CommConfig
from p2ptrain.identity import load_or_create_identity
from p2ptrain.node.reachability import until_answered
from p2ptrain.procs import free_port
from p2ptrain.swarm.election import decide, keep_apart
from p2ptrain.swarm.records import Heartbeat, NodeState


async def started(root: Path, name: str) -> DataPlaneServer:
    server = DataPlaneServer(identity=load_or_create_identity(root / name), comm=CommConfig())
    await server.start("127.0.0.1", 0)
    return server


def test_a_reachable_port_is_proven_open_and_its_address_observed(tmp_path: Path) -> None:
    async def main() -> None:
        asker, prober = await started(tmp_path, "a"), await started(tmp_path, "b")
        try:
            result = await asker.reach.probe([prober.address], asker.address[1])
            assert result.reach is Reach.OPEN and result.observed == "127.0.0.1"
            # the port it names has no listener: the prober answers that it could not dial it
            closed = await asker.reach.probe([prober.address], free_port())
            assert closed.reach is Reach.CLOSED and closed.observed is None
            assert (await asker.reach.probe([], asker.address[1])).reach is Reach.UNKNOWN
        finally:
            await asker.close()
            await prober.close()

    asyncio.run(main())


def test_a_sidecar_is_probed_with_the_data_port(tmp_path: Path) -> None:
    """The prober GETs the asker's sidecar with a second nonce: open where the real sidecar
    answers, closed where nothing listens on the port it names; not probed, unknown."""

    async def main() -> None:
        asker, prober = await started(tmp_path, "a"), await started(tmp_path, "b")
        sidecar = CheckpointSidecar(tmp_path / "ckpt", reach_proof=asker.reach.proof_arrived)
        ckpt_port = await sidecar.start("127.0.0.1", 0)
        try:
            result = await asker.reach.probe([prober.address], asker.address[1], ckpt_port)
            assert result.reach is Reach.OPEN and result.ckpt is Reach.OPEN
            closed = await asker.reach.probe([prober.address], asker.address[1], free_port())
            assert closed.reach is Reach.OPEN and closed.ckpt is Reach.CLOSED
            alone = await asker.reach.probe([prober.address], asker.address[1])
            assert alone.ckpt is Reach.UNKNOWN
        finally:
            await sidecar.close()
            await asker.close()
            await prober.close()

    asyncio.run(main())


def test_a_lying_prober_cannot_make_a_closed_port_look_open(tmp_path: Path) -> None:
    """It answers "dialed: true" without dialing: only the proof at our own listener counts."""

    async def liar(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_frame(reader, 5.0, 0)
        await write_frame(writer, {"kind": "reach-result", "observed": "203.0.113.9", "dialed": True})
        writer.close()

    async def main() -> None:
        asker = await started(tmp_path, "a")
        lying = await asyncio.start_server(liar, "127.0.0.1", 0)
        try:
            result = await asker.reach.probe([lying.sockets[0].getsockname()[:2]], free_port())
            assert result.reach is Reach.CLOSED and result.observed is None, result
        finally:
            lying.close()
            await asker.close()

    asyncio.run(main())


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        ({"kind": "reach", "port": 0, "nonce": b"x" * NONCE_BYTES}, "port must be"),
        ({"kind": "reach", "port": "80", "nonce": b"x" * NONCE_BYTES}, "port must be"),
        ({"kind": "reach", "port": 80, "nonce": b"short"}, "nonce must be"),
    ],
)
def test_malformed_probe_requests_get_a_refusal(tmp_path: Path, request_: dict, reason: str) -> None:
    async def main() -> None:
        prober = await started(tmp_path, "b")
        try:
            reader, writer = await asyncio.open_connection(*prober.address)
            await write_frame(writer, request_)
            answer = await read_frame(reader, 5.0, 0)
            writer.close()
            assert answer.kind == "refuse" and reason in answer.header["reason"], answer.header
        finally:
            await prober.close()

    asyncio.run(main())


def full_listener() -> tuple[socket.socket, list[socket.socket]]:
    """A port whose accept queue is full: the kernel drops further SYNs, so a dial hangs there
    until its timeout (as a dial to a node behind NAT does)."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers: list[socket.socket] = []
    while True:
        filler = socket.socket()
        filler.settimeout(0.5)
        fillers.append(filler)
        try:
            filler.connect(listener.getsockname())
        except (TimeoutError, OSError):
            return listener, fillers


def run_with_a_hanging_port(main: Callable[[socket.socket], Coroutine[Any, Any, None]]) -> None:
    """asyncio.run(main(port)) where a dial to `port` hangs (full_listener); its sockets closed after."""
    hanging, fillers = full_listener()
    try:
        asyncio.run(main(hanging))
    finally:
        for sock in [hanging, *fillers]:
            sock.close()


def test_a_prober_runs_one_probe_per_source_at_a_time(tmp_path: Path) -> None:
    """A second request from the same network while the first one's dial-back hangs is refused:
    one stranger cannot make a node dial a thousand times at once, nor hold every probe slot with
    eight addresses of its network (an IPv6 host often has a whole /64)."""

    async def main(hanging: socket.socket) -> None:
        prober = await started(tmp_path, "b")
        try:
            first_reader, first = await asyncio.open_connection(*prober.address)
            await write_frame(first, {"kind": "reach", "port": hanging.getsockname()[1], "nonce": b"a" * 16})
            while prober.reach.in_flight == 0:  # its dial-back hangs now (for 3 s)
                await asyncio.sleep(0.01)
            second_reader, second = await asyncio.open_connection(
                *prober.address, local_addr=("127.0.0.2", 0)
            )
            await write_frame(second, {"kind": "reach", "port": 9, "nonce": b"b" * 16})
            refused = await read_frame(second_reader, 5, 0)
            assert refused.kind == "refuse" and "running already" in refused.header["reason"]
            answer = await read_frame(first_reader, 10, 0)
            assert answer.kind == "reach-result" and answer.header["dialed"] is False
            first.close()
            second.close()
        finally:
            await prober.close()

    run_with_a_hanging_port(main)


@pytest.mark.parametrize("seconds", [0.0, 10.0])
def test_before_its_first_step_a_node_asks_again_while_a_busy_prober_refused(
    tmp_path: Path, seconds: float
) -> None:
    """A prober busy with the probe of another node of the asker's network refuses it, so that
    probe says nothing (UNKNOWN). Before its first step a node asks again, a second apart: once the
    other probe is over (its dial-back hangs DIAL_TIMEOUT) its own is answered. Without the retries
    it would enter its first step not knowing (and behind NAT, announced as dialable)."""

    async def main(hanging: socket.socket) -> None:
        asker, prober = await started(tmp_path, "a"), await started(tmp_path, "b")
        try:
            _, first = await asyncio.open_connection(*prober.address)
            await write_frame(first, {"kind": "reach", "port": hanging.getsockname()[1], "nonce": b"a" * 16})
            while prober.reach.in_flight == 0:  # its dial-back hangs now (for 3 s)
                await asyncio.sleep(0.01)
            results: list[Reach] = []

            async def probe() -> ProbeResult:
                result = await asker.reach.probe([prober.address], asker.address[1])
                results.append(result.reach)
                return result

            final = await until_answered(probe, lambda: True, seconds)
            assert results[0] is Reach.UNKNOWN  # refused: a probe of this network is running
            if seconds:
                assert final.reach is Reach.OPEN and len(results) >= 2
            else:
                assert final.reach is Reach.UNKNOWN and len(results) == 1
            first.close()
        finally:
            await asker.close()
            await prober.close()

    run_with_a_hanging_port(main)


KEYS = [bytes([index]) * 32 for index in range(6)]


def test_keep_apart_spreads_members_behind_nat_between_reachable_ones() -> None:
    order = [KEYS[0], KEYS[1], KEYS[2], KEYS[3]]
    assert keep_apart(order, {KEYS[2]}) == order  # one alone never sits next to another
    assert keep_apart(order, {KEYS[0], KEYS[2]}) == order  # apart already, wrap included
    assert keep_apart(order, {KEYS[0], KEYS[1]}) == [KEYS[2], KEYS[0], KEYS[3], KEYS[1]]
    # more behind NAT than reachable members: all stay, as few relayed edges as can be (2 here)
    assert keep_apart(order, {KEYS[0], KEYS[1], KEYS[2]}) == [KEYS[3], KEYS[0], KEYS[1], KEYS[2]]
    five = [*order, KEYS[4]]
    spread = keep_apart(five, {KEYS[0], KEYS[1], KEYS[2]})
    assert spread == [KEYS[3], KEYS[0], KEYS[2], KEYS[4], KEYS[1]]  # one relayed edge: 0 → 2
    assert keep_apart(order, set(order)) == order  # no reachable member: nothing to do here


def beat(index: int, reach: str) -> Heartbeat:
    return Heartbeat(
        run_id="r",
        node_key=KEYS[index],
        seq=1,
        timestamp=0.0,
        expiration=0.0,
        state=NodeState.READY,
        outer_step=3,
        data_addr=f"10.0.0.{index + 1}:7000",
        tokens=10,
        data_reach=reach,
    )


def test_the_election_marks_members_behind_nat_and_leaves_none_out_for_it() -> None:
    beats = [beat(0, "open"), beat(1, "closed"), beat(2, "closed"), beat(3, "closed")]
    election = decide(beats, 3, deadline_passed=True)
    assert election is not None and election.left_out == {}
    assert next(member.key for member in election.members) == KEYS[0]  # then the three behind NAT
    assert [member.reachable for member in election.members] == [True, False, False, False]
    # "" (not probed yet) and values a newer node may write count as reachable
    mixed = decide([beat(0, ""), beat(1, "someday"), beat(2, "closed")], 3, deadline_passed=True)
    assert mixed is not None and [member.reachable for member in mixed.members].count(False) == 1


def test_probes_are_counted_per_network() -> None:
    assert network_of("10.1.2.3") == network_of("10.1.2.200") == "10.1.2.0/24"
    assert network_of("2001:db8::1") == network_of("2001:db8::ffff:1") == "2001:db8::/64"
    assert network_of("::ffff:10.1.2.3") == "10.1.2.0/24"  # an IPv4 peer on a dual-stack socket
    assert network_of("?") == "?"
