"""A flooding client against one node's data port, run as its own process by the tests.

    python -m tests.flooder --target HOST:PORT --mode idle|hellos|reaches [--count N] [--source 127.0.0.2]

- `idle`: keeps `count` TCP connections open that never send a byte, opening a new one whenever
  the node closes one (a stranger's cheapest way to hold a node's handshake slots);
- `hellos`: keeps sending well-formed hellos, each from a fresh key, for outer step 10⁹, `count`
  connections at a time;
- `reaches`: keeps asking for reachability probes (dial-backs to random ports of its address),
  `count` connections at a time.

Connections come from `--source` (another loopback address than the honest nodes' 127.0.0.1, as a
stranger's would come from another host). It runs until SIGTERM and prints one line per second:
the connections it holds and how many the node closed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import secrets
import signal
import sys

from p2ptrain.comm.wire import encode_frame

FAR_STEP = 10**9


def hello() -> bytes:
    header = {
        "kind": "hello",
        "node_key": secrets.token_bytes(32),
        "step": FAR_STEP,
        "attempt": 0,
        "digest": secrets.token_bytes(32),
        "nonce": secrets.token_bytes(32),
        "lane": 0,
    }
    return b"".join(bytes(part) for part in encode_frame(header))


def reach_request() -> bytes:
    header = {"kind": "reach", "port": secrets.randbelow(60000) + 1024, "nonce": secrets.token_bytes(16)}
    return b"".join(bytes(part) for part in encode_frame(header))


class Flood:
    def __init__(self, args: argparse.Namespace):
        self.host, _, port = args.target.rpartition(":")
        self.port = int(port)
        self.args = args
        self.held = 0
        self.closed = 0

    async def one(self) -> None:
        """One connection slot, reopened as soon as the node closes it."""
        while True:
            try:
                reader, writer = await asyncio.open_connection(
                    self.host, self.port, local_addr=(self.args.source, 0)
                )
            except OSError:
                await asyncio.sleep(0.05)
                continue
            self.held += 1
            if self.args.mode == "hellos":
                writer.write(hello())
            elif self.args.mode == "reaches":
                writer.write(reach_request())
            with contextlib.suppress(OSError):
                await reader.read()  # until the node closes it
            self.held -= 1
            self.closed += 1
            writer.close()
            await asyncio.sleep(0.01)

    async def run(self) -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        tasks = [asyncio.create_task(self.one()) for _ in range(self.args.count)]
        while not stop.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            print(f"flooder: holding {self.held}, closed by the node {self.closed}", flush=True)
        for task in tasks:
            task.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--mode", choices=["idle", "hellos", "reaches"], default="idle")
    parser.add_argument("--count", type=int, default=500)
    parser.add_argument("--source", default="127.0.0.2")
    args = parser.parse_args()
    with contextlib.suppress(ValueError, OSError):
        import resource

        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(Flood(args).run())
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
