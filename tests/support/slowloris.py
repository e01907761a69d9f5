"""Slow HTTP clients against one node's checkpoint sidecar, run as their own process by the tests.

    python -m tests.support.slowloris --target HOST:PORT [--count 2000] [--sources 4]

Keeps `count` connections open, spread over `--sources` loopback addresses from 127.0.0.2 on
(strangers' hosts), each sending a request head one byte every second and never finishing it;
a connection the node closes is opened again 3 s later. Runs until SIGTERM, printing one line per
second.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal

REQUEST = b"GET /manifest HTTP/1.1\r\nHost: p2ptrain\r\nX-Slow: " + b"a" * 4096


class Slowloris:
    def __init__(self, args: argparse.Namespace):
        host, _, port = args.target.rpartition(":")
        self.host, self.port, self.args = host, int(port), args
        self.held = self.closed = 0

    async def one(self, source: str) -> None:
        while True:
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port, local_addr=(source, 0))
            except OSError:
                await asyncio.sleep(0.2)
                continue
            self.held += 1
            with contextlib.suppress(OSError):
                for byte in REQUEST:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    with contextlib.suppress(asyncio.TimeoutError):
                        if await asyncio.wait_for(reader.read(1), 1.0) == b"":
                            break  # the node closed it
            self.held -= 1
            self.closed += 1
            writer.close()
            await asyncio.sleep(3.0)

    async def run(self) -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        sources = [f"127.0.0.{2 + index}" for index in range(self.args.sources)]
        tasks = [asyncio.create_task(self.one(sources[i % len(sources)])) for i in range(self.args.count)]
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            print(f"slowloris: holding {self.held}, closed by the node {self.closed}", flush=True)
        for task in tasks:
            task.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--sources", type=int, default=4)
    args = parser.parse_args()
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(Slowloris(args).run())
    os._exit(0)


if __name__ == "__main__":
    main()
