"""Records pushed over the data plane (comm/record_push.py) to a real server on 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path

from p2ptrain.comm.dataplane import DataPlaneServer, RingSettings
from p2ptrain.comm.record_push import MAX_PUSHED_RECORD, RECORD_KIND, RecordPusher, push_record
from p2ptrain.comm.wire import encode_frame
from p2ptrain.identity import load_or_create_identity
from p2ptrain.procs import free_port


async def started(root: Path) -> tuple[DataPlaneServer, list[tuple[bytes, str]]]:
    server = DataPlaneServer(load_or_create_identity(root / "node"), RingSettings(failure_timeout=1.0))
    received: list[tuple[bytes, str]] = []
    server.on_record = lambda record, source: received.append((record, source))
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
            assert await push_record(*server.address, record, timeout=2.0)
            # an oversized one, a record frame without its body, and one that came through a relay
            too_big = ({"kind": RECORD_KIND}, b""), ({"kind": "body"}, b"x" * (MAX_PUSHED_RECORD + 1))
            assert await send_raw(server.address, *too_big) == b""
            assert await send_raw(server.address, ({"kind": RECORD_KIND}, b"")) == b""  # times out: 1 s
            reader, writer = await asyncio.open_connection(*server.address)
            relayed = asyncio.create_task(server.serve_relayed(reader, writer))
            writer.writelines(encode_frame({"kind": RECORD_KIND}))
            await writer.drain()
            await asyncio.wait_for(relayed, 5)
            writer.close()
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
