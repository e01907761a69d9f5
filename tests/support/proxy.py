"""A TCP proxy on the path to one member, run as its own process by the tests: it forwards both ways
and flips one bit of what the dialer sends, at a byte offset of each connection.

    python -m tests.support.proxy --target HOST:PORT --flip-at N --address-file F

It writes its listening port to F, then runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from pathlib import Path


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, flip_at: int | None) -> None:
    offset = 0
    with contextlib.suppress(OSError):
        while data := await reader.read(1 << 16):
            if flip_at is not None and offset <= flip_at < offset + len(data):
                changed = bytearray(data)
                changed[flip_at - offset] ^= 0x01
                data = bytes(changed)
                print(f"proxy: flipped a bit at byte {flip_at}", flush=True)
            offset += len(data)
            writer.write(data)
            await writer.drain()
    writer.close()


async def main(args: argparse.Namespace) -> None:
    host, _, port = args.target.rpartition(":")

    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        target_reader, target_writer = await asyncio.open_connection(host, int(port))
        await asyncio.gather(pipe(reader, target_writer, args.flip_at), pipe(target_reader, writer, None))

    server = await asyncio.start_server(forward, "127.0.0.1", 0)
    Path(args.address_file).write_text(str(server.sockets[0].getsockname()[1]))
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--flip-at", type=int, default=None)
    parser.add_argument("--address-file", required=True)
    asyncio.run(main(parser.parse_args()))
