"""Records pushed over the data plane (comm/record_push.py) to a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from pathlib import Path

import pytest

from p2ptrain.comm.net.record_push import MAX_PUSHED_RECORD, RECORD_KIND, RecordPusher, push_record
from p2ptrain.comm.net.server import DataPlaneServer
from p2ptrain.comm.transport.wire import encode_frame
from p2ptrain.config import CommConfig
from p2ptrain.identity import load_or_create_identity
from p2ptrain.node.election_reads import ElectionReads
from p2ptrain.procs import free_port
from p2ptrain.swarm.dht import DHTSettings, SwarmDHT
from p2ptrain.swarm.membership import HeartbeatPublisher, SwarmView
from p2ptrain.swarm.records import NodeState


async def started(root: Path) -> tuple[DataPlaneServer, list[tuple[bytes, str]]]:
    """A server whose sink keeps what it is pushed and holds every record but b"unknown"."""
    server = DataPlaneServer(
        identity=load_or_create_identity(root / "node"), comm=CommConfig(failure_timeout=1.0)
    )
    received: list[tuple[bytes, str]] = []

    def sink(record: bytes, source: str) -> bool:
        received.append((record, source))
        return record != b"unknown"

    server.on_record = sink
    await server.start("127.0.0.1", 0)
    return server, received


async def send_raw(address: tuple[str, int], *frames: tuple[dict, bytes]) -> bytes:
    """Frames as a peer would write them; what the server sent back before it closed."""
    reader, writer = await asyncio.open_connection(*address)
    for header, payload in frames:
        writer.writelines(encode_frame(header, payload))
    await writer.drain()
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    return answer


def test_a_pushed_record_reaches_the_server_whole_and_nothing_else_does(tmp_path: Path) -> None:
    async def main() -> None:
        server, received = await started(tmp_path)
        try:
            record = bytes(range(256)) * 8
            assert await push_record(*server.address, record=record, timeout=2.0)
            # an oversized one, a record frame without its body, and one that came through a relay
            too_big = ({"kind": RECORD_KIND}, b""), ({"kind": "body"}, b"x" * (MAX_PUSHED_RECORD + 1))
            assert await send_raw(server.address, *too_big) == b""
            assert await send_raw(server.address, ({"kind": RECORD_KIND}, b"")) == b""  # times out: 1 s
            # through a relay: serve_relayed reads what the relay's end of the edge hands it
            ends: asyncio.Queue[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = asyncio.Queue()
            relay = await asyncio.start_server(lambda r, w: ends.put_nowait((r, w)), "127.0.0.1", 0)
            reader, writer = await asyncio.open_connection(*relay.sockets[0].getsockname()[:2])
            writer.writelines(encode_frame({"kind": RECORD_KIND}))
            writer.writelines(encode_frame({"kind": "body"}, record[::-1]))
            await writer.drain()
            await asyncio.wait_for(server.serve_relayed(*await ends.get()), 5)
            with contextlib.suppress(ConnectionResetError):  # closed with the body unread
                assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
            relay.close()
            assert received == [(record, "127.0.0.1")]
            assert server.pending_handshakes == 0
        finally:
            await server.close()

    asyncio.run(main())


def test_pushes_go_out_without_waiting_and_one_to_a_dead_port_just_ends(tmp_path: Path) -> None:
    async def main() -> None:
        server, received = await started(tmp_path)
        pusher = RecordPusher(timeout=0.5)
        try:
            pusher.push(b"news", [("127.0.0.1", free_port()), ("127.0.0.1", server.address[1])])
            for _ in range(100):
                if pusher.sent + len(received) == 2 and not pusher.in_flight:
                    break
                await asyncio.sleep(0.05)
            assert received == [(b"news", "127.0.0.1")] and pusher.sent == 1 and pusher.in_flight == 0
        finally:
            pusher.close()
            await server.close()

    asyncio.run(main())


def test_a_push_says_whether_the_receiver_holds_the_record_and_a_silent_one_does_not(
    tmp_path: Path,
) -> None:
    """`held_by_all` is what lets a node elect before its DHT store is done: only receivers that
    answered "held" count, not one that refused the record, nor a port that took the bytes and
    never answered."""

    async def main() -> None:
        server, received = await started(tmp_path)
        silent = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
        silent_port = silent.sockets[0].getsockname()[1]
        pusher = RecordPusher(timeout=0.5)
        try:
            assert await pusher.held_by_all(pusher.push(b"news", [server.address]))
            assert not await pusher.held_by_all(pusher.push(b"unknown", [server.address]))
            both = pusher.push(b"news", [server.address, ("127.0.0.1", silent_port)])
            assert not await pusher.held_by_all(both)
            assert [task.result() for task in both] == [True, False]
            assert not await pusher.held_by_all([])  # pushed to no one: nobody holds it
            assert [record for record, _ in received] == [b"news", b"unknown", b"news"]
        finally:
            pusher.close()
            silent.close()
            await server.close()

    asyncio.run(main())


@pytest.mark.procs
def test_a_record_pushed_during_a_dht_read_ends_the_elections_wait_for_that_read(tmp_path: Path) -> None:
    """ElectionReads: the election's look at the records waits for a DHT read (0.6 s at 16 nodes
    on 2 cores) unless a record pushed meanwhile brings the news first. Here the DHT child is
    stopped (SIGSTOP), so the read cannot end; the push still does."""

    async def main(dht: SwarmDHT, child: int) -> None:
        publisher = HeartbeatPublisher(
            dht, load_or_create_identity(tmp_path / "peer"), run_id="run", ttl=60.0
        )
        assert await publisher.publish(state=NodeState.TRAINING, outer_step=3)
        server, _ = await started(tmp_path)
        reads = ElectionReads(SwarmView(dht, "run", timeout=6.0), "", server)
        try:
            assert [(beat.state, beat.outer_step) for beat in await reads.current()] == [
                (NodeState.TRAINING, 3)
            ]
            os.kill(child, signal.SIGSTOP)
            try:
                look = asyncio.ensure_future(reads.current())  # a DHT read that cannot end now
                await asyncio.sleep(0.2)
                assert not look.done()
                ready = publisher.advance(state=NodeState.READY, outer_step=3)
                assert await push_record(*server.address, record=ready, timeout=2.0)
                beats = await asyncio.wait_for(look, 2.0)
                assert [(beat.state, beat.outer_step) for beat in beats] == [(NodeState.READY, 3)]
            finally:
                os.kill(child, signal.SIGCONT)
        finally:
            reads.stop()
            await server.close()

    with SwarmDHT.start(DHTSettings(listen=["/ip4/127.0.0.1/tcp/0"])) as dht:
        assert dht._pid is not None
        asyncio.run(main(dht, dht._pid))
